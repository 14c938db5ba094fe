"""Secure aggregation: accuracy with and without it, and what it costs per update in bytes and simulated seconds.

1. Accuracy: FedBuff (K = 10, concurrency 20, polynomial staleness) and FedAvg (10 clients a round) on a non-IID
   Gaussian-mixture task (100 clients, an MLP 32-64-10), each run three times from the same seed: plain float32 sums,
   then every buffer or round through SecAgg+ (:mod:`flasync.secure`, 32-bit ring, clip 1, 5% of clients dropping
   at a random round of the protocol), then secure with no dropout. The clients and their order are the same in
   every run; what differs is the fixed-point quantization, the clipping and the dropped updates.
2. A real federation: ``flasync.Federation`` on the digits data (50 clients, an MLP with 32 hidden units), FedBuff
   (K = 10, concurrency 20) and FedAvg (10 clients a round), each from one seed with ``[secure_aggregation]`` off,
   on, and on with 5% of the members dropping out during the protocol: accuracy, simulated seconds, and upload and
   download bytes per accepted update (the protocol's, under secure aggregation) against the plain run measured in
   the same invocation.
3. Remote clients: a ``flasync serve`` server on 127.0.0.1 and K + 2 remote clients (``flasync.clients.remote``)
   over HTTP, all in this process, FedBuff with K = 3, 10 and 50, plain and secure: upload and download bytes per
   accepted update on the wire (the protocol's four rounds under secure aggregation) and wall seconds per version
   on this machine.
4. Cost per update: one group of K = 10, 50, 100 (a FedBuff buffer, or a FedAvg round of 100) with the complete
   graph (SecAgg) and with 16 neighbours (SecAgg+): protocol bytes per client against a plain float32 upload of the
   same model, simulated seconds of the protocol's four rounds on [network]'s default link against one plain
   upload, and the real CPU seconds the whole group's cryptography took on this machine.

    python benchmarks/secagg.py [--versions 60] [--seed 0] [--max-complete 100] [--federation-versions 40]
        [--remote-versions 10] [--remote-sizes 3 10 50] [--out benchmarks/results/secagg.json]

``--max-complete 50`` leaves out the complete graph of 100 (the slowest group: seconds of cryptography on 2 cores).
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import flasync
from flasync.aggregation import PolynomialStaleness
from flasync.secure.rounds import ClientUpdate, Link, SecureAggregator, SecureBuffer, WaitingUpdate

if __package__:
    from benchmarks.record import Figure, machine, store
else:
    from record import Figure, machine, store

FEATURES, CLASSES, CLIENTS, PER_CLIENT = 32, 10, 100, 60
LINK = Link()


class Task:
    """A non-IID classification task: Gaussian clusters, each client's labels drawn from a Dirichlet(0.5) mix."""

    def __init__(self, seed: int) -> None:
        """Draw the clusters, the clients' data and a test set."""
        generator = torch.Generator().manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.centers = torch.randn(CLASSES, FEATURES, generator=generator) * 1.2
        self.clients = []
        for _ in range(CLIENTS):
            labels = torch.from_numpy(rng.choice(CLASSES, PER_CLIENT, p=rng.dirichlet([0.5] * CLASSES)))
            self.clients.append((self._points(labels, generator), labels))
        test_labels = torch.arange(2000) % CLASSES
        self.test = (self._points(test_labels, generator), test_labels)
        with torch.random.fork_rng():  # the model's initial weights from the seed, the global stream untouched
            torch.manual_seed(seed)
            self.model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))
        self.initial = nn.utils.parameters_to_vector(self.model.parameters()).detach().clone()

    def _points(self, labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.centers[labels] + torch.randn(len(labels), FEATURES, generator=generator) * 1.5

    def delta(self, weights: torch.Tensor, client: int) -> torch.Tensor:
        """Train 2 local epochs of SGD (batch 20, lr 0.05) from ``weights``; return ``weights - local``."""
        # vector_to_parameters makes the parameters views of its vector: train on a copy, never on ``weights``
        nn.utils.vector_to_parameters(weights.clone(), self.model.parameters())
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        x, y = self.clients[client]
        for _ in range(2):
            for start in range(0, PER_CLIENT, 20):
                optimizer.zero_grad()
                nn.functional.cross_entropy(self.model(x[start : start + 20]), y[start : start + 20]).backward()
                optimizer.step()
        return weights - nn.utils.parameters_to_vector(self.model.parameters()).detach()

    def accuracy(self, weights: torch.Tensor) -> float:
        """Return the test accuracy of ``weights``."""
        nn.utils.vector_to_parameters(weights.clone(), self.model.parameters())
        with torch.no_grad():
            x, y = self.test
            return float((self.model(x).argmax(1) == y).float().mean())


def secure(group_size: int, seed: int, neighbours: int | None = None, dropout: float = 0.05) -> SecureAggregator:
    """Return SecAgg(+) for groups of ``group_size``: 32 bits, clip 1, a majority threshold."""
    degree = group_size - 1 if neighbours is None else neighbours
    return SecureAggregator(
        bits=32,
        clip=1.0,
        group_size=group_size,
        threshold=degree // 2 + 1,
        neighbours=neighbours,
        seed=seed,
        link=LINK,
        dropout_rate=dropout,
    )


def fedbuff(task: Task, *, versions: int, seed: int, secured: bool, dropout: float = 0.05) -> dict[str, Any]:
    """Run FedBuff in virtual time (lognormal durations); plain buffers or SecureBuffer; return accuracy and costs."""
    k, concurrency, staleness = 10, 20, PolynomialStaleness(a=0.5)
    rng = np.random.default_rng(seed)
    weights, version = task.initial.clone(), 0
    buffer = SecureBuffer(secure(k, seed, dropout=dropout), k, staleness, example_weight_scale=float(PER_CLIENT))
    acc, total_e, count = torch.zeros_like(weights), 0.0, 0
    heap: list[tuple[float, int, int, int, torch.Tensor]] = []
    waits: list[float] = []
    abandoned = recovered = sequence = 0
    in_buffer: set[int] = set()

    def dispatch(now: float) -> None:
        # a client trains one task at a time, and one waiting for its buffer to fill trains none; the plain run
        # samples the same way (no client twice in a buffer), so the runs differ in their aggregation alone
        nonlocal sequence
        busy = {entry[2] for entry in heap} | {w.client for w in buffer.waiting} | in_buffer
        client = int(rng.choice(sorted(set(range(CLIENTS)) - busy)))
        finish = now + float(rng.lognormal(0.0, 0.6))
        heapq.heappush(heap, (finish, sequence, client, version, weights.clone()))
        sequence += 1

    for _ in range(concurrency):
        dispatch(0.0)
    while version < versions:
        now, _, client, base, base_weights = heapq.heappop(heap)
        delta = task.delta(base_weights, client)
        if secured:
            closed = buffer.arrive(WaitingUpdate(client, base, delta, float(PER_CLIENT), now))
            if closed is not None:
                report, buffer_waits = closed
                waits += buffer_waits
                abandoned += report.abandoned
                recovered += len(report.recovered)
                mean = report.mean()
                if mean is not None:
                    weights -= mean
                version = buffer.version
        else:
            acc += staleness(version - base) * delta
            total_e, count = total_e + 1.0, count + 1
            in_buffer.add(client)
            if count == k:
                in_buffer.clear()
                weights -= acc / total_e
                acc.zero_()
                total_e, count, version = 0.0, 0, version + 1
        dispatch(now)
    return {
        "accuracy": task.accuracy(weights),
        "abandoned": abandoned,
        "recovered": recovered,
        "mean_wait_s": float(np.mean(waits)) if waits else 0.0,
        "weights": weights,
    }


def fedavg(task: Task, *, rounds: int, seed: int, secured: bool, dropout: float = 0.05) -> dict[str, Any]:
    """Run FedAvg rounds of 10 sampled clients; plain or secure sums; return accuracy and the groups' counts."""
    rng = np.random.default_rng(seed)
    weights, aggregator = task.initial.clone(), secure(10, seed, dropout=dropout)
    abandoned = recovered = 0
    for r in range(rounds):
        cohort = [int(c) for c in rng.choice(CLIENTS, 10, replace=False)]
        deltas = [task.delta(weights, c) for c in cohort]
        if secured:
            report = aggregator.aggregate(r, [ClientUpdate(c, d, 1.0) for c, d in zip(cohort, deltas, strict=True)])
            abandoned += report.abandoned
            recovered += len(report.recovered)
            mean = report.mean()
            if mean is not None:
                weights -= mean
        else:
            weights -= torch.stack(deltas).mean(0)
    return {"accuracy": task.accuracy(weights), "abandoned": abandoned, "recovered": recovered, "weights": weights}


FEDERATION = {
    "data": {"kind": "digits"},
    "partition": {"kind": "iid"},
    "model": {"kind": "mlp", "hidden": [32]},
    "population": {"num_clients": 50},
    "client": {"epochs": 2, "batch_size": 16, "lr": 0.1},
    "tracking": {"enabled": False, "log_level": "warning", "log_model": False},
}
SERVERS = {
    "fedbuff": {"kind": "fedbuff", "buffer_size": 10, "concurrency": 20},
    "fedavg": {"kind": "fedavg", "clients_per_round": 10},
}


def federation(server: str, *, versions: int, seed: int, secure: dict[str, Any] | None) -> dict[str, Any]:
    """Run ``flasync.Federation`` with ``server`` for ``versions`` versions (``secure``: the section, None: off)."""
    config: dict[str, Any] = {
        **FEDERATION,
        "seed": seed,
        "server": SERVERS[server],
        "eval": {"every_versions": versions},
        "stop": {"max_versions": versions},
    }
    if secure is not None:
        config["secure_aggregation"] = {"enabled": True, **secure}
    summary = flasync.run(config)
    updates = max(summary.updates_accepted, 1)
    return {
        "accuracy": summary.accuracy,
        "versions": summary.versions,
        "updates": summary.updates_accepted,
        "failed": summary.updates_failed,
        "simulated_s": summary.simulated_s,
        "simulated_s_per_version": summary.simulated_s / max(summary.versions, 1),
        "upload_bytes_per_update": summary.upload_bytes / updates,
        "download_bytes_per_update": summary.download_bytes / updates,
        "wall_s": summary.wall_s,
        "weights_sha256": summary.weights_sha256,
    }


def federations(versions: int, seed: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Return each server's plain, secure and secure-with-dropouts runs, with ratios against the plain run."""
    variants = {"plain": None, "secure": {}, "secure_dropout": {"dropout": 0.05, "max_dropouts": 2}}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for server in SERVERS:
        runs = {name: federation(server, versions=versions, seed=seed, secure=s) for name, s in variants.items()}
        plain = runs["plain"]
        for run in runs.values():
            for key in ("simulated_s_per_version", "upload_bytes_per_update", "download_bytes_per_update"):
                run[f"{key}_ratio"] = run[key] / plain[key]
        out[server] = runs
    return out


REMOTE_SPARE = 2
"""Remote devices beyond the buffer's K (a buffer fills while the previous one runs its protocol)."""


REMOTE_NEIGHBOURS = 16
"""The SecAgg+ degree of remote groups larger than :data:`REMOTE_COMPLETE` (smaller ones use the complete graph)."""
REMOTE_COMPLETE = 50


def _remote_secure(group: int) -> dict[str, Any]:
    """Return a remote run's ``[secure_aggregation]`` for groups of ``group``: the complete graph up to
    :data:`REMOTE_COMPLETE` members, :data:`REMOTE_NEIGHBOURS` neighbours above."""
    section: dict[str, Any] = {"enabled": True, "max_dropouts": 0}
    if group > REMOTE_COMPLETE:
        section["neighbours"] = REMOTE_NEIGHBOURS
    return section


async def _remote_run(
    folder: Path, versions: int, seed: int, secure: bool, buffer_size: int, fedavg: bool = False
) -> dict[str, Any]:
    """Serve one FedBuff run of ``buffer_size`` on 127.0.0.1 to ``buffer_size + 2`` remote devices over HTTP (with
    ``fedavg``: FedAvg rounds of ``buffer_size`` devices, all of them); return its figures."""
    import asyncio
    import secrets

    from flasync.clients.remote.client import Client
    from flasync.runtime.serve import serve

    devices = buffer_size if fedavg else buffer_size + REMOTE_SPARE
    tokens = {client: secrets.token_urlsafe(24) for client in range(devices)}
    (folder / "tokens.txt").write_text("".join(f"{c} {t}\n" for c, t in tokens.items()))
    config: dict[str, Any] = {
        **FEDERATION,
        "seed": seed,
        "clock": "wall",
        "population": {"num_clients": devices},
        "server": (
            {"kind": "fedavg", "clients_per_round": devices}
            if fedavg
            else {"kind": "fedbuff", "buffer_size": buffer_size, "concurrency": devices}
        ),
        "resilience": {"task_timeout_s": 60.0},
        "eval": {"every_versions": versions},
        "stop": {"max_versions": versions},
        "remote": {"enabled": True, "tokens_file": str(folder / "tokens.txt"), "poll_s": 5.0},
    }
    if secure:
        config["secure_aggregation"] = _remote_secure(buffer_size)
    federation = flasync.Federation(config)
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    served = asyncio.create_task(serve(federation, port=0, on_ready=port.set_result, linger_s=2.0))
    url = f"http://127.0.0.1:{await port}"
    await asyncio.gather(*(Client(url, t, poll_s=2.0, backoff_s=0.05).run() for t in tokens.values()))
    summary = await served
    updates = max(summary.updates_accepted, 1)
    return {
        "accuracy": summary.accuracy,
        "versions": summary.versions,
        "upload_bytes_per_update": summary.upload_bytes / updates,
        "download_bytes_per_update": summary.download_bytes / updates,
        "wall_s_per_version": summary.wall_s / max(summary.versions, 1),
    }


def remote(versions: int, seed: int, buffer_size: int, fedavg: bool = False) -> dict[str, Any]:
    """Return the plain and secure remote runs of one buffer size (``fedavg``: of one FedAvg round's size), with
    ratios against the plain one."""
    import asyncio
    import tempfile

    runs: dict[str, Any] = {
        "server": "fedavg" if fedavg else "fedbuff",
        "buffer_size": buffer_size,
        "devices": buffer_size if fedavg else buffer_size + REMOTE_SPARE,
        "neighbours": _remote_secure(buffer_size).get("neighbours", buffer_size - 1),
    }
    for name, secure in (("plain", False), ("secure", True)):
        with tempfile.TemporaryDirectory() as folder:
            runs[name] = asyncio.run(_remote_run(Path(folder), versions, seed, secure, buffer_size, fedavg))
    for name in ("plain", "secure"):
        for key in ("upload_bytes_per_update", "download_bytes_per_update", "wall_s_per_version"):
            runs[name][f"{key}_ratio"] = runs[name][key] / runs["plain"][key]
    return runs


def overhead(num_params: int, seed: int, max_complete: int = 100) -> list[dict[str, Any]]:
    """Return one row per group size and graph: bytes and simulated seconds per update against a plain upload.

    A complete graph (every client a neighbour of every other) is measured for groups up to ``max_complete``.
    """
    rows = []
    plain_bytes = 4 * num_params
    plain_s = LINK.latency_s + plain_bytes / LINK.upload_bytes_per_s
    generator = torch.Generator().manual_seed(seed)
    for label, size, neighbours in (
        ("fedbuff K=10", 10, None),
        ("fedbuff K=50", 50, None),
        ("fedbuff K=50", 50, 16),
        ("fedbuff K=100", 100, None),
        ("fedbuff K=100", 100, 16),
        ("fedavg round of 100", 100, 16),
    ):
        if neighbours is None and size > max_complete:
            continue
        aggregator = secure(size, seed, neighbours, dropout=0.05 if label.startswith("fedavg") else 0.0)
        updates = [ClientUpdate(i, torch.randn(num_params, generator=generator) * 0.01, 1.0) for i in range(size)]
        start = time.perf_counter()
        report = aggregator.aggregate(0, updates)
        cpu_s = time.perf_counter() - start
        protocol_bytes = sum(report.phase_bytes.values()) / size
        protocol_s = sum(report.phase_s.values())
        rows.append(
            {
                "setting": label,
                "group": size,
                "neighbours": neighbours if neighbours is not None else size - 1,
                "bytes_per_update": protocol_bytes,
                "plain_bytes_per_update": plain_bytes,
                "bytes_ratio": protocol_bytes / plain_bytes,
                "protocol_s": protocol_s,
                "plain_upload_s": plain_s,
                "time_ratio": protocol_s / plain_s,
                "group_cpu_s": cpu_s,
                "recovered": len(report.recovered),
                "abandoned": report.abandoned,
            }
        )
    return rows


def _table(rows: list[dict[str, Any]], keys: list[str], formats: dict[str, Callable[[Any], str]]) -> str:
    lines = [" | ".join(keys)]
    for row in rows:
        lines.append(" | ".join(formats.get(k, str)(row[k]) for k in keys))
    return "\n".join(lines)


def main() -> None:
    """Run both parts, print them and store the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-complete", type=int, default=100, help="largest group measured with the complete graph (SecAgg)"
    )
    parser.add_argument(
        "--federation-versions", type=int, default=40, help="versions of each flasync federation run (part 2)"
    )
    parser.add_argument("--remote-versions", type=int, default=10, help="versions of each remote run (part 3)")
    parser.add_argument(
        "--remote-sizes",
        type=int,
        nargs="+",
        default=[3, 10, 50, 100],
        help="buffer sizes K of the remote runs (part 3)",
    )
    parser.add_argument(
        "--remote-rounds", type=int, nargs="*", default=[100], help="FedAvg round sizes of the remote runs (part 3)"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "secagg.json")
    args = parser.parse_args()
    described = machine()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and the figures do not depend on the core count
    task = Task(args.seed)
    variants = (("plain", False, 0.0), ("secure", True, 0.05), ("secure, no dropout", True, 0.0))
    accuracy = {
        "fedbuff": {
            name: fedbuff(task, versions=args.versions, seed=args.seed, secured=flag, dropout=rate)
            for name, flag, rate in variants
        },
        "fedavg": {
            name: fedavg(task, rounds=args.versions, seed=args.seed, secured=flag, dropout=rate)
            for name, flag, rate in variants
        },
    }
    for mode, runs in accuracy.items():
        plain, plain_weights = runs["plain"]["accuracy"], runs["plain"]["weights"]
        for run in runs.values():
            run["max_weight_gap"] = float((run.pop("weights") - plain_weights).abs().max())
        for name, run in runs.items():
            line = (
                f"{mode} {name}: accuracy {run['accuracy']:.4f} (against plain {run['accuracy'] - plain:+.4f}), "
                f"largest weight gap to plain {run['max_weight_gap']:.2e}"
            )
            if name != "plain":
                line += f"; recovered {run['recovered']}, abandoned {run['abandoned']}"
            if run.get("mean_wait_s"):
                line += f", mean buffer wait {run['mean_wait_s']:.2f} s"
            print(line)
    runs = federations(args.federation_versions, args.seed)
    for server, variants in runs.items():
        for name, run in variants.items():
            print(
                f"flasync {server} {name}: accuracy {run['accuracy']:.4f}, {run['versions']} versions in "
                f"{run['simulated_s']:.1f} simulated s ({run['simulated_s_per_version_ratio']:.2f}x plain a version), "
                f"up {run['upload_bytes_per_update']:,.0f} B/update ({run['upload_bytes_per_update_ratio']:.2f}x), "
                f"down {run['download_bytes_per_update']:,.0f} B/update ({run['download_bytes_per_update_ratio']:.2f}x)"
            )
    remote_runs = [remote(args.remote_versions, args.seed, k) for k in args.remote_sizes]
    remote_runs += [remote(args.remote_versions, args.seed, n, fedavg=True) for n in args.remote_rounds]
    for sized in remote_runs:
        for name in ("plain", "secure"):
            run = sized[name]
            print(
                f"remote {sized['server']} K={sized['buffer_size']} ({sized['devices']} devices, "
                f"{sized['neighbours']} neighbours) {name}: "
                f"accuracy {run['accuracy']:.4f}, "
                f"up {run['upload_bytes_per_update']:,.0f} B/update ({run['upload_bytes_per_update_ratio']:.2f}x), "
                f"down {run['download_bytes_per_update']:,.0f} B/update "
                f"({run['download_bytes_per_update_ratio']:.2f}x), "
                f"{run['wall_s_per_version']:.3f} wall s a version ({run['wall_s_per_version_ratio']:.2f}x)"
            )
    rows = overhead(int(task.initial.numel()), args.seed, args.max_complete)
    print(
        _table(
            rows,
            ["setting", "neighbours", "bytes_per_update", "bytes_ratio", "protocol_s", "time_ratio", "group_cpu_s"],
            {
                "bytes_per_update": lambda v: f"{v:,.0f}",
                "bytes_ratio": lambda v: f"{v:.2f}x",
                "protocol_s": lambda v: f"{v:.3f}",
                "time_ratio": lambda v: f"{v:.2f}x",
                "group_cpu_s": lambda v: f"{v:.2f}",
            },
        )
    )
    settings = {
        "versions": args.versions,
        "seed": args.seed,
        "max_complete": args.max_complete,
        "federation_versions": args.federation_versions,
        "remote_versions": args.remote_versions,
        "remote_sizes": list(args.remote_sizes),
        "remote_rounds": list(args.remote_rounds),
        "remote_neighbours": {"above": REMOTE_COMPLETE, "neighbours": REMOTE_NEIGHBOURS},
        "model_params": int(task.initial.numel()),
        "link": {
            "upload_bytes_per_s": LINK.upload_bytes_per_s,
            "download_bytes_per_s": LINK.download_bytes_per_s,
            "latency_s": LINK.latency_s,
        },
    }
    figures = {"accuracy": accuracy, "federation": runs, "remote": remote_runs, "overhead": rows}
    headline = _headline(accuracy, rows, runs)
    store("secagg", described, settings=settings, headline=headline, figures=figures, out=args.out)


def _headline(
    accuracy: dict[str, dict[str, dict[str, Any]]],
    rows: list[dict[str, Any]],
    runs: dict[str, dict[str, dict[str, Any]]],
) -> list[Figure]:
    """Secure accuracy against plain for each server (the model and the flasync federations); the largest SecAgg+
    group's bytes and seconds per update."""
    figures = [
        Figure(
            f"flasync {server} accuracy, secure",
            variants["secure"]["accuracy"],
            "accuracy",
            "the plain run",
            variants["secure"]["accuracy"] / variants["plain"]["accuracy"],
        )
        for server, variants in runs.items()
    ]
    figures += [
        Figure(
            f"{mode} accuracy, secure (5% dropout)",
            runs["secure"]["accuracy"],
            "accuracy",
            "plain float32 sums",
            runs["secure"]["accuracy"] / runs["plain"]["accuracy"],
        )
        for mode, runs in accuracy.items()
    ]
    for row in rows:
        if row["setting"] == "fedbuff K=100" and row["neighbours"] == 16:
            label = f"{row['setting']}, {row['neighbours']} neighbours"
            figures.append(
                Figure(
                    f"protocol bytes per update, {label}",
                    row["bytes_per_update"],
                    "bytes",
                    "plain float32 upload",
                    row["bytes_ratio"],
                )
            )
            figures.append(
                Figure(
                    f"simulated protocol s per update, {label}",
                    row["protocol_s"],
                    "s",
                    "plain upload",
                    row["time_ratio"],
                )
            )
    return figures


if __name__ == "__main__":
    main()
