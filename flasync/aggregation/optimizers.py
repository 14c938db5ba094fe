"""Server optimizers: a real ``torch.optim`` optimizer fed the aggregated pseudo-gradient.

The server treats the aggregated client delta ``g = sum_k p_k * (w_base - w_local_k)`` as a gradient and steps
a torch optimizer on the flat global weights, in place (Reddi et al., "Adaptive Federated Optimization", ICLR
2021, Algorithm 1). SGD with ``lr = 1`` and no momentum gives ``w - g``, which is FedAvg exactly; FedBuff
(Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1) takes
SGD steps with a server learning rate ``eta_g`` on the buffered aggregate; FedAdam is Adam on the same
pseudo-gradient.
"""

from __future__ import annotations

import copy
from typing import Any, Self

import torch
from torch import Tensor

__all__ = ["ServerOptimizer"]


class ServerOptimizer:
    """Step a torch optimizer on flat global weights with a pseudo-gradient, updating them in place.

    Composition, not inheritance: any ``torch.optim.Optimizer`` built over exactly ``weights`` works, and the
    `sgd` and `adam` constructors cover the usual server optimizers. ``weights`` may have
    ``requires_grad=False``: the pseudo-gradient is attached as ``weights.grad`` for the length of one step
    only.

    Args:
        weights: The global model, a flat (1-D) floating-point leaf tensor; updated in place by `step`.
        optimizer: A torch optimizer whose parameter groups hold ``weights`` and nothing else.

    Raises:
        ValueError: If ``weights`` is not a flat floating-point leaf tensor, or ``optimizer`` optimizes
            anything other than ``weights`` alone.
    """

    __slots__ = ("_optimizer", "_weights")

    def __init__(self, weights: Tensor, optimizer: torch.optim.Optimizer) -> None:
        if weights.dim() != 1:
            raise ValueError(f"weights must be flat (1-D), got shape {tuple(weights.shape)}")
        if not weights.is_floating_point():
            raise ValueError(f"weights must be floating point, got dtype {weights.dtype}")
        if not weights.is_leaf:
            raise ValueError("weights must be a leaf tensor (detach it from the autograd graph)")
        params = [param for group in optimizer.param_groups for param in group["params"]]
        if len(params) != 1 or params[0] is not weights:
            held = "another tensor" if len(params) == 1 else f"{len(params)} tensors"
            raise ValueError(f"optimizer must optimize exactly `weights` and nothing else, but it holds {held}")
        self._weights: Tensor = weights
        self._optimizer: torch.optim.Optimizer = optimizer

    @classmethod
    def sgd(cls, weights: Tensor, *, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False) -> Self:
        """Build a server SGD optimizer: ``w <- w - lr * g`` without momentum.

        ``lr = 1`` and ``momentum = 0`` give FedAvg exactly (``w - mean_delta``); FedBuff's server learning
        rate ``eta_g`` (Nguyen et al., AISTATS 2022) is ``lr``. With momentum ``mu`` this is torch's heavy
        ball: ``b <- mu * b + g`` (``b = g`` on the first step), ``w <- w - lr * b``; with ``nesterov`` the
        step uses ``g + mu * b`` instead (FedAvgM: Hsu et al., 2019, arXiv:1909.06335).

        Args:
            weights: The global model, a flat floating-point leaf tensor.
            lr: Server learning rate, >= 0.
            momentum: Momentum factor, >= 0.
            nesterov: Whether to use Nesterov momentum (needs ``momentum > 0``).

        Returns:
            A server optimizer stepping ``weights`` in place.

        Raises:
            ValueError: If a hyperparameter is out of range or ``weights`` is invalid.
        """
        return cls(weights, torch.optim.SGD([weights], lr=lr, momentum=momentum, nesterov=nesterov))

    @classmethod
    def adam(
        cls,
        weights: Tensor,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> Self:
        """Build a server Adam optimizer (FedAdam).

        Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2 (FedAdam)::

            m <- beta1 * m + (1 - beta1) * g
            v <- beta2 * v + (1 - beta2) * g**2
            w <- w - lr * m / (sqrt(v) + eps)

        where ``eps`` is the paper's adaptivity ``tau``. This is ``torch.optim.Adam``, which also applies
        Adam's bias correction to ``m`` and ``v``; the paper omits it, and the difference fades after the
        first ``~1 / (1 - beta2)`` steps. The paper tunes ``lr`` and ``eps`` (its ``tau``, around ``1e-3``)
        per task and uses ``betas = (0.9, 0.99)``; the defaults here are torch's.

        Args:
            weights: The global model, a flat floating-point leaf tensor.
            lr: Server learning rate, >= 0.
            betas: Decay rates ``(beta1, beta2)`` of the first and second moments, each in ``[0, 1)``.
            eps: Term added to the denominator, >= 0.

        Returns:
            A server optimizer stepping ``weights`` in place.

        Raises:
            ValueError: If a hyperparameter is out of range or ``weights`` is invalid.
        """
        return cls(weights, torch.optim.Adam([weights], lr=lr, betas=betas, eps=eps))

    @property
    def weights(self) -> Tensor:
        """The global flat weights this optimizer updates in place."""
        return self._weights

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped torch optimizer (e.g. to change ``param_groups[0]["lr"]`` on a schedule)."""
        return self._optimizer

    @property
    def state_nbytes(self) -> int:
        """Size of the optimizer's state tensors (momentum, moments, step counters), in bytes."""
        total = 0
        for param_state in self._optimizer.state.values():
            for value in param_state.values():
                if isinstance(value, Tensor):
                    total += value.numel() * value.element_size()
        return total

    def step(self, pseudo_gradient: Tensor) -> None:
        """Take one optimizer step on ``weights`` with ``pseudo_gradient`` as the gradient, in place.

        For plain SGD this is ``w <- w - lr * pseudo_gradient``.

        Args:
            pseudo_gradient: The aggregated delta ``w_base - w_local`` (e.g. `UpdateBuffer.pseudo_gradient`),
                of the shape, dtype and device of ``weights``. The torch optimizers read it without changing
                it, and it is not kept after the step.

        Raises:
            ValueError: If ``pseudo_gradient`` differs from ``weights`` in shape, dtype or device.
        """
        if pseudo_gradient.shape != self._weights.shape:
            raise ValueError(
                f"pseudo_gradient has shape {tuple(pseudo_gradient.shape)}, expected {tuple(self._weights.shape)}"
            )
        if pseudo_gradient.dtype != self._weights.dtype:
            raise ValueError(f"pseudo_gradient has dtype {pseudo_gradient.dtype}, expected {self._weights.dtype}")
        if pseudo_gradient.device != self._weights.device:
            raise ValueError(f"pseudo_gradient is on device {pseudo_gradient.device}, expected {self._weights.device}")
        self._weights.grad = pseudo_gradient.detach()
        try:
            with torch.no_grad():
                self._optimizer.step()
        finally:
            self._weights.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Return a snapshot of the optimizer state (momentum, moments, hyperparameters) for a checkpoint.

        Unlike ``torch.optim.Optimizer.state_dict``, the state tensors are copied, so later steps do not
        change the snapshot. The weights themselves are not included: checkpoint them separately.

        Returns:
            The torch optimizer's state dict, deep-copied.
        """
        return copy.deepcopy(self._optimizer.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizer state from a `state_dict` snapshot.

        Args:
            state: A mapping as returned by `state_dict`, from an optimizer of the same kind over weights of
                the same size.

        Raises:
            ValueError: If ``state`` does not match the optimizer's parameter groups (raised by torch).
        """
        self._optimizer.load_state_dict(state)
