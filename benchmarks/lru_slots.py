"""An async slot's least-recently-used draw with every client in flight: following the tasks in flight or walking.

    python benchmarks/lru_slots.py [--clients 100 1000 10000] [--draws 5000]

FedBuff and FedAsync refill a slot by drawing one idle client, excluding the tasks in flight. With least-recently-used
sampling the oldest used clients are mostly those in flight; a :class:`~flasync.clients.simulated.population.Population`
that follows them (``follow_tasks``, told each release by ``mark_idle``, as a run's task registry does) takes the idle
ones by last use from a heap, one that does not walks past the busy ones; a refill of one slot in a run takes the
heap's oldest idle client at once (``quick``: ``Population.least_recent_idle``, what ``AsyncSlots.refill`` asks
first), without the general draw's checks and lists. For each population size, the three populations fill every
slot, then ``--draws`` times release one task (a random one, or the oldest) and draw its replacement; the draws are
checked to be the same clients, and the CPU time of the draws alone is timed (``time.process_time``, whose own cost,
the same for each, is in every figure), the populations taking turns. The figures go to
``benchmarks/results/lru_slots.json`` (see ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from flasync.clients.simulated.population import Population
from flasync.config import ConstantSpeed

if __package__:  # imported as benchmarks.lru_slots
    from benchmarks.record import Figure, describe, machine, store
else:
    from record import Figure, describe, machine, store

MODES = ("walking", "following", "quick")
FOLLOWING = ("following", "quick")


def measure(num_clients: int, draws: int, released: str) -> dict[str, float]:
    """Return the mean CPU microseconds of a slot's draw, per mode (the same clients drawn by both)."""
    populations = {mode: Population(np.ones(num_clients, dtype=np.int64), ConstantSpeed(), seed=0) for mode in MODES}
    in_flight: dict[str, dict[int, int]] = {mode: {} for mode in MODES}
    for mode in FOLLOWING:
        populations[mode].follow_tasks(in_flight[mode])
    streams = {mode: np.random.default_rng(0) for mode in MODES}
    spent = dict.fromkeys(MODES, 0.0)
    order = np.random.default_rng(1)
    for step in range(num_clients + draws):
        drawn: dict[str, int] = {}
        pick = int(order.integers(num_clients))
        for mode in MODES:
            population, busy = populations[mode], in_flight[mode]
            if step >= num_clients:  # every slot is full: one task ends first
                client = next(iter(busy)) if released == "oldest" else list(busy)[pick]
                del busy[client]
                if mode in FOLLOWING:
                    population.mark_idle(client)
            start = time.process_time()
            quick = population.least_recent_idle(busy) if mode == "quick" else None
            if quick is None:  # every other mode, and a quick one before every client was used
                quick = int(population.sample(1, streams[mode], strategy="lru", exclude=busy)[0])
            drawn[mode] = quick
            if step >= num_clients:
                spent[mode] += time.process_time() - start
            busy[drawn[mode]] = step
            population.mark_used([drawn[mode]])
        if len(set(drawn.values())) > 1:
            raise AssertionError(f"draw {step}: {drawn}")
    return {mode: spent[mode] / draws * 1e6 for mode in MODES}


def main() -> None:
    """Measure, print and store."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument("--draws", type=int, default=5000)
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/lru_slots.json)")
    args = parser.parse_args()
    described = machine()
    print(describe(described))
    columns = f"{'clients':>8} {'released':>9} {'walking us':>11} {'following us':>13} {'ratio':>7}"
    print(f"{columns} {'quick us':>9} {'ratio':>7}")
    headline: list[Figure] = []
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for num_clients in args.clients:
        for released in ("random", "oldest"):
            us = measure(num_clients, args.draws, released)
            ratio, quick = us["following"] / us["walking"], us["quick"] / us["following"]
            line = f"{num_clients:>8} {released:>9} {us['walking']:11.1f} {us['following']:13.1f} {ratio:6.2f}x"
            print(f"{line} {us['quick']:9.1f} {quick:6.2f}x")
            figures.setdefault(str(num_clients), {})[released] = us
            if released == "random":
                name = f"{num_clients} clients in flight, tasks ending in random order: CPU of a slot's LRU draw"
                headline.append(Figure(name, us["following"], "us", "walking past the busy clients", ratio))
                name = f"{num_clients} clients in flight, tasks ending in random order: CPU of a refill's quick draw"
                headline.append(Figure(name, us["quick"], "us", "the general draw, following", quick))
    settings = {"clients": args.clients, "draws": args.draws}
    store("lru_slots", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
