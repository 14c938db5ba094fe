"""``flasync sweep`` against the same runs untracked in one process: what tracking a sweep costs, as a user waits.

    python benchmarks/sweep.py                    # 20 runs of the default config each way: a few minutes on 2 cores
    python benchmarks/sweep.py --runs 10 --repeats 2 --sweep-arg=--no-system-metrics

Two commands, each in a fresh interpreter, their order swapped from one repeat to the next so that a shared machine's
drift hits both:

* ``untracked``: one process runs ``--runs`` runs of the default config (seeds ``0..runs-1``) one after another with
  ``flasync.run``, tracking off: the limit a sweep is measured against;
* ``sweep``: ``python -m flasync sweep --grid seed=0..runs-1`` into a new SQLite store: one MLflow parent run,
  ``--runs`` child runs, one writer process kept across them.

Both print a line as each run starts; this script stamps the lines as they arrive. Printed per command: its wall
seconds (process start to exit) and the median seconds per run after the first (from one run's start line to the
next's, runs 2 to N-1: the last one's end is the process's); then the sweep's wall time over the untracked one's
(goal: below 1.3) and its per-run seconds less the untracked ones (the fixed cost of a tracked run once the writer
process is warm; goal: within 0.2 s). The CPU seconds of each command (its process and the processes it waited for,
the writer among them) are printed beside, and its median CPU seconds per run after the first (the CPU time of the
command's process and its live children read as each run's start line arrives): on a shared machine they move less
with the load than wall seconds do, where a sweep's writer process also gets a share of the cores of its own.
Each repeat's figures, their medians, the load average before and after each command and a description of the
machine go to ``benchmarks/results/sweep.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

if __package__:
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


def _cpu() -> float:
    """CPU seconds (user + system) of this process's finished and waited-for descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants so far."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return float("nan")
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _timed(command: list[str], cwd: str) -> tuple[float, list[float], float, list[float]]:
    """Run ``command``; return its wall seconds, the seconds at which each run's start line arrived, its CPU
    seconds, and its CPU seconds so far as each start line arrived."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cpu = _cpu()
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    starts: list[float] = []
    cpu_starts: list[float] = []
    tail: list[str] = []
    try:
        for line in process.stderr:
            if line.startswith("flasync sweep: run ") and line.rstrip().endswith("started"):
                starts.append(time.perf_counter() - start)
                cpu_starts.append(_tree_cpu(process.pid))
            tail = [*tail[-20:], line]
        status = process.wait()
    finally:
        if process.poll() is None:  # interrupted here: the command does not outlive the benchmark
            process.kill()
            process.wait()
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{command[:4]} exited {status}:\n{''.join(tail)}")
    return wall, starts, _cpu() - cpu, cpu_starts


def _per_run(starts: list[float]) -> float:
    """Median seconds from one run's start to the next's, the first run's excluded."""
    gaps = [b - a for a, b in itertools.pairwise(starts[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def _load() -> float:
    """The 1-minute load average (the machine may be shared: a figure is read beside the load it ran under)."""
    return round(os.getloadavg()[0], 2)


def main() -> None:
    """Time both commands ``--repeats`` times, print the figures and their ratios and store them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per command (at least 3)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sweep-arg", action="append", default=[], help="one more argument of the sweep command")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sweep.json", help="results")
    args = parser.parse_args()
    described = machine()
    print(
        f"{args.runs} runs of the default config each way, {described['cpus']} cores ({described['cpu']}), "
        f"python {described['python']}, commit {described['commit']}"
    )
    print(f"{'repeat':>6} {'command':<10} {'wall s':>8} {'s/run':>7} {'cpu s':>7} {'cpu s/run':>9} {'load':>10}")
    ratios, costs, cpu_ratios, cpu_costs, repeats = [], [], [], [], []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="flasync-bench-sweep-") as folder:
            uri = f"sqlite:///{folder}/store/mlflow.db"
            sweep_command = [sys.executable, "-m", "flasync", "sweep", "--grid", f"seed=0..{args.runs - 1}"]
            sweep_command += ["--set", "tracking.log_level=warning", "--tracking-uri", uri, *args.sweep_arg]
            commands = {"untracked": [sys.executable, "-c", UNTRACKED, str(args.runs)], "sweep": sweep_command}
            order = ["untracked", "sweep"] if repeat % 2 == 0 else ["sweep", "untracked"]
            timed, loads = {}, {}
            for name in order:
                before = _load()
                timed[name] = _timed(commands[name], folder)
                loads[name] = (before, _load())
        row: dict[str, Any] = {"repeat": repeat, "order": order}
        for name in ("untracked", "sweep"):
            wall, starts, cpu, cpu_starts = timed[name]
            load = loads[name]
            print(
                f"{repeat:>6} {name:<10} {wall:>8.2f} {_per_run(starts):>7.3f} {cpu:>7.1f} "
                f"{_per_run(cpu_starts):>9.3f} {load[0]:>4.2f}-{load[1]:<4.2f}"
            )
            row[name] = {"wall_s": round(wall, 3), "per_run_s": round(_per_run(starts), 4), "cpu_s": round(cpu, 2)}
            row[name] |= {"cpu_per_run_s": round(_per_run(cpu_starts), 4), "load_1m": load}
        plain, swept = timed["untracked"], timed["sweep"]
        ratios.append(swept[0] / plain[0])
        costs.append(_per_run(swept[1]) - _per_run(plain[1]))
        cpu_ratios.append(swept[2] / plain[2])
        cpu_costs.append(_per_run(swept[3]) - _per_run(plain[3]))
        row |= {
            "wall_ratio": round(ratios[-1], 4),
            "fixed_cost_per_run_s": round(costs[-1], 4),
            "cpu_ratio": round(cpu_ratios[-1], 4),
            "cpu_fixed_cost_per_run_s": round(cpu_costs[-1], 4),
        }
        repeats.append(row)
    ratio, cost = statistics.median(ratios), statistics.median(costs)
    print(f"sweep / untracked wall time: {ratio:.3f}x (goal < 1.3)")
    print(f"sweep's fixed cost per run after the first: {cost:+.3f} s (goal within 0.2 s)")
    print(f"sweep / untracked CPU seconds: {statistics.median(cpu_ratios):.3f}x")
    print(f"sweep's CPU seconds per run after the first, over the untracked: {statistics.median(cpu_costs):+.3f} s")
    median = {
        "wall_ratio": round(ratio, 4),
        "fixed_cost_per_run_s": round(cost, 4),
        "cpu_ratio": round(statistics.median(cpu_ratios), 4),
        "cpu_fixed_cost_per_run_s": round(statistics.median(cpu_costs), 4),
        "untracked_wall_s": round(statistics.median(r["untracked"]["wall_s"] for r in repeats), 3),
        "sweep_wall_s": round(statistics.median(r["sweep"]["wall_s"] for r in repeats), 3),
        "untracked_cpu_s": round(statistics.median(r["untracked"]["cpu_s"] for r in repeats), 2),
        "sweep_cpu_s": round(statistics.median(r["sweep"]["cpu_s"] for r in repeats), 2),
    }
    headline = [
        Figure(f"sweep of {args.runs} runs, wall s", median["sweep_wall_s"], "s", "untracked", median["wall_ratio"]),
        Figure(f"sweep of {args.runs} runs, CPU s", median["sweep_cpu_s"], "s", "untracked", median["cpu_ratio"]),
        Figure("sweep's fixed cost per run after the first", median["fixed_cost_per_run_s"], "s"),
    ]
    settings = {"runs": args.runs, "repeats": args.repeats, "sweep_args": args.sweep_arg}
    figures = {
        "median": median,
        "repeats": repeats,
        "goals": {"wall_ratio_below": 1.3, "fixed_cost_per_run_within_s": 0.2},
    }
    store("sweep", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
