"""Client updates per second: flasync against a plain PyTorch loop doing the same training, in the same run.

The tutorial workload: synthetic data (32 features, 10 classes), MLP 32-64-10, 200 samples per client, batch 32,
1 local epoch, SGD lr 0.01. The baseline trains the same clients one after another in a bare ``for`` loop that
indexes in-memory tensors (no DataLoader) and averages their deltas; flasync runs sync FedAvg and FedBuff on the
virtual clock, with MLflow tracking on (a temporary sqlite store) and off.

    python benchmarks/throughput.py [--clients 100 1000] [--updates 2000] [--repeats 3] [--pairs 20]

Each repeat runs every runner once, back to back. Printed: the best rate of each runner and its ratio to the best
plain-loop rate, and the median over repeats of the ratio within a repeat ("paired"), which cancels the drift of a
shared machine's load between repeats.

Tracking on against off is then measured on its own, because a 5% difference is smaller than the drift of a shared
machine between two runs a few seconds apart: ``--pairs`` short runs (``--pair-updates`` updates) with tracking on
and off, back to back, in alternating order (on-off, off-on, ...), so a trend in the machine's speed hits both sides
alike. Printed: the median of the per-pair ratios of updates per second (the federation's own wall time: the MLflow
run's creation before it and the final flush after it are fixed costs, printed separately as the median extra
seconds of a whole ``flasync.run`` call), with a 95% bootstrap interval of that median.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import flasync
import tracking
from flasync import seeding
from flasync.data import make_synthetic, partition_iid
from flasync.models import MLP

FEATURES, CLASSES, HIDDEN, SAMPLES, BATCH, LR = 32, 10, (64,), 200, 32, 0.01


def plain_loop(num_clients: int, updates: int, seed: int = 0) -> float:
    """Train ``updates`` clients one at a time in a bare loop; return updates per second."""
    data = make_synthetic(
        num_samples=SAMPLES * num_clients,
        num_features=FEATURES,
        num_classes=CLASSES,
        rng=seeding.numpy_stream(seed, 1),
    )
    partition = partition_iid(len(data), num_clients, rng=seeding.numpy_stream(seed, 2))
    torch.manual_seed(seed)
    model = MLP(FEATURES, HIDDEN, CLASSES)
    params = list(model.parameters())
    global_weights = [p.detach().clone() for p in params]
    accumulator = [torch.zeros_like(p) for p in params]
    optimizer = torch.optim.SGD(params, lr=LR)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randint(num_clients, (updates,), generator=generator).tolist()
    start = time.perf_counter()
    for client in order:
        index = torch.from_numpy(partition[client].copy())
        x, y = data.x[index], data.y[index]
        with torch.no_grad():
            for p, g in zip(params, global_weights, strict=True):
                p.copy_(g)
        perm = torch.randperm(len(y), generator=generator)
        for begin in range(0, len(y), BATCH):
            batch = perm[begin : begin + BATCH]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[batch]), y[batch])
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        with torch.no_grad():
            for acc, p, g in zip(accumulator, params, global_weights, strict=True):
                acc.add_(g - p, alpha=len(y))
    return updates / (time.perf_counter() - start)


def flasync_config(kind: str, num_clients: int, updates: int, *, tracking_uri: str | None) -> dict[str, Any]:
    """Return the run config of the tutorial workload for ``kind`` (fedavg or fedbuff)."""
    if kind == "fedavg":
        per_version = min(100, num_clients)
        server: dict[str, Any] = {"kind": "fedavg", "clients_per_round": per_version}
    else:
        per_version = 10
        server = {"kind": "fedbuff", "buffer_size": 10, "concurrency": min(50, num_clients)}
    versions = max(1, updates // per_version)
    return {
        "seed": 0,
        "data": {"kind": "synthetic", "samples_per_client": SAMPLES, "num_features": FEATURES, "test_samples": 500},
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": list(HIDDEN)},
        "population": {"num_clients": num_clients, "speed": {"kind": "constant"}},
        "client": {"epochs": 1, "batch_size": BATCH, "lr": LR},
        "server": server,
        "eval": {"every_versions": versions + 1},
        "stop": {"max_versions": versions},
        "tracking": {
            "enabled": tracking_uri is not None,
            "uri": tracking_uri,
            "experiment": "throughput",
            "log_model": False,
            "log_level": "warning",
        },
    }


def flasync_rate(kind: str, num_clients: int, updates: int, *, tracking_uri: str | None) -> float:
    """Run flasync once; return accepted updates per wall second of the federation."""
    summary = flasync.run(flasync_config(kind, num_clients, updates, tracking_uri=tracking_uri))
    return summary.updates_accepted / summary.wall_s


def timed_run(kind: str, num_clients: int, updates: int, *, tracking_uri: str | None) -> tuple[float, float]:
    """Run flasync once; return (updates per second of the federation, seconds of the whole ``flasync.run`` call)."""
    began = time.perf_counter()
    summary = flasync.run(flasync_config(kind, num_clients, updates, tracking_uri=tracking_uri))
    return summary.updates_accepted / summary.wall_s, time.perf_counter() - began


def median_interval(values: list[float], *, rng: np.random.Generator, resamples: int = 10_000) -> tuple[float, float]:
    """Return a 95% percentile-bootstrap interval of the median of ``values``."""
    data = np.asarray(values)
    medians = np.median(rng.choice(data, size=(resamples, len(data)), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def tracking_pairs(kind: str, num_clients: int, updates: int, pairs: int, uri: str) -> None:
    """Print the on/off ratio of ``pairs`` interleaved short runs (see the module docstring)."""
    ratios: list[float] = []
    extra_s: list[float] = []
    for index in range(pairs):
        order = ("on", "off") if index % 2 == 0 else ("off", "on")
        result = {
            side: timed_run(kind, num_clients, updates, tracking_uri=uri if side == "on" else None) for side in order
        }
        ratios.append(result["on"][0] / result["off"][0])
        extra_s.append(result["on"][1] - result["off"][1])
    low, high = median_interval(ratios, rng=np.random.default_rng(0))
    quartiles = statistics.quantiles(ratios, n=4)
    print(
        f"{num_clients:>8} {kind + ' on/off':<16} {pairs:>5} {statistics.median(ratios):>8.3f}x"
        f" {low:>7.3f}-{high:.3f} {quartiles[0]:>7.3f}-{quartiles[2]:.3f} {statistics.median(extra_s):>+8.1f} s"
    )


def main() -> None:
    """Print updates/s and ratios against the plain loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the runners against the loop (0: skip)")
    parser.add_argument("--pairs", type=int, default=20, help="tracking on/off pairs per workload (0: skip)")
    parser.add_argument("--pair-updates", type=int, default=1000, help="client updates of each run of a pair")
    args = parser.parse_args()
    tracking.configure_logging(level="warning")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads; best of {args.repeats} runs")
    print(f"{'clients':>8} {'runner':<24} {'updates/s':>10} {'vs plain':>9} {'paired':>11}")
    print(f"{'':>8} {'':<24} {'(best)':>10} {'(best)':>9} {'(median)':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        for num_clients in args.clients if args.repeats > 0 else ():
            runners = {
                "plain loop": lambda n=num_clients: plain_loop(n, args.updates),
                "fedavg, tracking off": lambda n=num_clients: flasync_rate(
                    "fedavg", n, args.updates, tracking_uri=None
                ),
                "fedavg, tracking on": lambda n=num_clients: flasync_rate("fedavg", n, args.updates, tracking_uri=uri),
                "fedbuff, tracking off": lambda n=num_clients: flasync_rate(
                    "fedbuff", n, args.updates, tracking_uri=None
                ),
                "fedbuff, tracking on": lambda n=num_clients: flasync_rate(
                    "fedbuff", n, args.updates, tracking_uri=uri
                ),
            }
            samples: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.repeats):  # interleaved, so drifts in machine load hit every runner alike
                for name, runner in runners.items():
                    samples[name].append(runner())
            rates = {name: max(values) for name, values in samples.items()}
            plain = rates["plain loop"]
            for name, rate in rates.items():
                # Median of the ratios within each repeat: runners of one repeat ran back to back, so the machine's
                # drift between repeats cancels out of each ratio.
                paired = statistics.median(
                    value / base for value, base in zip(samples[name], samples["plain loop"], strict=True)
                )
                print(f"{num_clients:>8} {name:<24} {rate:>10.1f} {rate / plain:>8.2f}x {paired:>10.2f}x")
            for kind in ("fedavg", "fedbuff"):
                on, off = samples[f"{kind}, tracking on"], samples[f"{kind}, tracking off"]
                paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
                best = rates[f"{kind}, tracking on"] / rates[f"{kind}, tracking off"]
                print(f"{num_clients:>8} {kind + ' tracking on/off':<24} {'':>10} {best:>8.2f}x {paired:>10.2f}x")
        if args.pairs > 0:
            print(f"\ntracking on/off: {args.pairs} interleaved pairs of {args.pair_updates}-update runs per row")
            print(
                f"{'clients':>8} {'workload':<16} {'pairs':>5} {'median':>9} {'95% CI':>13} {'quartiles':>13}"
                f" {'run cost':>10}"
            )
            for num_clients in args.clients:
                for kind in ("fedavg", "fedbuff"):
                    tracking_pairs(kind, num_clients, args.pair_updates, args.pairs, uri)


if __name__ == "__main__":
    main()
