"""``flasync sweep`` against the same runs untracked in one process: what tracking a sweep costs, as a user waits.

    python benchmarks/sweep.py                    # 20 runs of the default config each way: a few minutes on 2 cores
    python benchmarks/sweep.py --runs 10 --repeats 2 --sweep-arg=--no-system-metrics

Two commands, each in a fresh interpreter, alternated in each repeat so that a shared machine's drift hits both:

* ``untracked``: one process runs ``--runs`` runs of the default config (seeds ``0..runs-1``) one after another with
  ``flasync.run``, tracking off: the limit a sweep is measured against;
* ``sweep``: ``python -m flasync sweep --grid seed=0..runs-1`` into a new SQLite store: one MLflow parent run,
  ``--runs`` child runs, one writer process kept across them.

Both print a line as each run starts; this script stamps the lines as they arrive. Printed per command: its wall
seconds (process start to exit) and the median seconds per run after the first (from one run's start line to the
next's, runs 2 to N-1: the last one's end is the process's); then the sweep's wall time over the untracked one's
(goal: below 1.3) and its per-run seconds less the untracked ones (the fixed cost of a tracked run once the writer
process is warm; goal: within 0.2 s). The figures go to ``benchmarks/results/sweep.json`` (see
``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__:  # imported as benchmarks.sweep
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

ROOT = Path(__file__).resolve().parents[1]

# The untracked runs: argv = the number of runs. A line on stderr as each starts, as the sweep writes one.
UNTRACKED = """
import sys
import flasync
from flasync.config import load_config
from flasync.tracking import configure_logging

runs = int(sys.argv[1])
configure_logging(level="warning")
for seed in range(runs):
    print(f"flasync sweep: run {seed + 1}/{runs} seed={seed} started", file=sys.stderr, flush=True)
    flasync.run(load_config(None, [f"seed={seed}", "tracking.enabled=false", "tracking.log_level=warning"]))
"""


def _timed(command: list[str], cwd: str) -> tuple[float, list[float]]:
    """Run ``command``; return its wall seconds and the seconds at which each run's start line arrived."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    starts: list[float] = []
    tail: list[str] = []
    for line in process.stderr:
        if line.startswith("flasync sweep: run ") and line.rstrip().endswith("started"):
            starts.append(time.perf_counter() - start)
        tail = [*tail[-20:], line]
    status = process.wait()
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{command[:4]} exited {status}:\n{''.join(tail)}")
    return wall, starts


def _per_run(starts: list[float]) -> float:
    """Median seconds from one run's start to the next's, the first run's excluded."""
    gaps = [b - a for a, b in itertools.pairwise(starts[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def main() -> None:
    """Time both commands ``--repeats`` times and print the figures and their ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per command (at least 3)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sweep-arg", action="append", default=[], help="one more argument of the sweep command")
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/sweep.json)")
    args = parser.parse_args()
    described = machine()
    print(f"{args.runs} runs of the default config each way, {os.cpu_count()} cores, python {sys.version.split()[0]}")
    print(f"{'repeat':>6} {'command':<10} {'wall s':>8} {'s/run':>7}")
    ratios, costs = [], []
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="flasync-bench-sweep-") as folder:
            plain = _timed([sys.executable, "-c", UNTRACKED, str(args.runs)], folder)
            store_uri = f"sqlite:///{folder}/store/mlflow.db"
            sweep_command = [sys.executable, "-m", "flasync", "sweep", "--grid", f"seed=0..{args.runs - 1}"]
            sweep_command += ["--set", "tracking.log_level=warning", "--tracking-uri", store_uri, *args.sweep_arg]
            swept = _timed(sweep_command, folder)
        for name, (wall, starts) in (("untracked", plain), ("sweep", swept)):
            print(f"{repeat:>6} {name:<10} {wall:>8.2f} {_per_run(starts):>7.3f}")
            rows.append({"repeat": repeat, "command": name, "wall_s": round(wall, 3), "s_per_run": _per_run(starts)})
        ratios.append(swept[0] / plain[0])
        costs.append(_per_run(swept[1]) - _per_run(plain[1]))
    print(f"sweep / untracked wall time: {statistics.median(ratios):.3f}x (goal < 1.3)")
    print(f"sweep's fixed cost per run after the first: {statistics.median(costs):+.3f} s (goal within 0.2 s)")
    sweep_walls = [row["wall_s"] for row in rows if row["command"] == "sweep"]
    headline = [
        Figure(
            f"sweep of {args.runs} runs, wall",
            statistics.median(sweep_walls),
            "s",
            "untracked runs",
            round(statistics.median(ratios), 3),
        ),
        Figure("fixed cost per tracked run after the first", round(statistics.median(costs), 3), "s"),
    ]
    settings = {"runs": args.runs, "repeats": args.repeats, "sweep_args": args.sweep_arg}
    store("sweep", described, settings=settings, headline=headline, figures={"rows": rows}, out=args.out)


if __name__ == "__main__":
    main()
