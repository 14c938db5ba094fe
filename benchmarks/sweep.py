"""``flasync sweep`` against the same runs untracked in one process: what tracking a sweep costs, as a user waits.

    python benchmarks/sweep.py                    # 20 runs of the default config each way: a few minutes on 2 cores
    python benchmarks/sweep.py --runs 10 --repeats 2 --sweep-arg=--no-system-metrics
    python benchmarks/sweep.py --baseline /tmp/base  # and the sweep of another checkout of flasync, interleaved

Two commands (three with ``--baseline``), each in a fresh interpreter, their order changed from one repeat to the next
so that a shared machine's drift hits each:

* ``untracked``: one process runs ``--runs`` runs of the default config (seeds ``0..runs-1``) one after another with
  ``flasync.run``, tracking off: the limit a sweep is measured against;
* ``sweep``: ``python -m flasync sweep --grid seed=0..runs-1`` into a new SQLite store: one MLflow parent run,
  ``--runs`` child runs, one writer process kept across them;
* ``baseline`` (with ``--baseline CHECKOUT``): the same sweep run by another checkout of flasync (e.g. the main
  branch's, ``git worktree add /tmp/base main``), so that a change to the sweep is measured against what it changes
  under the same load.

Each prints a line as each run starts; this script stamps the lines as they arrive. Printed per command: its wall
seconds (process start to exit) and the median seconds per run after the first (from one run's start line to the next's,
runs 2 to N-1: the last one's end is the process's); then the sweep's wall time over the untracked one's (goal: below
1.3) and its per-run seconds less the untracked ones (the fixed cost of a tracked run once the writer process is warm;
goal: within 0.2 s), the same for the baseline, and the sweep's wall time over the baseline's. The CPU seconds of each
command (its process and the processes it waited for, the writer among them) are printed beside, and its median CPU
seconds per run after the first (the CPU time of the command's process and its live children read as each run's start
line arrives): on a shared machine they move less with the load than wall seconds do, where a sweep's writer process
also gets a share of the cores of its own.
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


def _timed(command: list[str], cwd: str, root: Path = ROOT) -> tuple[float, list[float], float, list[float]]:
    """Run ``command`` with the flasync of checkout ``root``; return its wall seconds, the seconds at which each run's
    start line arrived, its CPU seconds, and its CPU seconds so far as each start line arrived."""
    # Every sweep's writer a process of its own, as when these figures were first stored: a writer server left by an
    # earlier command (benchmarks/startup.py measures it) would make only the first command of a run cheaper.
    env = {**os.environ, "PYTHONPATH": str(root), "FLASYNC_WRITER_SERVER": "0"}
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


def _commands(args: argparse.Namespace, folder: str) -> dict[str, tuple[list[str], Path]]:
    """Return each command to time, with the checkout whose flasync it runs."""
    uri = f"sqlite:///{folder}/store/mlflow.db"
    sweep = [sys.executable, "-m", "flasync", "sweep", "--grid", f"seed=0..{args.runs - 1}"]
    sweep += ["--set", "tracking.log_level=warning", "--tracking-uri", uri, *args.sweep_arg]
    commands = {"untracked": ([sys.executable, "-c", UNTRACKED, str(args.runs)], ROOT), "sweep": (sweep, ROOT)}
    if args.baseline is not None:  # its own store: the two sweeps never share one
        other = [*sweep[: sweep.index(uri)], uri.replace("/store/", "/baseline-store/"), *sweep[sweep.index(uri) + 1 :]]
        commands["baseline"] = (other, args.baseline)
    return commands


def _repeat(args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    """Time every command once, in an order rotated by ``repeat``; print and return the repeat's figures."""
    with tempfile.TemporaryDirectory(prefix="flasync-bench-sweep-") as folder:
        commands = _commands(args, folder)
        names = list(commands)
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        if repeat % 2 == 1:
            order.reverse()
        timed, loads = {}, {}
        for name in order:
            before = _load()
            timed[name] = _timed(commands[name][0], folder, commands[name][1])
            loads[name] = (before, _load())
    row: dict[str, Any] = {"repeat": repeat, "order": order}
    for name in names:
        wall, starts, cpu, cpu_starts = timed[name]
        load = loads[name]
        print(
            f"{repeat:>6} {name:<10} {wall:>8.2f} {_per_run(starts):>7.3f} {cpu:>7.1f} "
            f"{_per_run(cpu_starts):>9.3f} {load[0]:>4.2f}-{load[1]:<4.2f}"
        )
        row[name] = {"wall_s": round(wall, 3), "per_run_s": round(_per_run(starts), 4), "cpu_s": round(cpu, 2)}
        row[name] |= {"cpu_per_run_s": round(_per_run(cpu_starts), 4), "load_1m": load}
    plain = timed["untracked"]
    for name, prefix in (("sweep", ""), ("baseline", "baseline_")):
        if name in timed:
            swept = timed[name]
            row[f"{prefix}wall_ratio"] = round(swept[0] / plain[0], 4)
            row[f"{prefix}fixed_cost_per_run_s"] = round(_per_run(swept[1]) - _per_run(plain[1]), 4)
            row[f"{prefix}cpu_ratio"] = round(swept[2] / plain[2], 4)
            row[f"{prefix}cpu_fixed_cost_per_run_s"] = round(_per_run(swept[3]) - _per_run(plain[3]), 4)
    return row


def _median(repeats: list[dict[str, Any]], key: str, digits: int = 4) -> float:
    return round(statistics.median(r[key] for r in repeats), digits)


def main() -> None:
    """Time the commands ``--repeats`` times, print the figures and their ratios and store them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per command (at least 3)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--sweep-arg", action="append", default=[], help="one more argument of the sweep command")
    parser.add_argument("--baseline", type=Path, help="a checkout of flasync whose sweep is timed too (interleaved)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sweep.json", help="results")
    args = parser.parse_args()
    described = machine()
    print(
        f"{args.runs} runs of the default config each way, {described['cpus']} cores ({described['cpu']}), "
        f"python {described['python']}, commit {described['commit']}"
        + (f", baseline {_commit(args.baseline)}" if args.baseline is not None else "")
    )
    print(f"{'repeat':>6} {'command':<10} {'wall s':>8} {'s/run':>7} {'cpu s':>7} {'cpu s/run':>9} {'load':>10}")
    repeats = [_repeat(args, repeat) for repeat in range(args.repeats)]
    median: dict[str, float] = {}
    for prefix, who in (("", "sweep"), ("baseline_", "baseline")):
        if f"{prefix}wall_ratio" not in repeats[0]:
            continue
        for key in ("wall_ratio", "fixed_cost_per_run_s", "cpu_ratio", "cpu_fixed_cost_per_run_s"):
            median[prefix + key] = _median(repeats, prefix + key)
        print(f"{who} / untracked wall time: {median[prefix + 'wall_ratio']:.3f}x (goal < 1.3)")
        print(
            f"{who}'s fixed cost per run after the first: {median[prefix + 'fixed_cost_per_run_s']:+.3f} s (goal 0.2)"
        )
        print(f"{who} / untracked CPU seconds: {median[prefix + 'cpu_ratio']:.3f}x")
        cpu_cost = median[prefix + "cpu_fixed_cost_per_run_s"]
        print(f"{who}'s CPU seconds per run after the first, over the untracked: {cpu_cost:+.3f} s")
    for name in ("untracked", "sweep", "baseline"):
        if name in repeats[0]:
            median[f"{name}_wall_s"] = round(statistics.median(r[name]["wall_s"] for r in repeats), 3)
            median[f"{name}_cpu_s"] = round(statistics.median(r[name]["cpu_s"] for r in repeats), 2)
    if "baseline_wall_s" in median:
        median["wall_vs_baseline"] = round(median["sweep_wall_s"] / median["baseline_wall_s"], 4)
        print(f"sweep / baseline sweep wall time: {median['wall_vs_baseline']:.3f}x")
    headline = [
        Figure(f"sweep of {args.runs} runs, wall s", median["sweep_wall_s"], "s", "untracked", median["wall_ratio"]),
        Figure(f"sweep of {args.runs} runs, CPU s", median["sweep_cpu_s"], "s", "untracked", median["cpu_ratio"]),
        Figure("sweep's fixed cost per run after the first", median["fixed_cost_per_run_s"], "s"),
    ]
    if "baseline_wall_s" in median:
        headline.append(
            Figure(
                f"sweep of {args.runs} runs, wall s",
                median["sweep_wall_s"],
                "s",
                "baseline sweep",
                median["wall_vs_baseline"],
            )
        )
    settings = {"runs": args.runs, "repeats": args.repeats, "sweep_args": args.sweep_arg}
    if args.baseline is not None:
        settings["baseline_commit"] = _commit(args.baseline)
    figures = {
        "median": median,
        "repeats": repeats,
        "goals": {"wall_ratio_below": 1.3, "fixed_cost_per_run_within_s": 0.2},
    }
    store("sweep", described, settings=settings, headline=headline, figures=figures, out=args.out)


def _commit(checkout: Path) -> str:
    """Return the short commit a checkout is at ("" when it is not a git checkout)."""
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip()


if __name__ == "__main__":
    main()
