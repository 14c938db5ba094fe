"""Soak: a long run with a large population and faults on; resources sampled every 5 s must not grow without bound.

    python benchmarks/soak.py                 # 10 minutes, 10,000 clients, tracked into a temporary SQLite store
    python benchmarks/soak.py --minutes 2     # shorter

A FedBuff run on lazily drawn synthetic clients (virtual clock, stopped by ``stop.max_wall_s``) with 10%
crashes, 5% hangs (timed out), 5% dropouts, periodic checkpoints and MLflow tracking. A thread samples the
process's resident memory, open file descriptors and threads every 5 s. At the end it prints the samples and, for
each figure, the first, last and peak value and the change between the mean of the second quarter and that of the
last quarter (growth without bound shows there; the first quarter is warm-up: imports, the writer process, caches).

It also checks that no metric row was lost: every row the run hands its tracker is appended to a file beside the
store as it is produced (disk, not memory: the RSS figures stay the run's own); at the end the distinct rows among
them (a store keeps one of equal rows: same key, timestamp, step and value) are counted and compared with the rows
the MLflow store holds for the run, and the tracker's own count of rows lost is printed. The samples, the trends and
the row counts go to ``benchmarks/results/soak.json`` (``--out``; see ``benchmarks/record.py``), headed by the last
quarter's mean of each figure against the second quarter's.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

if __package__:  # imported as benchmarks.soak
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

import flasync
from flasync.config import validate
from flasync.runtime.tracked import mlflow_tracker
from flasync.tracking import MetricRow, MlflowTracker


def _sample(process: psutil.Process) -> tuple[float, int, int]:
    return process.memory_info().rss / 2**20, len(os.listdir("/proc/self/fd")), process.num_threads()


def main() -> None:
    """Run the soak and print the samples and their trend."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    process = psutil.Process()
    samples: list[tuple[float, float, int, int]] = []
    done = threading.Event()
    started = time.perf_counter()

    def sampler() -> None:
        while not done.wait(args.every):
            samples.append((time.perf_counter() - started, *_sample(process)))

    with tempfile.TemporaryDirectory(prefix="flasync-soak-") as tmp:
        config = {
            "data": {"kind": "synthetic", "lazy": True, "samples_per_client": 50},
            "population": {"num_clients": args.clients},
            "server": {"kind": "fedbuff", "buffer_size": 10, "concurrency": 50},
            "faults": {"crash": 0.1, "hang": 0.05, "dropout": 0.05},
            "resilience": {"task_timeout_s": 30.0},
            "checkpoint": {"every_versions": 100},
            "stop": {"max_versions": 10**9, "max_wall_s": args.minutes * 60},
            "eval": {"every_versions": 50},
            "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "log_level": "warning", "log_model": False},
        }
        thread = threading.Thread(target=sampler, daemon=True)
        produced = Path(tmp) / "produced.jsonl"
        tracker = _teeing_tracker(config, produced)
        thread.start()
        summary = flasync.run(config, tracker=tracker)
        done.set()
        thread.join()
        distinct, written = _distinct_rows(produced), _stored_rows(Path(tmp) / "mlflow.db", summary.run_id or "")
    print(
        f"metric rows: {distinct} produced (distinct), {written} in the store, {tracker.metric_rows_lost} counted lost"
        f" -> {'ALL WRITTEN' if written == distinct else f'{distinct - written} MISSING'}"
    )
    print(
        f"{summary.versions} versions, {summary.updates_accepted} updates, {summary.updates_failed} failed, "
        f"{summary.tasks_timed_out} timed out in {summary.wall_s:.0f} s; accuracy {summary.accuracy:.3f}"
    )
    print("| t (s) | RSS (MiB) | fds | threads |")
    print("|---|---|---|---|")
    for t, rss, fds, threads in samples:
        print(f"| {t:.0f} | {rss:.1f} | {fds} | {threads} |")
    quarter = max(len(samples) // 4, 1)
    headline: list[Figure] = []
    for index, name in ((1, "RSS (MiB)"), (2, "fds"), (3, "threads")):
        values = [s[index] for s in samples]
        second = sum(values[quarter : 2 * quarter]) / max(len(values[quarter : 2 * quarter]), 1)
        last = sum(values[-quarter:]) / quarter
        print(
            f"{name}: first {values[0]:.1f}, last {values[-1]:.1f}, peak {max(values):.1f}; "
            f"mean of the last quarter vs the second: {last - second:+.1f} ({last / second - 1:+.1%})"
        )
        unit = name.partition(" (")[2].rstrip(")") or name
        headline.append(
            Figure(
                f"{name.partition(' (')[0]}, last quarter's mean", last, unit, "second quarter's mean", last / second
            )
        )
    store(
        "soak",
        described,
        settings={"minutes": args.minutes, "clients": args.clients, "every": args.every},
        headline=headline,
        figures={
            "rows": {"produced_distinct": distinct, "stored": written, "counted_lost": tracker.metric_rows_lost},
            "run": {
                "versions": summary.versions,
                "updates": summary.updates_accepted,
                "failed": summary.updates_failed,
            },
            "samples": [{"t_s": t, "rss_mib": rss, "fds": fds, "threads": threads} for t, rss, fds, threads in samples],
        },
        out=args.out,
    )


def _teeing_tracker(config: dict[str, Any], path: Path) -> MlflowTracker:
    """Return the run's MLflow tracker, every metric row it is handed also appended to ``path`` (one write each)."""
    tracker = mlflow_tracker(validate(config))
    log_metrics = tracker.log_metrics

    def tee(rows: list[MetricRow]) -> None:
        with path.open("a", encoding="utf-8") as out:
            out.write("".join(json.dumps([r.key, float(r.value), r.timestamp, r.step]) + "\n" for r in rows))
        log_metrics(rows)

    tracker.log_metrics = tee  # type: ignore[method-assign]
    return tracker


def _distinct_rows(path: Path) -> int:
    """Count the distinct rows of a file of produced rows (as the store's primary key tells rows apart)."""
    with sqlite3.connect(path.with_suffix(".db")) as db:
        db.execute("CREATE TABLE rows (key, value, ts, step, PRIMARY KEY (key, value, ts, step))")
        with path.open(encoding="utf-8") as rows:
            db.executemany("INSERT OR IGNORE INTO rows VALUES (?, ?, ?, ?)", (json.loads(line) for line in rows))
        return int(db.execute("SELECT COUNT(*) FROM rows").fetchone()[0])


def _stored_rows(store: Path, run_id: str) -> int:
    """Count the metric rows of the run in the MLflow SQLite store (MLflow's system metrics excluded)."""
    with sqlite3.connect(store) as db:
        query = "SELECT COUNT(*) FROM metrics WHERE run_uuid = ? AND key NOT LIKE 'system/%'"
        return int(db.execute(query, (run_id,)).fetchone()[0])


if __name__ == "__main__":
    main()
