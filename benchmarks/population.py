"""A million registered clients: memory of the population and time to draw a cohort, per sampling strategy.

    python benchmarks/population.py [--clients 1000000] [--draw 1000] [--repeats 200]

Builds what a run holds per client, as a run builds it - :class:`flasync.clients.simulated.population.Population`
(sizes, speeds, availability phases), the simulated :class:`~flasync.clients.simulated.population.Network`, the
server's participation counters (a :class:`~flasync.server.registry.TaskRegistry`) - and the lazy data of the clients
(:class:`~flasync.data.LazyIIDPartition` over 200 samples per client, and per-client
:class:`~flasync.data.SyntheticClients` with one sample count broadcast over every client, as ``data.lazy`` builds
them), measuring the memory it allocates (tracemalloc, which sees NumPy's buffers, and the process RSS above its RSS
before the build, in all and per client). Then draws ``--draw`` clients ``--repeats`` times per strategy, marking each
cohort used (as the server does at dispatch for least-recently-used sampling, which builds that state on its first
draw) and excluding 100 in-flight clients, and prints the RSS growth again, with the state sampling built. Targets:
<= 1 GB for 1M clients, <= 10 ms per draw of 1000 (the baselines of the stored ratios). The figures go to
``benchmarks/results/population.json`` (see ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from flasync.clients.simulated.population import SAMPLING_STRATEGIES, Network, Population
from flasync.config import LogNormalSpeed, NetworkConfig
from flasync.core import seeding
from flasync.core.bus import EventBus
from flasync.core.clock import VirtualClock
from flasync.core.events import TaskAssigned, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.data import LazyIIDPartition, SyntheticClients
from flasync.server.accounting import Accounting
from flasync.server.registry import TaskRegistry

if __package__:  # imported as benchmarks.population
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

SAMPLES_PER_CLIENT = 200


async def _never_started(tasks: Sequence[TaskAssigned], snapshot: ModelSnapshot) -> None:
    """Run no task (only the registry's counters are measured)."""


async def _dispatch(registry: TaskRegistry, clients: np.ndarray) -> None:
    """Dispatch a task to each of ``clients`` and release them all (moving one participation counter each)."""
    registry.publish(ModelSnapshot(version=Version(0), weights=torch.zeros(1), exact=torch.zeros(1), download_bytes=4))
    async with asyncio.TaskGroup() as tg:
        registry.attach(tg)
        await registry.dispatch_many(clients)
        registry.release_all()
        registry.cancel_all()


def main() -> None:
    """Print memory and draw-time figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1_000_000)
    parser.add_argument("--draw", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/population.json)")
    args = parser.parse_args()
    described = machine()
    n = args.clients
    process = psutil.Process()
    rss_before = process.memory_info().rss
    tracemalloc.start()
    start = time.perf_counter()
    partition = LazyIIDPartition(SAMPLES_PER_CLIENT * n, n, rng=seeding.numpy_stream(0, seeding.PARTITION))
    sizes = np.broadcast_to(np.int64(SAMPLES_PER_CLIENT), (n,))
    population = Population(sizes, LogNormalSpeed(), 0, available_fraction=0.3, availability_period_s=3600.0)
    network = Network(NetworkConfig(latency_sigma=0.5, bandwidth_sigma=0.5), n, 0)
    counters = TaskRegistry(
        bus=EventBus(),
        clock=VirtualClock(),
        accounting=Accounting(failure_limit=1),
        num_clients=n,
        start=_never_started,
    )
    data = SyntheticClients(sizes, seed=0)
    build_s = time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    traced_now, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_delta = process.memory_info().rss - rss_before
    held = population.nbytes + network.nbytes
    print(f"{n:,} clients, {SAMPLES_PER_CLIENT} samples each ({SAMPLES_PER_CLIENT * n:,} samples, lazy)")
    print(f"  build            {build_s * 1e3:8.1f} ms")
    print(f"  arrays           {held / 2**20:8.1f} MiB  ({held / n:.2f} B per client)")
    print(f"  traced now/peak  {traced_now / 2**20:8.1f} / {traced_peak / 2**20:.1f} MiB")
    print(f"  RSS growth       {rss_delta / 2**20:8.1f} MiB   (target <= 1024 MiB: {rss_delta / 2**30:.3f} of 1 GiB)")
    print(f"  RSS per client   {rss_delta / n:8.2f} B above the process's RSS before the build")
    figures: dict[str, Any] = {
        "build_ms": round(build_s * 1e3, 2),
        "arrays_bytes": held,
        "traced_peak_bytes": traced_peak,
        "rss_growth_bytes": rss_delta,
        "draw_ms": {},
    }
    headline = [Figure(f"RSS growth, {n:,} clients", rss_delta, "bytes", "1 GiB target", round(rss_delta / 2**30, 4))]

    rng = np.random.default_rng(1)
    in_flight = set(range(100))
    print(f"draw {args.draw} of {n:,} ({args.repeats} draws each, 100 clients excluded as in flight):")
    print(f"  {'strategy':<10} {'median ms':>10} {'p95 ms':>8} {'max ms':>8} {'vs 10 ms':>9}")
    for strategy in SAMPLING_STRATEGIES:
        times = []
        for r in range(args.repeats):
            begin = time.perf_counter()
            cohort = population.sample(args.draw, rng, strategy=strategy, now=60.0 * r, exclude=in_flight)
            times.append(time.perf_counter() - begin)
            if strategy == "lru":
                population.mark_used(cohort)
            assert len(cohort) == args.draw and len(np.unique(cohort)) == args.draw
        times.sort()
        median, p95 = statistics.median(times), times[int(0.95 * (len(times) - 1))]
        print(f"  {strategy:<10} {median * 1e3:10.3f} {p95 * 1e3:8.3f} {times[-1] * 1e3:8.3f} {median / 0.010:8.3f}x")
        figures["draw_ms"][strategy] = {
            "median": round(median * 1e3, 4),
            "p95": round(p95 * 1e3, 4),
            "max": round(times[-1] * 1e3, 4),
        }
        name = f"draw {args.draw:,} of {n:,} ({strategy}), median"
        headline.append(Figure(name, round(median * 1e3, 4), "ms", "10 ms target", round(median / 0.010, 4)))

    dispatched = rng.integers(n, size=10_000)
    rss = process.memory_info().rss
    asyncio.run(_dispatch(counters, np.unique(dispatched)))
    network.upload_seconds_many(dispatched.tolist(), [1000] * len(dispatched))
    for client in dispatched.tolist()[:1000]:
        population.train_seconds(client, 10, 0)
    print(f"10,000 clients touched (counters, links, speeds): RSS +{(process.memory_info().rss - rss) / 2**20:.1f} MiB")
    rss_delta = process.memory_info().rss - rss_before
    print(
        f"RSS growth with the state sampling built (lru, weighted): {rss_delta / 2**20:.1f} MiB, {rss_delta / n:.2f} B"
    )
    times = []
    for k in rng.integers(n, size=200).tolist():
        begin = time.perf_counter()
        partition[k]
        data.client(k)
        times.append(time.perf_counter() - begin)
    print(f"materialise one client (indices + its 200 synthetic samples): {statistics.median(times) * 1e6:.0f} us")
    figures["rss_growth_with_sampling_state_bytes"] = rss_delta
    figures["materialise_one_client_us"] = round(statistics.median(times) * 1e6, 1)
    settings = {"clients": n, "draw": args.draw, "repeats": args.repeats}
    store("population", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
