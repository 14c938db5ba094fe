"""The loss a task's local training minimises when the caller gives none (``task`` in the run's config).

Classification minimises cross-entropy, which local training computes itself (no objective). Regression minimises
:class:`SquaredError`, a :class:`~flasync.training.local.LocalObjective` like a user's own, so the SGD, momentum,
clipping and FedProx machinery is the same for every task.
"""

from __future__ import annotations

import torch

from flasync.training.local import LocalObjective

__all__ = ["SquaredError", "task_objective"]


class SquaredError:
    """The squared error ``(f(x) - y)^2`` of a model with one output against a real target.

    Its mean over a batch is the mean squared error, the loss a regression's evaluations report.
    """

    vectorizable = True
    """A tensor expression only: ``torch.func.vmap`` can batch it."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Return the per-sample squared errors ``(B,)`` of outputs ``(B, 1)`` against float targets ``(B,)``."""
        return (outputs[:, 0] - targets).square()


def task_objective(task: str, objective: LocalObjective | None) -> LocalObjective | None:
    """Return the loss local training minimises: a caller's ``objective`` if given, else the task's own (None:
    cross-entropy, the classification default)."""
    if objective is not None or task != "regression":
        return objective
    return SquaredError()
