"""How long the CLI takes to stop after SIGINT/SIGTERM: flush metrics, write a checkpoint, end the run KILLED.

For each repeat the script starts ``python -m flasync run`` (digits, FedBuff, 30% crashing and 10% hanging clients,
top-k with error feedback, checkpoints every 10 versions, a fresh sqlite MLflow store), waits for the evaluation of
version 10, sends the signal and times the process until it exits. As a baseline measured in the same repeat it
prints the time from launch to that first evaluation (process start-up: imports, data, MLflow), and the ratio.
The figures go to ``benchmarks/results/interrupt.json`` (see ``benchmarks/record.py``).

    python benchmarks/interrupt.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:  # imported as benchmarks.interrupt
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
data: {kind: digits}
population: {num_clients: 100}
server: {kind: fedbuff, buffer_size: 10, concurrency: 20}
eval: {every_versions: 5}
stop: {max_versions: 100000}
faults: {crash: 0.3, hang: 0.1}
resilience: {task_timeout_s: 10.0}
codec: {upload: [{kind: topk, ratio: 0.01}]}
checkpoint: {every_versions: 10}
tracking: {log_model: false}
"""


def _once(sig: signal.Signals) -> tuple[float, float, int]:
    """Return (start-up to version 10's evaluation, signal to exit, exit status)."""
    with tempfile.TemporaryDirectory(prefix="flasync-interrupt-") as tmp:
        folder = Path(tmp)
        (folder / "cfg.yaml").write_text(CONFIG)
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.pop("MLFLOW_TRACKING_URI", None)
        launched = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "flasync", "run", "cfg.yaml", "--tracking-uri", f"sqlite:///{folder}/mlflow.db"],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert process.stdout is not None
        for line in process.stdout:
            if "server.eval" in line and re.search(r"\bversion=10\b", line):
                break
        startup = time.perf_counter() - launched
        signalled = time.perf_counter()
        process.send_signal(sig)
        process.communicate(timeout=300)
        return startup, time.perf_counter() - signalled, process.returncode


def main() -> None:
    """Time the stop for SIGINT and SIGTERM, interleaved."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/interrupt.json)")
    args = parser.parse_args()
    described = machine()
    results: dict[str, list[tuple[float, float, int]]] = {"SIGINT": [], "SIGTERM": []}
    for _ in range(args.repeats):
        for sig in (signal.SIGINT, signal.SIGTERM):
            results[sig.name].append(_once(sig))
    headline: list[Figure] = []
    figures: dict[str, dict[str, object]] = {}
    for name, runs in results.items():
        startup = statistics.median(r[0] for r in runs)
        stop = statistics.median(r[1] for r in runs)
        ratios = statistics.median(r[1] / r[0] for r in runs)
        codes = sorted({r[2] for r in runs})
        print(
            f"{name}: stop {stop:.2f} s (median of {len(runs)}; each {', '.join(f'{r[1]:.2f}' for r in runs)}), "
            f"start-up to version 10 {startup:.2f} s, stop / start-up {ratios:.2f}x (paired median), exit {codes}"
        )
        headline.append(Figure(f"{name} to exit", round(stop, 3), "s", "start-up to version 10", round(ratios, 3)))
        figures[name] = {
            "stop_s": [round(r[1], 3) for r in runs],
            "startup_s": [round(r[0], 3) for r in runs],
            "exit_codes": codes,
        }
    store("interrupt", described, settings={"repeats": args.repeats}, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
