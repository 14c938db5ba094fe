"""The whole ``flasync.run`` call with and without the frozen heap (:mod:`flasync.loops`), same run, interleaved.

``flasync.run`` runs inside :func:`flasync.loops.frozen_heap`: what survives the run's first full garbage
collection is kept out of the later ones, which then walk only what the run allocated instead of torch's 170,000
objects again. The baseline is the same federation awaited in a new uvloop loop without it (what an embedding
service's own loop does). Vectorized FedAvg on the tutorial workload (synthetic data, MLP 32-64-10, 200 samples per
client, batch 32, one epoch), tracking off, every client of the population in every round, at 100 clients x 20
rounds, 1,000 x 5 and 1,000 x 20, in alternating order. Printed: median whole-call seconds of each, their ratio,
and the median number of full collections a run made.

    python benchmarks/frozen_heap.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import uvloop

import flasync

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


def timed(run: str, run_config: dict[str, Any]) -> tuple[float, int]:
    """Return the call's seconds and the full collections it made."""
    full = gc.get_stats()[2]["collections"]
    start = time.perf_counter()
    if run == "frozen":
        flasync.run(run_config)
    else:
        uvloop.run(flasync.Federation(run_config).run())
    return time.perf_counter() - start, gc.get_stats()[2]["collections"] - full


def main() -> None:
    """Print the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    flasync.run(config(100, 1))  # imports and first-call costs out of the way
    results: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for repeat in range(args.repeats):
        for point, (clients, rounds) in POINTS.items():
            # Alternating order: a run leaves the collector's counts where the next one starts.
            for run in ("plain", "frozen") if repeat % 2 == 0 else ("frozen", "plain"):
                results.setdefault((point, run), []).append(timed(run, config(clients, rounds)))
    header = f"{'point':<12} {'no freeze s':>12} {'frozen_heap s':>14} {'ratio':>7}"
    print(f"{header} {'full collections (plain / frozen)':>34}")
    for point in POINTS:
        plain, frozen = results[(point, "plain")], results[(point, "frozen")]
        p, f = statistics.median(t for t, _ in plain), statistics.median(t for t, _ in frozen)
        cp, cf = statistics.median(c for _, c in plain), statistics.median(c for _, c in frozen)
        print(f"{point:<12} {p:12.3f} {f:14.3f} {p / f:6.2f}x {cp:>24g} / {cf:g}")


if __name__ == "__main__":
    main()
