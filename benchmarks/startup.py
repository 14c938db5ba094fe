"""What a user waits for: the default run from the shell, with and without tracking, phase by phase.

Runs ``python -m flasync run`` (the default experiment) four ways, ``--repeats`` times each, alternating: tracked
into a new SQLite store with no schema kept yet (a new user's very first run: its schema is replayed from the one
flasync ships, or built by MLflow's migrations for an MLflow it ships none for), tracked into
a new store in another folder (its schema a copy of the one the first run kept, see
:func:`flasync.tracking.store.prepare_sqlite_store`), tracked again into that store, and with ``--no-tracking``. Each
repeat
has a cache folder of its own (``XDG_CACHE_HOME``), so the first kind never finds a kept schema.
Every stderr line is time-stamped as it arrives, which gives: the first line, the start of each phase (``run.phase``:
loading the data, starting the MLflow run, logging the artifacts), training (``run.started`` to the last
``server.eval``), the first client update (``run.started`` plus the summary's ``first update``), the moment the
MLflow run exists (``run.opened``: training does not wait for it) and the exit.
Prints the medians and what tracking adds in each stretch.

    python benchmarks/startup.py               # 3 repeats: about two minutes on 2 cores
    python benchmarks/startup.py --repeats 5
    python benchmarks/startup.py --no-system-metrics   # tracked runs without MLflow's system monitor
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKS = {
    "first line": None,
    "torch": "phase='loading flasync and torch'",
    "data": "phase='loading the data",
    "mlflow start": "phase='starting the MLflow run'",
    "training": "run.started",
    "run opened": "run.opened",
    "last eval": "server.eval  version=150/150",
    "artifacts": "phase='logging the artifacts'",
}


def one(folder: Path, tracked: bool, system_metrics: bool = True, cache: Path | None = None) -> dict[str, float]:
    """Run once in ``folder`` (``cache``: the ``XDG_CACHE_HOME`` it sees); return seconds from the command's start
    to each mark and to its exit."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
    args = [sys.executable, "-m", "flasync", "run"]
    if not system_metrics:
        args.append("--no-system-metrics")
    if not tracked:
        args.append("--no-tracking")
    start = time.monotonic()
    process = subprocess.Popen(args, cwd=folder, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stderr is not None and process.stdout is not None
    seen: dict[str, float] = {}
    for line in process.stderr:
        now = time.monotonic() - start
        for mark, needle in MARKS.items():
            if mark not in seen and (needle is None or needle in line):
                seen[mark] = now
    summary = process.stdout.read()  # a few lines: the pipe never fills while stderr is read
    if process.wait() != 0:
        raise SystemExit(f"the run failed (exit {process.returncode})")
    seen["exit"] = time.monotonic() - start
    # The summary's "first update X s" counts from the federation's start, which run.started announces.
    first = re.search(r"first update ([0-9.]+) s", summary)
    if first is not None and "training" in seen:
        seen["first update"] = seen["training"] + float(first.group(1))
    return seen


def main() -> None:
    """Run the repeats and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--no-system-metrics", action="store_true", help="tracked runs without MLflow's system monitor (default: on)"
    )
    args = parser.parse_args()
    kinds = ("first store", "new store", "existing store", "--no-tracking")
    folders = {"first store": "first", "new store": "second", "existing store": "second", "--no-tracking": "second"}
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="flasync-startup-") as tmp:
            for kind in kinds:
                tracked = kind != "--no-tracking"
                where = Path(tmp, folders[kind])
                runs[kind].append(one(where, tracked, not args.no_system_metrics, Path(tmp, "cache")))

    def med(kind: str, mark: str) -> float:
        values = [r[mark] for r in runs[kind] if mark in r]
        return statistics.median(values) if values else float("nan")

    print(f"seconds from the command's start (median of {args.repeats}; the default run)")
    print(f"| mark | {' | '.join(kinds)} |")
    print(f"|---|{'---|' * len(kinds)}")
    marks = list(MARKS)
    marks.insert(marks.index("run opened"), "first update")
    for mark in (*marks, "exit"):
        print(f"| {mark} | {' | '.join(f'{med(kind, mark):.2f}' for kind in kinds)} |")
    u = "--no-tracking"
    for kind in kinds[:3]:
        before = med(kind, "training") - med(u, "training")
        start = med(kind, "training") - med(kind, "mlflow start")
        during = (med(kind, "last eval") - med(kind, "training")) - (med(u, "last eval") - med(u, "training"))
        after = (med(kind, "exit") - med(kind, "last eval")) - (med(u, "exit") - med(u, "last eval"))
        print(f"what tracking adds ({kind}):")
        opened = med(kind, "run opened") - med(kind, "training")
        print(f"  before training   {before:+.2f} s (from starting the MLflow run to training: {start:.2f} s)")
        print(f"                    (the MLflow run exists {opened:+.2f} s after training started)")
        print(f"  training          {during:+.2f} s")
        print(f"  after training    {after:+.2f} s (artifacts, plots, model, closing the run)")
        print(f"  in all            {med(kind, 'exit') - med(u, 'exit'):+.2f} s")


if __name__ == "__main__":
    main()
