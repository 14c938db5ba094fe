"""The algorithms under strong heterogeneity, and differentially private FedAvg's accuracy against epsilon.

Part 1: digits split over 100 clients by Dirichlet(0.1) (most clients hold two or three labels), 5 local epochs of
SGD (lr 0.1, batch 16), and the same budget of client updates for every method: FedAvg, FedProx, SCAFFOLD, FedAdam,
FedYogi (10 clients per round), FedBuff, FedBuff + FedAdam and FedBuff + SCAFFOLD (K = 10, C = 20). Test accuracy
at half and at the whole budget, mean and range over seeds. The baseline is FedAvg, measured in the same run.

Part 2: DP-FedAvg (clipped updates, Gaussian noise at the server, ``privacy.*``) on Dirichlet(0.5) digits with 20
clients per round, at three noise multipliers and without noise; epsilon at delta 1e-5 from dp-accounting.

    python benchmarks/algorithms.py                    # about 1 minute on 2 cores
    python benchmarks/algorithms.py --seeds 0 --updates 600   # quicker

Prints two markdown tables; their figures go to ``benchmarks/results/algorithms.json`` (``--out``; see
``benchmarks/record.py``), headed by each method's final accuracy against FedAvg's and DP-FedAvg's against no noise.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import uvloop

import flasync
from flasync.core.events import Evaluated

if __package__:  # imported as benchmarks.algorithms
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

ROUND = 10  # clients per round (FedAvg family) and buffer size K (FedBuff family): one version = 10 updates
FEDAVG = {"kind": "fedavg", "clients_per_round": ROUND}
FEDBUFF = {"kind": "fedbuff", "buffer_size": ROUND, "concurrency": 20}
ADAM = {"kind": "adam", "lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-3}
YOGI = {"kind": "yogi", "lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}

METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"server": FEDAVG},
    "FedProx (mu 0.1)": {"server": FEDAVG, "client": {"proximal_mu": 0.1}},
    "SCAFFOLD": {"server": FEDAVG, "scaffold": {"enabled": True}},
    "FedAdam": {"server": {**FEDAVG, "optimizer": ADAM}},
    "FedYogi": {"server": {**FEDAVG, "optimizer": YOGI}},
    "FedBuff": {"server": FEDBUFF},
    "FedBuff + FedAdam": {"server": {**FEDBUFF, "optimizer": ADAM}},
    "FedBuff + SCAFFOLD": {"server": FEDBUFF, "scaffold": {"enabled": True}},
}


def _config(method: dict[str, Any], *, seed: int, versions: int, alpha: float) -> dict[str, Any]:
    return {
        "seed": seed,
        "partition": {"kind": "dirichlet", "alpha": alpha},
        "client": {"epochs": 5, "batch_size": 16, "lr": 0.1, **method.get("client", {})},
        "server": method["server"],
        "scaffold": method.get("scaffold", {}),
        "privacy": method.get("privacy", {}),
        "stop": {"max_versions": versions},
        "eval": {"every_versions": max(versions // 2, 1)},
        "tracking": {"enabled": False, "log_level": "error"},
        "diagnostics": {"profile": False, "level": "off"},
    }


def _accuracy_at_half_and_end(config: dict[str, Any]) -> tuple[float, float, flasync.RunSummary]:
    """Run ``config``; return the accuracy after half the versions, at the end, and the summary."""
    federation = flasync.Federation(config)
    half: list[float] = []
    versions = config["stop"]["max_versions"]

    async def run() -> flasync.RunSummary:
        evaluated = federation.bus.subscribe(Evaluated, policy="drop_oldest")

        async def watch() -> None:
            async for event in evaluated:
                if event.version == versions // 2:
                    half.append(event.accuracy)

        watcher = asyncio.create_task(watch())
        try:
            return await federation.run()
        finally:
            watcher.cancel()

    summary = uvloop.run(run())
    return (half[0] if half else float("nan")), summary.accuracy, summary


def _cell(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    """Run both parts and print their tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=1000, help="client updates per method (a multiple of 10)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--noise", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument(
        "--out", type=Path, default=None, help="result file (default benchmarks/results/algorithms.json)"
    )
    args = parser.parse_args()
    described = machine()
    headline: list[Figure] = []
    methods: dict[str, dict[str, Any]] = {}
    private: dict[str, dict[str, Any]] = {}
    versions = args.updates // ROUND
    started = time.perf_counter()

    print(f"\nDirichlet(0.1) digits, 100 clients, {args.updates} client updates, seeds {args.seeds}")
    print(f"| method | accuracy after {args.updates // 2} updates | after {args.updates} | vs FedAvg | s per run |")
    print("|---|---|---|---|---|")
    baseline = 0.0
    for name, method in METHODS.items():
        halves, ends, seconds = [], [], []
        for seed in args.seeds:
            t0 = time.perf_counter()
            half, end, _ = _accuracy_at_half_and_end(_config(method, seed=seed, versions=versions, alpha=0.1))
            seconds.append(time.perf_counter() - t0)
            halves.append(half)
            ends.append(end)
        mean = statistics.fmean(ends)
        baseline = baseline or mean
        methods[name] = {"half": halves, "end": ends, "seconds": seconds}
        ratio = mean / baseline if baseline else None
        headline.append(Figure(f"{name}: accuracy after {args.updates} updates", mean, "accuracy", "FedAvg", ratio))
        print(
            f"| {name} | {_cell(halves)} | {_cell(ends)} | {mean - baseline:+.3f} | {statistics.fmean(seconds):.1f} |",
            flush=True,
        )

    dp_clients = 20
    dp_versions = args.updates // dp_clients
    print(
        f"\nDP-FedAvg: Dirichlet(0.5) digits, 100 clients, {dp_clients} per round, {dp_versions} rounds, "
        f"clip 1.0, delta 1e-5, seeds {args.seeds}"
    )
    print("| noise multiplier z | epsilon | accuracy |")
    print("|---|---|---|")
    for z in [None, *sorted(args.noise)]:
        privacy = {} if z is None else {"enabled": True, "noise_multiplier": z, "clip_norm": 1.0}
        method = {"server": {"kind": "fedavg", "clients_per_round": dp_clients}, "privacy": privacy}
        ends, epsilon = [], float("inf")
        for seed in args.seeds:
            _, end, summary = _accuracy_at_half_and_end(_config(method, seed=seed, versions=dp_versions, alpha=0.5))
            ends.append(end)
            epsilon = summary.privacy_epsilon if z is not None else float("inf")
        label = "no noise (no privacy)" if z is None else f"{z:g}"
        print(f"| {label} | {epsilon:.2f} | {_cell(ends)} |", flush=True)
        private[label] = {"noise_multiplier": z, "epsilon": None if z is None else epsilon, "end": ends}
        if z is not None:
            plain = statistics.fmean(private["no noise (no privacy)"]["end"])
            mean = statistics.fmean(ends)
            name = f"DP-FedAvg z {z:g} (epsilon {epsilon:.2f}): accuracy"
            headline.append(Figure(name, mean, "accuracy", "no noise", mean / plain if plain else None))
    seconds = time.perf_counter() - started
    print(f"\n({seconds:.0f} s)")
    store(
        "algorithms",
        described,
        settings={"updates": args.updates, "seeds": args.seeds, "noise": args.noise},
        headline=headline,
        figures={"methods": methods, "dp_fedavg": private, "seconds": seconds},
        out=args.out,
    )


if __name__ == "__main__":
    main()
