"""Your own strategy: Multi-Krum on the server and focal loss on the clients, through the Python API.

    python examples/custom_strategy.py                      # a temporary MLflow store
    python examples/custom_strategy.py --store sqlite:///mlruns/mlflow.db

Neither method ships with flasync. The server rule satisfies :class:`flasync.Aggregator` and the client loss
:class:`flasync.LocalObjective`; ``config.server`` (FedAvg rounds here) still decides when a version is made. A fifth
of the clients flip the sign of their updates: plain FedAvg ends near chance, Multi-Krum leaves them out. Same seed,
same weights, bit for bit.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

import flasync


class MultiKrum:
    """Multi-Krum (Blanchard et al., NeurIPS 2017, sec. 4): average the ``m`` updates closest to their neighbours.

    An update's score is ``sum ||delta_i - delta_j||^2`` over its ``n - f - 2`` nearest other updates; the ``m``
    lowest-scored are averaged and the weights step by ``-lr`` times that mean (``m = 1`` is Krum).

    Args:
        weights: The global flat weights, stepped in place.
        byzantine: ``f``, the attackers tolerated; needs ``n > 2 f + 2`` updates per step.
        selected: ``m``.
        size: Updates per step (asked by asynchronous policies through :meth:`ready`).
        lr: Server learning rate.
    """

    def __init__(self, weights: torch.Tensor, *, byzantine: int, selected: int, size: int, lr: float) -> None:
        """Start with no updates."""
        self.weights, self.f, self.m, self.size, self.lr = weights, byzantine, selected, size, lr
        self.deltas: list[torch.Tensor] = []

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Keep a copy of the delta (the server reuses its tensor); staleness is not weighted."""
        self.deltas.append(delta.clone())
        return 1.0

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Refuse: Krum compares individual updates, not an edge's sum of them."""
        raise ValueError("Multi-Krum needs client updates, not edge partial aggregates")

    def ready(self) -> bool:
        """Tell whether ``size`` updates are in."""
        return len(self.deltas) >= self.size

    def step(self) -> None:
        """Score the updates, average the ``m`` best, step the weights."""
        deltas = torch.stack(self.deltas)
        n = len(deltas)
        nearest = max(n - self.f - 2, 1)
        distances = torch.cdist(deltas, deltas).square()
        distances.fill_diagonal_(float("inf"))
        scores = distances.sort(dim=1).values[:, :nearest].sum(dim=1)
        chosen = scores.sort(stable=True).indices[: min(self.m, n)]
        self.weights.sub_(deltas[chosen].mean(dim=0), alpha=self.lr)
        self.deltas.clear()

    def count(self) -> int:
        """Count the updates waiting."""
        return len(self.deltas)

    @property
    def nbytes(self) -> int:
        """Bytes of the held updates."""
        return sum(d.numel() * d.element_size() for d in self.deltas)

    def state_dict(self) -> dict[str, Any]:
        """Return the waiting updates (checkpoints hold tensors and plain values only)."""
        return {"deltas": [d.clone() for d in self.deltas]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.deltas = [d.clone() for d in state["deltas"]]


def multi_krum(weights: torch.Tensor, server: Any) -> MultiKrum:
    """Build Multi-Krum for a run of FedAvg rounds (an :data:`flasync.AggregatorFactory`)."""
    return MultiKrum(weights, byzantine=2, selected=4, size=server.clients_per_round, lr=server.optimizer.lr)


class FocalLoss:
    """Focal loss (Lin et al., ICCV 2017, eq. 5): ``FL(p_t) = -(1 - p_t)^gamma log p_t``, per sample."""

    vectorizable = True  # tensor operations only: the vectorized executor may batch it

    def __init__(self, gamma: float = 2.0) -> None:
        """Set the focusing parameter ``gamma`` (0: cross-entropy)."""
        self.gamma = gamma

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the focal loss of each sample ``(B,)``."""
        log_p = outputs.log_softmax(dim=1).gather(1, targets[:, None]).squeeze(1)
        return -((1.0 - log_p.exp()) ** self.gamma) * log_p


def main() -> None:
    """Run a federation with Multi-Krum and focal loss, tracked in MLflow, and print its accuracy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", help="MLflow tracking URI (default: a temporary SQLite store)")
    parser.add_argument("--versions", type=int, default=30, help="model versions (FedAvg rounds)")
    parser.add_argument("--clients", type=int, default=50, help="clients in the population")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        store = args.store or f"sqlite:///{scratch}/mlflow.db"
        config = flasync.load_config(
            None,
            [
                f"population.num_clients={args.clients}",
                "server.kind=fedavg",
                "server.clients_per_round=10",
                "faults.byzantine=0.2",
                f"stop.max_versions={args.versions}",
                f"eval.every_versions={max(args.versions // 3, 1)}",
                f"tracking.uri={store}",
                "tracking.experiment=custom-strategy",
                "tracking.log_model=false",
            ],
        )
        summary = flasync.run(config, aggregator=multi_krum, objective=FocalLoss(gamma=2.0))
        where = store if args.store else "a temporary store"
        print(f"accuracy {summary.accuracy:.3f} after {summary.versions} versions, run {summary.run_id} in {where}")


if __name__ == "__main__":
    main()
