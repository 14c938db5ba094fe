"""How long a tracked run holds the event loop of the process it runs in, and why: full garbage collections.

Each repeat starts a fresh Python process (as a service that embeds flasync would be: MLflow not imported) that ticks
a coroutine every 10 ms beside one run (digits, 8 versions, wall clock, the model and plots logged) and prints the
worst gap between two ticks, the full (generation 2) collections of Python's garbage collector during the run, the
tracked objects before and after it, and which heavy packages the run imported there. Three kinds of run:
untracked (the baseline measured in the same repeat), tracked to a new SQLite store, and tracked to an MLflow server
that accepts connections and never answers. The ratio is each kind's median worst gap to the untracked one's.

    python benchmarks/loop_gaps.py --repeats 3

Every repeat's figures go to ``benchmarks/results/loop_gaps.json`` (``--out``; see ``benchmarks/record.py``), headed by
each tracked kind's median worst gap against the untracked run's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

if __package__:  # imported as benchmarks.loop_gaps
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("sklearn", "scipy", "pandas", "matplotlib", "mlflow", "mlflow.pytorch")

PROBE = """
import asyncio, gc, json, sys, time
from flasync import tracking
from flasync import Federation
from flasync.testing import small_config

kind, where, heavy = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
full = []
gc.callbacks.append(lambda p, i: full.append(time.perf_counter()) if i["generation"] == 2 and p == "start" else None)

async def main():
    ticks, stop = [], asyncio.Event()
    async def beat():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.01)
    heart = asyncio.create_task(beat())
    await asyncio.sleep(0.03)
    start, objects = time.perf_counter(), len(gc.get_objects())
    overrides = ["clock=wall", "stop.max_versions=8", "tracking.log_model=true"]
    tracker = None
    if kind == "sqlite":
        overrides += ["tracking.enabled=true", f"tracking.uri=sqlite:///{where}/mlflow.db"]
    elif kind == "silent":
        overrides += ["tracking.enabled=true"]
        tracker = tracking.MlflowTracker(where, http_timeout_s=1, http_retries=0, spool_root="spool",
                                         flush_timeout_s=2.0)
    await Federation(small_config(*overrides), tracker=tracker).run()
    stop.set()
    await heart
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    print(json.dumps({"worst_s": max(gaps), "full": sum(1 for t in full if t > start), "objects": objects,
                      "after": len(gc.get_objects()), "heavy": [m for m in heavy if m in sys.modules]}))

asyncio.run(main())
"""


def _silent_server() -> str:
    """Start a thread that accepts connections and never answers; return its URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def _once(kind: str, where: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("MLFLOW_TRACKING_URI", None)
    with tempfile.TemporaryDirectory(prefix="flasync-loop-gaps-") as tmp:
        target = tmp if kind != "silent" else where
        done = subprocess.run(
            [sys.executable, "-c", PROBE, kind, target, ",".join(HEAVY)],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    """Run the repeats and print one line per kind of run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    silent = _silent_server()
    results: dict[str, list[dict[str, Any]]] = {"untracked": [], "sqlite": [], "silent": []}
    for _ in range(args.repeats):
        for kind in results:
            results[kind].append(_once(kind, silent))
    baseline = statistics.median(float(r["worst_s"]) for r in results["untracked"])
    print(f"{'run':<10} {'worst gap (median, max)':>24} {'ratio':>6} {'full GCs':>9} {'objects':>17}  imported here")
    for kind, rows in results.items():
        worst = [float(r["worst_s"]) for r in rows]
        fulls = ",".join(str(r["full"]) for r in rows)
        objects = f"{rows[0]['objects']} -> {rows[0]['after']}"
        heavy = ", ".join(sorted({str(m) for r in rows for m in r["heavy"]})) or "-"
        median = statistics.median(worst)
        print(
            f"{kind:<10} {median * 1000:>11.0f} ms, {max(worst) * 1000:>5.0f} ms {median / baseline:>6.2f}"
            f" {fulls:>9} {objects:>17}  {heavy}"
        )
    headline = [
        Figure(
            f"{kind}: worst event-loop gap (median)",
            statistics.median(float(r["worst_s"]) for r in rows),
            "s",
            None if kind == "untracked" else "untracked",
            None if kind == "untracked" else statistics.median(float(r["worst_s"]) for r in rows) / baseline,
        )
        for kind, rows in results.items()
    ]
    store("loop_gaps", described, settings={"repeats": args.repeats}, headline=headline, figures=results, out=args.out)


if __name__ == "__main__":
    main()
