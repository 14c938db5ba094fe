"""What a per-update debug line costs a tracked run's event loop: logged one by one, or a batch's lines together.

A tracked run turns its per-update debug lines (``client``: 13 fields of a trained task; ``server.update``: 6 of an
accepted update) into metric rows at the log call. Lines of a batch (a cohort's trained tasks, a round's uploads that
arrive together) go through :func:`flasync.core.instruments.debug_many`, which hands them to the metrics processor in
one
call. This script times both ways through the logger a tracked run builds (``tracking.make_logger`` with the run's
:class:`tracking.MetricsProcessor` and :class:`tracking.ConstantSeries`, ``tracking.metrics = "standard"``, the
writer's queue replaced by a sink that keeps nothing), with batches of ``--batch`` lines, and checks that both ways
give the same rows. Printed: the medians over ``--repeats`` of microseconds per line, and their ratio.

    python benchmarks/debug_lines.py [--lines 50000] [--batch 100] [--repeats 5]

The medians go to ``benchmarks/results/debug_lines.json`` (``--out``; see ``benchmarks/record.py``), headed by the
batched way's time per line against one by one's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flasync import tracking
from flasync.core.instruments import debug_many
from flasync.runtime import run_tracking

if __package__:  # imported as benchmarks.debug_lines
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

LINES: dict[str, Callable[[int], dict[str, Any]]] = {
    "client": lambda i: {
        "client_id": i % 1000,
        "base_version": i // 100,
        "step": i,
        "train_s": 0.001 + i * 1e-9,
        "sim_train_s": 0.5,
        "sim_download_s": 0.1,
        "samples": 200,
        "loss": 0.5 + i * 1e-6,
        "peak_mem_bytes": 0,
        "encode_s": 1e-5,
        "download_bytes": 11_080,
        "upload_bytes": 11_080,
        "compression": 1.0,
    },
    "server.update": lambda i: {
        "step": i,
        "staleness": 0,
        "staleness_weight": 1.0,
        "queue_wait_s": 0.001,
        "decode_s": 1e-5,
        "norm": 0.3 + i * 1e-6,
    },
}


def logger(kept: list[tracking.MetricRow] | None) -> Any:
    """Return a tracked run's logger whose rows go to ``kept`` (None: nowhere)."""
    sink = kept.extend if kept is not None else (lambda rows: None)
    constant = tracking.ConstantSeries(sink, run_tracking.CONSTANT_KEYS)
    metrics = tracking.MetricsProcessor(
        constant, exclude=run_tracking.METRIC_EXCLUDE, drop_keys=run_tracking.DETAIL_KEYS, clock_ms=lambda: 1
    )
    return tracking.make_logger(level="warning", metrics=metrics)


def one_by_one(log: Any, event: str, batch: list[dict[str, Any]]) -> None:
    """Log each line of ``batch`` with its own call."""
    for fields in batch:
        log.debug(event, **fields)


def together(log: Any, event: str, batch: list[dict[str, Any]]) -> None:
    """Log ``batch``'s lines in one call."""
    debug_many(log, event, batch)


WAYS = {"one by one": one_by_one, "together": together}


def main() -> None:
    """Time both ways for each line and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    headline: list[Figure] = []
    figures: dict[str, Any] = {}
    if args.lines < args.batch or args.batch < 1 or args.repeats < 1:
        raise SystemExit("--lines must be at least --batch, and --batch and --repeats at least 1")
    print(f"a tracked run's debug lines, batches of {args.batch}, {args.lines} lines, {args.repeats} repeats")
    print(f"{'line':<15} {'one by one':>12} {'together':>12} {'ratio':>7}  same rows")
    for event, make in LINES.items():
        batches = [[make(i) for i in range(start, start + args.batch)] for start in range(0, args.lines, args.batch)]
        rows: dict[str, list[tracking.MetricRow]] = {}
        for name, way in WAYS.items():
            rows[name] = []
            log = logger(rows[name])
            for batch in batches:
                way(log, event, batch)
        timings: dict[str, list[float]] = {name: [] for name in WAYS}
        for _ in range(args.repeats):
            for name, way in WAYS.items():  # interleaved: a shared machine's drift hits both
                log = logger(None)
                began = time.perf_counter()
                for batch in batches:
                    way(log, event, batch)
                timings[name].append((time.perf_counter() - began) / args.lines * 1e6)
        single, batched = (statistics.median(timings[name]) for name in WAYS)
        same = rows["one by one"] == rows["together"]
        print(f"{event:<15} {single:>9.2f} us {batched:>9.2f} us {single / batched:>6.2f}x  {same}")
        figures[event] = {"us_per_line": timings, "same_rows": same}
        headline.append(
            Figure(f"{event}: a batch's lines together, per line", batched, "us", "one by one", batched / single)
        )
    store(
        "debug_lines",
        described,
        settings={"lines": args.lines, "batch": args.batch, "repeats": args.repeats},
        headline=headline,
        figures=figures,
        out=args.out,
    )


if __name__ == "__main__":
    main()
