"""The cost of measuring: federation throughput with no instrumentation, with the profiler, and per diagnostics level.

Runners (same workload, same seed, same final weights):

* ``none``: ``diagnostics.profile=false, diagnostics.level=off``: nothing subscribes to the bus, no profile is
  built, no alert can fire. What cannot be switched off is part of the engine and is in every runner: the timing
  fields on events (a few ``perf_counter`` calls per task) and the NaN/Inf check of each update;
* ``profile, diag off``: the profiler's bus subscriber, ``profile.json`` at the end, NaN alerts (the default
  configuration minus the ``basic`` diagnostics);
* ``profile, diag basic``: + update norm per task, weight norm and drift per version, exploding-update and
  divergence alerts (the default);
* ``profile, diag full``: + per-layer gradient norms in every local step.

The workload is the tutorial one (synthetic data, MLP 32-64-10, 200 samples per client, batch 32, 1 epoch) under
FedBuff (K=10, C=50) on the virtual clock, with MLflow off so that only the instrumentation differs. The rate is
accepted updates per wall second of the federation (``RunSummary.updates_per_s``); "end s" is the whole
``Federation.run()`` including building the profile. Each repeat runs every runner once, back to back, in an order
rotated per repeat; the paired ratio is the median over repeats of ``rate / rate(none)`` within a repeat. "CPU ms /
update" is the process's CPU time (all threads) per accepted update, less sensitive than wall time to the load
of other processes on a shared machine; "CPU vs none" is its paired ratio.

    PYTHONPATH=. python benchmarks/instrumentation.py [--clients 100] [--updates 1000] [--repeats 5]

The figures go to ``benchmarks/results/instrumentation.json`` (``--out``; see ``benchmarks/record.py``), headed by
each runner's paired rate and CPU ratios against ``none``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import uvloop

import flasync
from flasync import tracking
from flasync.observe.plots import render_plots

if __package__:  # imported as benchmarks.instrumentation
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

RUNNERS: dict[str, dict[str, Any]] = {
    "none": {"profile": False, "level": "off"},
    "profile, diag off": {"profile": True, "level": "off"},
    "profile, diag basic": {"profile": True, "level": "basic"},
    "profile, diag full": {"profile": True, "level": "full"},
}


def config(num_clients: int, updates: int, diagnostics: dict[str, Any]) -> dict[str, Any]:
    """Return the workload's config with the given diagnostics section."""
    versions = max(1, updates // 10)
    return {
        "seed": 0,
        "data": {"kind": "synthetic", "samples_per_client": 200, "num_features": 32, "test_samples": 500},
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": [64]},
        "population": {"num_clients": num_clients, "speed": {"kind": "constant"}},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.01},
        "server": {"kind": "fedbuff", "buffer_size": 10, "concurrency": min(50, num_clients)},
        "eval": {"every_versions": 10},
        "stop": {"max_versions": versions},
        "tracking": {"enabled": False, "log_level": "warning"},
        "diagnostics": diagnostics,
    }


def measure(num_clients: int, updates: int, diagnostics: dict[str, Any]) -> tuple[float, float, float, str, Any]:
    """Run once; return (updates per second, end-to-end seconds, CPU ms per update, weights sha256, the profile)."""
    federation = flasync.Federation(config(num_clients, updates, diagnostics))
    start, cpu = time.perf_counter(), time.process_time()
    summary = uvloop.run(federation.run())
    cpu_ms = 1000 * (time.process_time() - cpu) / max(summary.updates_accepted, 1)
    return summary.updates_per_s, time.perf_counter() - start, cpu_ms, summary.weights_sha256, federation.profile


def main() -> None:
    """Print each runner's rate, its ratio to ``none`` (best and paired), and the end-of-run plotting cost."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    tracking.configure_logging(level="error")
    names = list(RUNNERS)
    measure(args.clients, 100, RUNNERS["none"])  # warm-up: imports, first model build
    rates: dict[str, list[float]] = {name: [] for name in names}
    ends: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    hashes: set[str] = set()
    profile: Any = None
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]  # rotate: no runner always goes first
        for name in order:
            rate, end, cpu_ms, sha, prof = measure(args.clients, args.updates, RUNNERS[name])
            rates[name].append(rate)
            cpus[name].append(cpu_ms)
            ends[name].append(end)
            hashes.add(sha)
            profile = prof if prof is not None else profile
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; {args.clients} clients, "
        f"{args.updates} updates, {args.repeats} interleaved repeats; same weights in every run: {len(hashes) == 1}"
    )
    print(
        f"{'runner':<22} {'updates/s':>10} {'updates/s':>10} {'vs none':>9} {'vs none':>9} {'end s':>7} "
        f"{'CPU ms':>7} {'CPU vs':>8}"
    )
    print(
        f"{'':<22} {'(median)':>10} {'(best)':>10} {'(paired)':>9} {'(best)':>9} {'(med)':>7} "
        f"{'/update':>7} {'none':>8}"
    )
    best_none = max(rates["none"])
    headline: list[Figure] = []
    for name in names:
        paired = statistics.median(a / b for a, b in zip(rates[name], rates["none"], strict=True))
        cpu_paired = statistics.median(a / b for a, b in zip(cpus[name], cpus["none"], strict=True))
        print(
            f"{name:<22} {statistics.median(rates[name]):>10.1f} {max(rates[name]):>10.1f} "
            f"{paired:>8.3f}x {max(rates[name]) / best_none:>8.3f}x {statistics.median(ends[name]):>7.2f} "
            f"{statistics.median(cpus[name]):>7.2f} {cpu_paired:>7.3f}x"
        )
        if name != "none":
            rate = statistics.median(rates[name])
            headline.append(Figure(f"{name}: updates per second", rate, "updates/s", "none (paired)", paired))
            cpu = statistics.median(cpus[name])
            headline.append(Figure(f"{name}: CPU per update", cpu, "ms", "none (paired)", cpu_paired))
    drawn_ms = None
    if profile is not None:
        start = time.perf_counter()
        plots = render_plots(profile)
        drawn_ms = 1000 * (time.perf_counter() - start)
        print(f"plots: {len(plots)} SVG charts drawn in {drawn_ms:.1f} ms (once, at the end of a run)")
    store(
        "instrumentation",
        described,
        settings={"clients": args.clients, "updates": args.updates, "repeats": args.repeats},
        headline=headline,
        figures={
            "updates_per_s": rates,
            "end_s": ends,
            "cpu_ms_per_update": cpus,
            "same_weights": len(hashes) == 1,
            "plots_ms": drawn_ms,
            "intra_op_threads": torch.get_num_threads(),
        },
        out=args.out,
    )


if __name__ == "__main__":
    main()
