"""How far the store lags behind a run killed with SIGKILL at random points: checkpoints and metrics.

Each trial starts ``python -m flasync run`` (digits, FedBuff, 100 clients, an evaluation every 2 versions and a
checkpoint every 10, tracked into a temporary SQLite store), kills it with SIGKILL at a random moment, and reads the
store: the version of the newest checkpoint, the newest evaluation step stored, and whether every evaluation the
checkpoint covers is stored (a run resumed from it must not miss a step). The lag is in versions behind the last
evaluation the run had printed, and in seconds at the run's own pace.

    python benchmarks/checkpoint_lag.py               # 6 trials, killed 4-20 s after the first evaluation
    python benchmarks/checkpoint_lag.py --trials 3

Every trial goes to ``benchmarks/results/checkpoint_lag.json`` (``--out``; see ``benchmarks/record.py``), headed by
the median lags (no baseline: a lag is measured against the run's own last printed evaluation).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlflow

from flasync.runtime import checkpoint

if __package__:  # imported as benchmarks.checkpoint_lag
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
data: {kind: digits}
population: {num_clients: 100}
server: {kind: fedbuff, buffer_size: 10, concurrency: 20}
eval: {every_versions: 2}
stop: {max_versions: 1000000}
checkpoint: {every_versions: 10}
tracking: {log_model: false}
"""


def trial(folder: Path, kill_after_s: float) -> dict[str, float]:
    """Run, kill at ``kill_after_s`` after the first evaluation, and measure the store."""
    (folder / "run.yaml").write_text(CONFIG)
    store = f"sqlite:///{folder / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "flasync", "run", "run.yaml", "--tracking-uri", store, "--no-system-metrics"],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    run_id, seen, first_at, deadline = None, 0, 0.0, None
    for line in process.stdout:
        found = re.search(r"run_id=(\w{32})", line)
        run_id = run_id or (found.group(1) if found else None)
        version = re.search(r"server\.eval .*\bversion=(\d+)", line)
        if version:
            seen = int(version.group(1))
            if deadline is None:
                first_at = time.monotonic()
                deadline = first_at + kill_after_s
            elif time.monotonic() >= deadline:
                process.send_signal(signal.SIGKILL)
                break
    killed_at = time.monotonic()
    process.communicate(timeout=60)
    assert run_id is not None, "the run printed no run id"
    rate = seen / max(killed_at - first_at, 1e-9)
    client = mlflow.MlflowClient(store)
    steps = {int(m.step) for m in client.get_metric_history(run_id, "server/eval/accuracy")}
    try:
        state = checkpoint.fetch(run_id, store).state
        saved = int(state["version"])
    except checkpoint.CheckpointError:
        saved = 0
    return {
        "killed_at_version": float(seen),
        "checkpoint": float(saved),
        "metrics": float(max(steps, default=0)),
        "covered": float(set(range(2, saved + 1, 2)) <= steps),
        "checkpoint_lag_s": (seen - saved) / rate,
        "metric_lag_s": (seen - max(steps, default=0)) / rate,
    }


def main() -> None:
    """Run the trials and print one row each and the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    rng = random.Random(args.seed)
    rows = []
    columns = ("killed at version", "newest checkpoint", "newest metric step", "covered", "checkpoint lag (s)")
    print(f"| {' | '.join(columns)} | metric lag (s) |")
    print("|---|---|---|---|---|---|")
    for _ in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="flasync-lag-") as tmp:
            row = trial(Path(tmp), rng.uniform(4.0, 20.0))
        rows.append(row)
        print(
            f"| {row['killed_at_version']:.0f} | {row['checkpoint']:.0f} | {row['metrics']:.0f} | "
            f"{'yes' if row['covered'] else 'NO'} | {row['checkpoint_lag_s']:.1f} | {row['metric_lag_s']:.1f} |",
            flush=True,
        )
    for key in ("checkpoint_lag_s", "metric_lag_s"):
        values = [r[key] for r in rows]
        print(f"{key}: median {statistics.median(values):.1f} s, max {max(values):.1f} s")
    covered = sum(int(r["covered"]) for r in rows)
    print(f"checkpoints covered by their metrics: {covered}/{len(rows)}")
    headline = [
        Figure("newest checkpoint's lag (median)", statistics.median(r["checkpoint_lag_s"] for r in rows), "s"),
        Figure("newest metric's lag (median)", statistics.median(r["metric_lag_s"] for r in rows), "s"),
        Figure("checkpoints covered by their metrics", covered / len(rows), "share"),
    ]
    settings = {"trials": args.trials, "seed": args.seed}
    store("checkpoint_lag", described, settings=settings, headline=headline, figures={"trials": rows}, out=args.out)


if __name__ == "__main__":
    main()
