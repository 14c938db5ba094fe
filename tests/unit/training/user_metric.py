"""A user's evaluation metric, as tests name it in ``eval.metrics``: ``brier=tests.unit.training.user_metric:Brier``."""

from __future__ import annotations

import torch


class Brier:
    """Brier score: mean over samples of the squared distance between the softmax probabilities and the one-hot label.

    Written against the :class:`flasync.training.metrics.Metric` protocol only (no torchmetrics).
    """

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        """Take a batch of logits ``(N, C)`` and labels ``(N,)``."""
        p = preds.softmax(dim=1).double()
        onehot = torch.nn.functional.one_hot(targets, p.shape[1]).double()
        self.total += float(((p - onehot) ** 2).sum())
        self.count += int(targets.numel())

    def compute(self) -> float:
        """Return the mean over every sample seen."""
        return self.total / max(self.count, 1)


class NoCompute:
    """Not a metric: it has no ``compute``."""

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        """Take a batch."""
