"""Client updates per second: flasync against a plain PyTorch loop doing the same training, in the same run.

The tutorial workload: synthetic data (32 features, 10 classes), MLP 32-64-10, 200 samples per client, batch 32,
1 local epoch, SGD lr 0.01. The baseline trains the same clients one after another in a bare ``for`` loop that
indexes in-memory tensors (no DataLoader) and averages their deltas, once on torch's default intra-op threads and
once on one thread (flasync's workers train on one thread each); the faster of the two in each repeat is the
baseline. flasync runs sync FedAvg and FedBuff on the virtual clock, with MLflow tracking on (a temporary sqlite
store) and off. A further runner, *flasync training alone*, calls flasync's local training function on the same
clients in a bare loop: against the plain loop it shows what flasync's training code gains or loses, and the
federations against it show what the orchestration costs.

    python benchmarks/throughput.py [--clients 100 1000] [--updates 2000] [--repeats 3] [--pairs 20] [--windows 40000]

Each repeat runs every runner once, back to back. Printed: the best rate of each runner and its ratio to the best
baseline rate, and the median over repeats of the ratio to the baseline of the same repeat ("paired"), which cancels
the drift of a shared machine's load between repeats.

Tracking on against off is then measured on its own, because a 5% difference is smaller than the drift of a shared
machine between two runs a few seconds apart: ``--pairs`` short runs (``--pair-updates`` updates) with tracking on
and off, back to back, in alternating order (on-off, off-on, ...), so a trend in the machine's speed hits both sides
alike. Printed: the median of the per-pair ratios of updates per second (the federation's own wall time: the MLflow
run's creation before it and the final flush after it are fixed costs, printed separately as the median extra
seconds of a whole ``flasync.run`` call), with a 95% bootstrap interval of that median.

The machine's speed also changes from one second to the next (runs of one config differ by 15%), so ``--windows``
measures tracking inside one long tracked run: its tracker sends metrics only in every other window of
``--window-s`` seconds (the writer thread and the MLflow process idle in the others) and counts client updates in
each. Each sending window is compared with the mean of its two neighbours, which cancels drift slower than a few
seconds. What windows cannot switch off, the extraction of metrics from each log call on the event loop, is timed
apart (per update, against the time of an update) and printed with it.

The figures of every section go to ``benchmarks/results/throughput.json`` (see ``benchmarks/record.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import flasync
from flasync import tracking
from flasync.core import seeding
from flasync.data import ArrayData, Partition, make_synthetic, partition_iid
from flasync.training.local import FlatModel, LocalTraining, train
from flasync.training.models import MLP

if __package__:  # imported as benchmarks.throughput
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

FEATURES, CLASSES, HIDDEN, SAMPLES, BATCH, LR = 32, 10, (64,), 200, 32, 0.01


def workload(num_clients: int, updates: int, seed: int) -> tuple[ArrayData, Partition, torch.Generator, list[int]]:
    """Return the bare loops' data, each client's sample indices, their random stream and the clients to train.

    Also seeds torch's global generator, from which the loops draw their model's initial weights.
    """
    data = make_synthetic(
        num_samples=SAMPLES * num_clients,
        num_features=FEATURES,
        num_classes=CLASSES,
        rng=seeding.numpy_stream(seed, 1),
    )
    partition = partition_iid(len(data), num_clients, rng=seeding.numpy_stream(seed, 2))
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randint(num_clients, (updates,), generator=generator).tolist()
    return data, partition, generator, order


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads on this thread (None: torch's default), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plain_loop(num_clients: int, updates: int, seed: int = 0, threads: int | None = None) -> float:
    """Train ``updates`` clients one at a time in a bare loop; return updates per second.

    ``threads``: intra-op threads of this thread while the loop runs (None: torch's default).
    """
    with intra_op_threads(threads):
        return _plain_loop(num_clients, updates, seed)


def _plain_loop(num_clients: int, updates: int, seed: int) -> float:
    data, partition, generator, order = workload(num_clients, updates, seed)
    model = MLP(FEATURES, HIDDEN, CLASSES)
    params = list(model.parameters())
    global_weights = [p.detach().clone() for p in params]
    accumulator = [torch.zeros_like(p) for p in params]
    optimizer = torch.optim.SGD(params, lr=LR)
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


def training_alone(num_clients: int, updates: int, seed: int = 0) -> float:
    """Train the same clients with flasync's local training function in a bare loop; return updates per second.

    No event loop, executor, codec or server: what flasync's :func:`~flasync.training.local.train` costs by itself, on
    one
    intra-op thread like flasync's workers, so that the gap between it and a federation is the framework's
    orchestration.
    """
    with intra_op_threads(1):
        return _training_alone(num_clients, updates, seed)


def _training_alone(num_clients: int, updates: int, seed: int) -> float:
    data, partition, generator, order = workload(num_clients, updates, seed)
    model = FlatModel(MLP(FEATURES, HIDDEN, CLASSES))
    global_weights = model.flat.clone()
    accumulator = torch.zeros_like(global_weights)
    cfg = LocalTraining(epochs=1, batch_size=BATCH, lr=LR)
    start = time.perf_counter()
    for client in order:
        index = torch.from_numpy(partition[client].copy())
        result = train(model, global_weights, data.x, data.y, cfg, generator, indices=index)
        accumulator.add_(result.delta, alpha=result.num_samples)
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
        "executor": {"kind": "thread"},  # the threads rows of the table (auto would pick cohorts for FedAvg)
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


class WindowedTracker(tracking.MlflowTracker):
    """An MLflow tracker that sends metrics only in every other window of ``window_s`` seconds.

    Metrics of the other windows are dropped before they reach the writer, so its thread and the MLflow writer
    process idle then; the time of every client update (its ``client/loss`` row) is recorded in both.
    """

    def __init__(self, tracking_uri: str, window_s: float) -> None:
        super().__init__(tracking_uri)
        self.window_s = window_s
        self.origin: float | None = None
        self.update_times: list[float] = []

    def log_metrics(self, metrics: list[tracking.MetricRow]) -> None:
        """Record update times; forward the metrics in sending windows only."""
        now = time.perf_counter()
        if self.origin is None:
            self.origin = now
        if metrics[0].key.startswith("client/") and any(m.key == "client/loss" for m in metrics):
            self.update_times.append(now)
        if int((now - self.origin) // self.window_s) % 2 == 0:
            super().log_metrics(metrics)


def window_ratios(tracker: WindowedTracker) -> list[float]:
    """Return, per complete sending window, its updates over the mean of its two neighbours' (drift cancels)."""
    assert tracker.origin is not None
    times = np.asarray(tracker.update_times)
    edges = tracker.origin + tracker.window_s * np.arange(int((times[-1] - tracker.origin) // tracker.window_s) + 1)
    counts, _ = np.histogram(times, edges)
    # The first and last windows are partial (start-up, the end of the run); even windows send.
    return [
        float(counts[i] / ((counts[i - 1] + counts[i + 1]) / 2))
        for i in range(2, len(counts) - 2, 2)
        if counts[i - 1] + counts[i + 1] > 0
    ]


def extraction_us_per_update(events_per_update: float, repeats: int = 20_000) -> float:
    """Time the metrics of one per-update event on the event loop (extraction, writer queue) in microseconds.

    The event is flasync's per-update ``client`` event with a real :class:`~tracking.MetricsProcessor` and
    :class:`~tracking.MetricWriter` (whose sink discards), minus the same call on an untracked logger.
    """
    writer = tracking.MetricWriter(lambda rows: None, flush_interval_s=0.5)
    tracked = tracking.make_logger(level="warning", metrics=tracking.MetricsProcessor(writer.submit))
    untracked = tracking.make_logger(level="warning")

    def event(log: Any) -> None:
        log.debug(
            "client",
            step=5,
            train_s=0.01,
            sim_train_s=1.2,
            sim_download_s=0.1,
            samples=200,
            loss=0.5,
            peak_mem_bytes=1000,
            encode_s=0.0001,
            download_bytes=9000,
            upload_bytes=9000,
            compression=1.0,
        )

    try:
        costs = [
            min(timeit.repeat(functools.partial(event, log), number=repeats, repeat=5)) / repeats
            for log in (tracked, untracked)
        ]
    finally:
        writer.close()
    return (costs[0] - costs[1]) * 1e6 * events_per_update


def tracking_windows(kind: str, num_clients: int, updates: int, window_s: float, uri: str) -> dict[str, Any]:
    """Print and return the on/off ratio of alternating windows of one tracked run (see the module docstring)."""
    tracker = WindowedTracker(uri, window_s)
    summary = asyncio.run(
        flasync.Federation(flasync_config(kind, num_clients, updates, tracking_uri=uri), tracker=tracker).run()
    )
    ratios = window_ratios(tracker)
    low, high = median_interval(ratios, rng=np.random.default_rng(0))
    rate = summary.updates_accepted / summary.wall_s
    # Per update: the client's event, the server's, and one version event per update of a version.
    per_version = min(100, num_clients) if kind == "fedavg" else 10
    extraction = extraction_us_per_update(2 + 1 / per_version)
    share = extraction * 1e-6 * rate
    print(
        f"{num_clients:>8} {kind + ' on/off':<16} {len(ratios):>7} {statistics.median(ratios):>8.3f}x"
        f" {low:>7.3f}-{high:.3f} {extraction:>9.1f} us {share:>6.1%} {statistics.median(ratios) * (1 - share):>8.3f}x"
    )
    return {
        "clients": num_clients,
        "workload": kind,
        "windows": len(ratios),
        "on_off_median": round(statistics.median(ratios), 4),
        "ci95": [round(low, 4), round(high, 4)],
        "extraction_us_per_update": round(extraction, 2),
        "extraction_share": round(share, 4),
        "on_off_total": round(statistics.median(ratios) * (1 - share), 4),
    }


def median_interval(values: list[float], *, rng: np.random.Generator, resamples: int = 10_000) -> tuple[float, float]:
    """Return a 95% percentile-bootstrap interval of the median of ``values``."""
    data = np.asarray(values)
    medians = np.median(rng.choice(data, size=(resamples, len(data)), replace=True), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def tracking_pairs(kind: str, num_clients: int, updates: int, pairs: int, uri: str) -> dict[str, Any]:
    """Print and return the on/off ratio of ``pairs`` interleaved short runs (see the module docstring)."""
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
    return {
        "clients": num_clients,
        "workload": kind,
        "pairs": pairs,
        "on_off_median": round(statistics.median(ratios), 4),
        "ci95": [round(low, 4), round(high, 4)],
        "quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
        "run_cost_s": round(statistics.median(extra_s), 2),
    }


def section(
    title: str, header: str, clients: list[int], measure: Callable[[str, int], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Print a table: its title and header, then one row per client count and workload; return the rows."""
    print(f"\n{title}")
    print(header)
    return [measure(kind, num_clients) for num_clients in clients for kind in ("fedavg", "fedbuff")]


def main() -> None:
    """Print updates/s and ratios against the plain loop."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the runners against the loop (0: skip)")
    parser.add_argument("--pairs", type=int, default=20, help="tracking on/off pairs per workload (0: skip)")
    parser.add_argument("--pair-updates", type=int, default=1000, help="client updates of each run of a pair")
    parser.add_argument("--windows", type=int, default=40000, help="updates of the windowed run (0: skip)")
    parser.add_argument("--window-s", type=float, default=1.0, help="seconds of each window of the windowed run")
    parser.add_argument("--out", type=Path, help="results JSON (default: benchmarks/results/throughput.json)")
    args = parser.parse_args()
    described = machine()
    tracking.configure_logging(level="warning")
    figures: dict[str, list[dict[str, Any]]] = {"runners": [], "pairs": [], "windows": []}
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {default_threads} intra-op threads by default; best of {args.repeats} runs")
    print("baseline: the faster plain loop of each repeat, on torch's default intra-op threads or on one thread")
    print(f"{'clients':>8} {'runner':<26} {'updates/s':>10} {'vs plain':>9} {'paired':>11}")
    print(f"{'':>8} {'':<26} {'(best)':>10} {'(best)':>9} {'(median)':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        for num_clients in args.clients if args.repeats > 0 else ():
            p = functools.partial
            runners: dict[str, Callable[[], float]] = {
                f"plain loop, {default_threads} threads": p(plain_loop, num_clients, args.updates),
                "plain loop, 1 thread": p(plain_loop, num_clients, args.updates, threads=1),
                "flasync training alone": p(training_alone, num_clients, args.updates),
                "fedavg, tracking off": p(flasync_rate, "fedavg", num_clients, args.updates, tracking_uri=None),
                "fedavg, tracking on": p(flasync_rate, "fedavg", num_clients, args.updates, tracking_uri=uri),
                "fedbuff, tracking off": p(flasync_rate, "fedbuff", num_clients, args.updates, tracking_uri=None),
                "fedbuff, tracking on": p(flasync_rate, "fedbuff", num_clients, args.updates, tracking_uri=uri),
            }
            plain_names = list(runners)[:2]
            samples: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.repeats):  # interleaved, so drifts in machine load hit every runner alike
                for name, runner in runners.items():
                    samples[name].append(runner())
            # The baseline is the plain loop at its better thread count, repeat by repeat.
            baseline = [max(values) for values in zip(*(samples[name] for name in plain_names), strict=True)]
            rates = {name: max(values) for name, values in samples.items()}
            plain = max(baseline)
            for name, rate in rates.items():
                # Median of the ratios within each repeat: runners of one repeat ran back to back, so the machine's
                # drift between repeats cancels out of each ratio.
                paired = statistics.median(value / base for value, base in zip(samples[name], baseline, strict=True))
                print(f"{num_clients:>8} {name:<26} {rate:>10.1f} {rate / plain:>8.2f}x {paired:>10.2f}x")
                row = {"clients": num_clients, "runner": name, "updates_per_s": round(rate, 1)}
                figures["runners"].append(row | {"vs_plain": round(rate / plain, 3), "paired": round(paired, 3)})
            for kind in ("fedavg", "fedbuff"):
                on, off = samples[f"{kind}, tracking on"], samples[f"{kind}, tracking off"]
                paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
                best = rates[f"{kind}, tracking on"] / rates[f"{kind}, tracking off"]
                print(f"{num_clients:>8} {kind + ' tracking on/off':<26} {'':>10} {best:>8.2f}x {paired:>10.2f}x")
        if args.pairs > 0:
            figures["pairs"] = section(
                f"tracking on/off: {args.pairs} interleaved pairs of {args.pair_updates}-update runs per row",
                f"{'clients':>8} {'workload':<16} {'pairs':>5} {'median':>9} {'95% CI':>13} {'quartiles':>13}"
                f" {'run cost':>10}",
                args.clients,
                lambda kind, n: tracking_pairs(kind, n, args.pair_updates, args.pairs, uri),
            )
        if args.windows > 0:
            figures["windows"] = section(
                f"tracking on/off inside one run of {args.windows} updates: metrics sent in alternate"
                f" {args.window_s:g}-s windows; extraction timed apart",
                f"{'clients':>8} {'workload':<16} {'windows':>7} {'median':>9} {'95% CI':>13} {'extraction':>12}"
                f" {'share':>6} {'total':>9}",
                args.clients,
                lambda kind, n: tracking_windows(kind, n, args.windows, args.window_s, uri),
            )
    headline = [
        Figure(
            f"{row['runner']}, {row['clients']:,} clients",
            row["updates_per_s"],
            "updates/s",
            "plain loop",
            row["paired"],
        )
        for row in figures["runners"]
        if row["runner"].startswith(("fedavg", "fedbuff", "flasync"))
    ]
    headline += [
        Figure(f"{row['workload']} tracking on/off ({row['clients']:,} clients, {what})", row["on_off_median"], "x")
        for what in ("pairs", "windows")
        for row in figures[what]
    ]
    settings = {k: getattr(args, k) for k in ("clients", "updates", "repeats", "pairs", "pair_updates", "windows")}
    store(
        "throughput",
        described,
        settings=settings | {"window_s": args.window_s},
        headline=headline,
        figures=figures,
        out=args.out,
    )


if __name__ == "__main__":
    main()
