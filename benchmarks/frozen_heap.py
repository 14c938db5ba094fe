"""The whole ``flasync.run`` call with and without the frozen heap (:mod:`flasync.core.loops`), same run, interleaved.

Three ways to run the same federation, each call in turn:

* ``none``: awaited in a new uvloop loop without a frozen heap (what an embedding service's own loop does): the
  run's full garbage collections walk torch's 170,000 objects every time;
* ``first full``: a federation built before the loop, run by :func:`flasync.core.loops.run_loop`
  (``frozen_heap()``): what survives the run's first full collection is kept out of the later ones;
* ``at start``: ``flasync.run``, which builds the federation inside the loop and freezes the heap at the run's start
  (``frozen_heap(at_start=True)``): no collection of the run walks what existed before it.

Vectorized FedAvg on the tutorial workload (synthetic data, MLP 32-64-10, 200 samples per client, batch 32, one
epoch), tracking off, every client of the population in every round, at 100 clients x 20 rounds, 1,000 x 5 and
1,000 x 20. A way's calls come as a sweep's do, one after another (a call leaves the collector's counts where the
next one starts): each repeat makes ``--calls`` consecutive calls of each way, in rotating order, and times all but
the first (which starts from the state another way left). Printed: median whole-call seconds of each way, the ratios
of ``first full`` and ``none`` to ``at start`` (medians of the per-repeat ratios), and the median number of full
collections a call made (``at start`` counts the one at its end, which walks only what the run allocated).

    python benchmarks/frozen_heap.py [--repeats 5] [--calls 3] [--points "100 x 20" ...]

The medians and ratios go to ``benchmarks/results/frozen_heap.json`` (``--out``; see ``benchmarks/record.py``),
headed by ``at start``'s whole call against ``none``'s at each point.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import uvloop

import flasync
from flasync.core.loops import run_loop

if __package__:  # imported as benchmarks.frozen_heap
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

POINTS = {"100 x 20": (100, 20), "1,000 x 5": (1000, 5), "1,000 x 20": (1000, 20)}


def config(clients: int, rounds: int) -> dict[str, Any]:
    """Return the tutorial workload's FedAvg run over every client ``rounds`` times, tracking off."""
    return {
        "seed": 0,
        "data": {"kind": "synthetic", "samples_per_client": 200, "num_features": 32, "test_samples": 500},
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": [64]},
        "population": {"num_clients": clients},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.01},
        "server": {"kind": "fedavg", "clients_per_round": clients},
        "executor": {"kind": "vectorized"},
        "stop": {"max_versions": rounds},
        "tracking": {"enabled": False, "log_level": "warning"},
    }


WAYS = ("none", "first full", "at start")


def timed(way: str, run_config: dict[str, Any]) -> tuple[float, int]:
    """Return the call's seconds and the full collections it made."""
    full = gc.get_stats()[2]["collections"]
    start = time.perf_counter()
    if way == "at start":
        flasync.run(run_config)
    elif way == "first full":
        run_loop(flasync.Federation(run_config).run())
    else:
        uvloop.run(flasync.Federation(run_config).run())
    return time.perf_counter() - start, gc.get_stats()[2]["collections"] - full


def main() -> None:
    """Print the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="consecutive calls of a way per repeat (2 or more)")
    parser.add_argument("--points", nargs="+", choices=list(POINTS), default=list(POINTS), help="clients x rounds")
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    if args.calls < 2 or args.repeats < 1:
        raise SystemExit("--calls must be at least 2 and --repeats at least 1")
    described = machine()
    points = {point: POINTS[point] for point in args.points}
    flasync.run(config(100, 1))  # imports and first-call costs out of the way
    # (point, way) -> per repeat, the median seconds and full collections of the timed calls
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for repeat in range(args.repeats):
        for point, (clients, rounds) in points.items():
            for way in WAYS[repeat % 3 :] + WAYS[: repeat % 3]:
                calls = [timed(way, config(clients, rounds)) for _ in range(args.calls)][1:]
                median = (statistics.median(t for t, _ in calls), statistics.median(c for _, c in calls))
                results.setdefault((point, way), []).append(median)
    header = f"{'point':<12} " + " ".join(f"{way + ' s':>12}" for way in WAYS)
    print(f"{header} {'first/start':>12} {'none/start':>11} {'full collections':>20}")
    headline: list[Figure] = []
    figures: dict[str, Any] = {}
    for point in points:
        rows = [results[(point, way)] for way in WAYS]
        seconds = " ".join(f"{statistics.median(t for t, _ in row):12.3f}" for row in rows)
        ratios = [statistics.median(a[0] / b[0] for a, b in zip(row, rows[2], strict=True)) for row in rows[:2]]
        counts = " / ".join(f"{statistics.median(c for _, c in row):g}" for row in rows)
        print(f"{point:<12} {seconds} {ratios[1]:11.2f}x {ratios[0]:10.2f}x {counts:>20}")
        medians = {way: statistics.median(t for t, _ in row) for way, row in zip(WAYS, rows, strict=True)}
        figures[point] = {
            "seconds": medians,
            "full_collections": {
                way: statistics.median(c for _, c in row) for way, row in zip(WAYS, rows, strict=True)
            },
            "first_full_over_at_start": ratios[1],
            "none_over_at_start": ratios[0],
        }
        at_start = medians["at start"]
        headline.append(Figure(f"{point}: whole call, at start", at_start, "s", "none", 1 / ratios[0]))
    store(
        "frozen_heap",
        described,
        settings={"repeats": args.repeats, "calls": args.calls, "points": args.points},
        headline=headline,
        figures=figures,
        out=args.out,
    )


if __name__ == "__main__":
    main()
