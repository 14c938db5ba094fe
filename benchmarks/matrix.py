"""Updates per second as a user waits for them: the whole ``flasync.run`` call against a plain PyTorch loop.

The tutorial workload (synthetic data, 32 features, 10 classes; MLP 32-64-10; 200 samples per client; batch 32;
1 local epoch; SGD lr 0.01) at two points, every client of the population in every FedAvg round:

* 100 clients x 20 rounds (2,000 client updates),
* 1,000 clients x 5 rounds (5,000 client updates).

Runners, each timed as the whole ``flasync.run(config)`` call (what a user waits for: start-up, training, the
MLflow run's end) and as the federation alone (``summary.wall_s``):

* ``plain loop``: the same number of client updates, one client at a time, ``torch.optim.SGD`` over in-memory
  tensors (``benchmarks/throughput.py``'s baseline; the faster of 1 and 2 intra-op threads);
* FedAvg on the threads executor and on vectorized cohorts, tracking off and on (a temporary SQLite store that
  exists before the timed runs, as a user's does after the first run; default tracking settings, model logged);
* FedBuff (K = 10, C = 20, the default aggregator) and ``executor.kind = "auto"`` (the default), tracking on.

Then FedBuff's cohorts: 1,000 clients, K = 10, 2,000 updates, tracking off, the threads against vectorized cohorts
at concurrency C = 20, 50 and 100, with the final weights' sha256 of every repeat (the virtual clock makes them
equal).

Every repeat runs every runner once, interleaved. Printed: each runner's median rate, its ratio to the plain loop's
median rate, and the median over repeats of the ratio within a repeat (``paired``: it cancels the drift of a
shared machine's load between repeats).

    python benchmarks/matrix.py [--repeats 3] [--points 100x20 1000x5] [--concurrency 20 50 100]

Every rate goes to ``benchmarks/results/matrix.json`` (``--out``; see ``benchmarks/record.py``), headed by each
runner's whole-call rate against the plain loop's (paired) and vectorized FedBuff against the threads.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from record import Figure, machine, store
from throughput import BATCH, FEATURES, HIDDEN, LR, SAMPLES, plain_loop

import flasync

Rates = tuple[float, float]  # whole call, federation alone (updates per second)


def config(
    clients: int, updates: int, *, server: dict[str, Any], executor: str, uri: str | None, seed: int = 0
) -> dict[str, Any]:
    """Return the tutorial workload's run config (tracking into ``uri``, or off when None)."""
    per_version = server.get("clients_per_round", server.get("buffer_size", 10))
    versions = max(1, updates // per_version)
    return {
        "seed": seed,
        "data": {"kind": "synthetic", "samples_per_client": SAMPLES, "num_features": FEATURES, "test_samples": 500},
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": list(HIDDEN)},
        "population": {"num_clients": clients},
        "client": {"epochs": 1, "batch_size": BATCH, "lr": LR},
        "server": server,
        "executor": {"kind": executor},
        "eval": {"every_versions": versions},
        "stop": {"max_versions": versions},
        "tracking": {"enabled": uri is not None, "uri": uri, "experiment": "matrix", "log_level": "warning"},
    }


def timed(run_config: dict[str, Any]) -> tuple[Rates, str]:
    """Run once; return (whole-call rate, federation rate) and the final weights' sha256."""
    began = time.perf_counter()
    summary = flasync.run(run_config)
    whole = time.perf_counter() - began
    return (summary.updates_accepted / whole, summary.updates_accepted / summary.wall_s), summary.weights_sha256


def point_runners(clients: int, rounds: int, uri: str) -> dict[str, Callable[[], Rates]]:
    """Return the runners of one point of the table."""
    updates = clients * rounds
    fedavg = {"kind": "fedavg", "clients_per_round": clients}
    fedbuff = {"kind": "fedbuff", "buffer_size": 10, "concurrency": min(20, clients)}

    def plain() -> Rates:
        rate = max(plain_loop(clients, updates, threads=1), plain_loop(clients, updates))
        return rate, rate

    def run(server: dict[str, Any], executor: str, tracked: bool) -> Callable[[], Rates]:
        store = uri if tracked else None
        return lambda: timed(config(clients, updates, server=server, executor=executor, uri=store))[0]

    return {
        "plain loop": plain,
        "FedAvg threads, no tracking": run(fedavg, "thread", False),
        "FedAvg threads, tracking on": run(fedavg, "thread", True),
        "FedAvg vectorized, no tracking": run(fedavg, "vectorized", False),
        "FedAvg vectorized, tracking on": run(fedavg, "vectorized", True),
        "FedAvg auto, tracking on": run(fedavg, "auto", True),
        "FedBuff auto, tracking on": run(fedbuff, "auto", True),
    }


def interleave(runners: dict[str, Callable[[], Rates]], repeats: int) -> dict[str, list[Rates]]:
    """Run every runner once per repeat, in order; return each runner's rates."""
    rates: dict[str, list[Rates]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            rates[name].append(runner())
    return rates


def print_point(label: str, rates: dict[str, list[Rates]]) -> list[Figure]:
    """Print each runner's median whole-call and federation rates and their ratios to the plain loop; return the
    whole-call rates as headline figures (paired ratios to the plain loop)."""
    headline: list[Figure] = []
    baseline = [whole for whole, _ in rates["plain loop"]]
    base = statistics.median(baseline)
    print(f"\n{label}: updates/s (ratio to the plain loop's median; paired: median of per-repeat ratios)")
    print(f"{'runner':<32} {'whole call':>11} {'ratio':>7} {'paired':>7} {'federation':>11} {'ratio':>7}")
    for name, values in rates.items():
        whole = [w for w, _ in values]
        federation = [f for _, f in values]
        paired = statistics.median(w / b for w, b in zip(whole, baseline, strict=True))
        w, f = statistics.median(whole), statistics.median(federation)
        print(f"{name:<32} {w:11.0f} {w / base:6.2f}x {paired:6.2f}x {f:11.0f} {f / base:6.2f}x")
        if name != "plain loop":
            headline.append(Figure(f"{label}, {name}: whole call", w, "updates/s", "plain loop (paired)", paired))
    for kind in ("threads", "vectorized"):
        on = statistics.median(w for w, _ in rates[f"FedAvg {kind}, tracking on"])
        off = statistics.median(w for w, _ in rates[f"FedAvg {kind}, no tracking"])
        print(f"{f'tracked / untracked (FedAvg {kind}, whole call)':<60} {on / off:6.2f}x")
    return headline


def fedbuff_cohorts(concurrency: list[int], repeats: int) -> tuple[list[Figure], dict[str, Any]]:
    """Print FedBuff's threads against vectorized cohorts at each concurrency, with the weights' sha256s; return the
    headline figures and every rate by concurrency."""
    headline: list[Figure] = []
    figures: dict[str, Any] = {}
    clients, updates = 1000, 2000
    print(f"\nFedBuff cohorts: {clients} clients, K = 10, {updates} updates, tracking off (whole-call updates/s)")
    print(f"{'C':>4} {'threads':>9} {'vectorized':>11} {'ratio':>7} {'paired':>7}  vectorized sha256 (every repeat)")
    for c in concurrency:
        server = {"kind": "fedbuff", "buffer_size": 10, "concurrency": c}
        threads: list[float] = []
        vectorized: list[float] = []
        hashes: list[str] = []
        for _ in range(repeats):
            threads.append(timed(config(clients, updates, server=server, executor="thread", uri=None))[0][0])
            rates, sha = timed(config(clients, updates, server=server, executor="vectorized", uri=None))
            vectorized.append(rates[0])
            hashes.append(sha[:12])
        t, v = statistics.median(threads), statistics.median(vectorized)
        paired = statistics.median(b / a for a, b in zip(threads, vectorized, strict=True))
        same = "all equal" if len(set(hashes)) == 1 else "DIFFER"
        print(f"{c:>4} {t:9.0f} {v:11.0f} {v / t:6.2f}x {paired:6.2f}x  {' '.join(hashes)} ({same})")
        figures[str(c)] = {"threads": threads, "vectorized": vectorized, "sha256": hashes}
        name = f"FedBuff C {c}, vectorized cohorts: whole call"
        headline.append(Figure(name, v, "updates/s", "threads (paired)", paired))
    return headline, figures


def main() -> None:
    """Print the matrix."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points", nargs="+", default=["100x20", "1000x5"], help="CLIENTSxROUNDS")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[20, 50, 100])
    parser.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/)")
    args = parser.parse_args()
    described = machine()
    headline: list[Figure] = []
    figures: dict[str, Any] = {"intra_op_threads": torch.get_num_threads(), "points": {}}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads by default, {args.repeats} repeats")
    with tempfile.TemporaryDirectory(prefix="flasync-matrix-") as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        # The store exists before the timed runs (a user's first run builds it once: benchmarks/startup.py).
        timed(config(20, 20, server={"kind": "fedavg", "clients_per_round": 10}, executor="thread", uri=uri))
        for point in args.points:
            clients, rounds = (int(part) for part in point.split("x"))
            rates = interleave(point_runners(clients, rounds, uri), args.repeats)
            headline += print_point(f"{clients} clients x {rounds} rounds", rates)
            figures["points"][point] = {name: [list(r) for r in values] for name, values in rates.items()}
    if args.concurrency:
        cohort_headline, figures["fedbuff_cohorts"] = fedbuff_cohorts(args.concurrency, args.repeats)
        headline += cohort_headline
    settings = {"repeats": args.repeats, "points": args.points, "concurrency": args.concurrency}
    store("matrix", described, settings=settings, headline=headline, figures=figures, out=args.out)


if __name__ == "__main__":
    main()
