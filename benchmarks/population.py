"""A million registered clients: memory of the population and time to draw a cohort, per sampling strategy.

    python benchmarks/population.py [--clients 1000000] [--draw 1000] [--repeats 200]

Builds what a run holds per client - :class:`flasync.clients.simulated.population.Population` (sizes, speeds,
availability phases,
least-recently-used state), the simulated :class:`~flasync.clients.simulated.population.Network`, the server's
participation counts -
and the lazy data of a million clients (:class:`~flasync.data.LazyIIDPartition` over 200 samples per client, or
per-client :class:`~flasync.data.SyntheticClients`), measuring the memory it allocates (tracemalloc, which sees
NumPy's buffers, and the process RSS). Then draws ``--draw`` clients ``--repeats`` times per strategy, marking each
cohort used (as the server does at dispatch, so least-recently-used sampling walks its queue) and excluding 100
in-flight clients. Targets: <= 1 GB for 1M clients, <= 10 ms per draw of 1000.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np
import psutil

from flasync.clients.simulated.population import SAMPLING_STRATEGIES, Network, Population
from flasync.config import LogNormalSpeed, NetworkConfig
from flasync.core import seeding
from flasync.data import LazyIIDPartition, SyntheticClients

SAMPLES_PER_CLIENT = 200


def main() -> None:
    """Print memory and draw-time figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1_000_000)
    parser.add_argument("--draw", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    n = args.clients
    process = psutil.Process()
    rss_before = process.memory_info().rss
    tracemalloc.start()
    start = time.perf_counter()
    partition = LazyIIDPartition(SAMPLES_PER_CLIENT * n, n, rng=seeding.numpy_stream(0, seeding.PARTITION))
    sizes = partition.sizes
    population = Population(sizes, LogNormalSpeed(), 0, available_fraction=0.3, availability_period_s=3600.0)
    network = Network(NetworkConfig(latency_sigma=0.5, bandwidth_sigma=0.5), n, 0)
    participations = np.zeros(n, dtype=np.int64)
    data = SyntheticClients(sizes, seed=0)
    population.mark_used(np.arange(0, 1))  # build the least-recently-used state as a run's first dispatch does
    population.sample(1, np.random.default_rng(0), strategy="weighted")  # and the weights' cumulative sums
    build_s = time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    traced_now, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_delta = process.memory_info().rss - rss_before
    per_client = population.nbytes + sum(
        a.nbytes for a in (network.latency_s, network.upload_bytes_per_s, network.download_bytes_per_s, participations)
    )
    print(f"{n:,} clients, {SAMPLES_PER_CLIENT} samples each ({SAMPLES_PER_CLIENT * n:,} samples, lazy)")
    print(f"  build            {build_s * 1e3:8.1f} ms")
    print(f"  arrays           {per_client / 2**20:8.1f} MiB  ({per_client / n:.1f} B per client)")
    print(f"  traced now/peak  {traced_now / 2**20:8.1f} / {traced_peak / 2**20:.1f} MiB")
    print(f"  RSS growth       {rss_delta / 2**20:8.1f} MiB   (target <= 1024 MiB: {rss_delta / 2**30:.3f} of 1 GiB)")

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
            population.mark_used(cohort)
            assert len(cohort) == args.draw and len(np.unique(cohort)) == args.draw
        times.sort()
        median, p95 = statistics.median(times), times[int(0.95 * (len(times) - 1))]
        print(f"  {strategy:<10} {median * 1e3:10.3f} {p95 * 1e3:8.3f} {times[-1] * 1e3:8.3f} {median / 0.010:8.3f}x")

    times = []
    for k in rng.integers(n, size=200).tolist():
        begin = time.perf_counter()
        partition[k]
        data.client(k)
        times.append(time.perf_counter() - begin)
    print(f"materialise one client (indices + its 200 synthetic samples): {statistics.median(times) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
