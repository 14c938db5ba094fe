"""What storing a run's metrics costs the writer process: MLflow's ``log_batch`` against flasync's direct writes.

A default tracked run of the tutorial (100 clients x 20 FedAvg rounds) sends its writer process about 6,500 metric
rows: three per client update (``client/loss``, ``client/train_s``, ``server/update/queue_wait_s``) and a few dozen
per version. This script builds such rows (``--updates`` updates, ``--versions`` versions of ``--per-version``
keys each), then stores them in batches of 1,000 into a fresh SQLite store, two runs per repeat, alternating which
goes first:

* ``log_batch``: ``MlflowClient.log_batch``, what the writer process called before;
* ``direct``: :class:`flasync.tracking.sqlite_metrics.SqliteMetrics`, what it calls now where the store's tables fit.

Printed: the medians of CPU and wall seconds per run, microseconds of CPU per row, and the ratio; then whether both
runs of every repeat left the same rows in ``metrics`` and ``latest_metrics``.

    python benchmarks/metric_writes.py [--updates 2000] [--versions 20] [--per-version 25] [--repeats 5]

The figures go to ``benchmarks/results/metric_writes.json`` (``--out``; see ``benchmarks/record.py``), headed by the
direct writes' CPU per row against ``log_batch``'s.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import mlflow
from mlflow.entities import Metric

from flasync.tracking.sqlite_metrics import Row, SqliteMetrics
from flasync.tracking.store import prepare_sqlite_store

if __package__:  # imported as benchmarks.metric_writes
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

BATCH = 1_000
PER_UPDATE = ("client/loss", "client/train_s", "server/update/queue_wait_s")


def rows(updates: int, versions: int, per_version: int) -> list[Row]:
    """Return a run's rows in the order a run logs them (a version's figures after its updates)."""
    out: list[Row] = []
    clock = 1_790_000_000_000
    per = max(updates // max(versions, 1), 1)
    for update in range(updates):
        clock += 1
        out.extend((key, 0.001 * (update % 97) + 0.5, clock, update + 1) for key in PER_UPDATE)
        if (update + 1) % per == 0:
            version = (update + 1) // per
            out.extend((f"server/figure_{k}", 0.1 * k + version, clock, version) for k in range(per_version))
    return out


def stored(db: Path, run_id: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """Return the run's rows of both tables (run id left out)."""
    with sqlite3.connect(db) as connection:
        return (
            connection.execute(
                "SELECT key, value, timestamp, step, is_nan FROM metrics WHERE run_uuid = ? ORDER BY 1, 3, 4, 2",
                (run_id,),
            ).fetchall(),
            connection.execute(
                "SELECT key, value, timestamp, step, is_nan FROM latest_metrics WHERE run_uuid = ? ORDER BY 1",
                (run_id,),
            ).fetchall(),
        )


def main() -> None:
    """Parse the arguments, time both writers, print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=2_000)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--per-version", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    data = rows(args.updates, args.versions, args.per_version)
    with tempfile.TemporaryDirectory(prefix="flasync-metric-writes-") as folder:
        db = Path(folder, "mlflow.db")
        uri = f"sqlite:///{db}"
        prepare_sqlite_store(uri)
        client = mlflow.MlflowClient(uri)
        experiment = client.create_experiment("metric-writes", artifact_location=str(Path(folder, "artifacts")))
        direct = SqliteMetrics.open(uri)
        if direct is None:
            raise SystemExit(f"this MLflow's store tables do not fit flasync's direct writes ({mlflow.__version__})")
        client.log_batch(client.create_run(experiment).info.run_id, metrics=[Metric(*data[0])])  # warm both up
        direct.write(client.create_run(experiment).info.run_id, data[:1])

        def with_log_batch(run_id: str) -> None:
            for start in range(0, len(data), BATCH):
                chunk = [Metric(*row) for row in data[start : start + BATCH]]
                client.log_batch(run_id, metrics=chunk, synchronous=True)

        def with_direct(run_id: str) -> None:
            assert direct is not None
            for start in range(0, len(data), BATCH):
                direct.write(run_id, data[start : start + BATCH])

        writers = {"log_batch": with_log_batch, "direct": with_direct}
        cpu: dict[str, list[float]] = {name: [] for name in writers}
        wall: dict[str, list[float]] = {name: [] for name in writers}
        same = []
        for repeat in range(args.repeats):
            order = list(writers) if repeat % 2 == 0 else list(reversed(writers))
            runs = {}
            for name in order:
                run_id = client.create_run(experiment).info.run_id
                began_cpu, began = time.process_time(), time.perf_counter()
                writers[name](run_id)
                cpu[name].append(time.process_time() - began_cpu)
                wall[name].append(time.perf_counter() - began)
                runs[name] = run_id
            same.append(stored(db, runs["log_batch"]) == stored(db, runs["direct"]))
        direct.close()
    print(f"mlflow {mlflow.__version__}: {len(data)} rows a run in batches of {BATCH}, {args.repeats} repeats")
    print(f"{'writer':<10} {'CPU s':>7} {'wall s':>7} {'CPU us/row':>11}")
    for name in writers:
        median = statistics.median(cpu[name])
        print(f"{name:<10} {median:7.3f} {statistics.median(wall[name]):7.3f} {1e6 * median / len(data):11.1f}")
    ratio = statistics.median(cpu["log_batch"]) / statistics.median(cpu["direct"])
    print(f"direct writes take {ratio:.1f}x less CPU; same rows in both tables in every repeat: {all(same)}")
    per_row = {name: 1e6 * statistics.median(cpu[name]) / len(data) for name in writers}
    store(
        "metric_writes",
        described,
        settings={
            "updates": args.updates,
            "versions": args.versions,
            "per_version": args.per_version,
            "repeats": args.repeats,
            "rows": len(data),
            "batch": BATCH,
        },
        headline=[
            Figure("direct writes: CPU per row", per_row["direct"], "us", "log_batch", 1 / ratio),
            Figure("log_batch: CPU per row", per_row["log_batch"], "us"),
        ],
        figures={"cpu_s": cpu, "wall_s": wall, "same_rows": all(same)},
        out=args.out,
    )


if __name__ == "__main__":
    main()
