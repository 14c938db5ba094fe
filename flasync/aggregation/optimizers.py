"""Server optimizers: a step on the flat global weights, fed the aggregated pseudo-gradient.

The server treats the aggregated client delta ``g = sum_k p_k * (w_base - w_local_k)`` as a gradient and takes an
optimizer step on the flat global weights, in place (Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
Algorithm 1). SGD with ``lr = 1`` and no momentum gives ``w - g``, which is FedAvg exactly; FedBuff (Nguyen et al.,
"Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1) takes SGD steps with a
server learning rate ``eta_g`` on the buffered aggregate; FedAdam is Adam on the same pseudo-gradient.

`ServerOptimizer.sgd` and `ServerOptimizer.adam` are written here as tensor arithmetic on the one flat tensor, with
the operations of ``torch.optim.SGD`` and ``torch.optim.Adam`` (their single-tensor code paths, so the results are
the same bits on the CPU). Building a ``torch.optim`` optimizer imports ``torch._dynamo``, over two seconds of a run's
start-up; these do not. `TorchServerOptimizer` still steps any ``torch.optim`` optimizer a caller builds.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor

__all__ = ["FlatAdam", "FlatAdaptive", "FlatSGD", "ServerOptimizer", "TorchServerOptimizer"]


class ServerOptimizer(ABC):
    """Steps flat global weights in place with a pseudo-gradient.

    Build one with `sgd`, `adam`, `adagrad` or `yogi`, or wrap a ``torch.optim`` optimizer in a `TorchServerOptimizer`.

    Args:
        weights: The global model, a flat (1-D) floating-point leaf tensor; updated in place by `step`.

    Raises:
        ValueError: If ``weights`` is not a flat floating-point leaf tensor.
    """

    def __init__(self, weights: Tensor) -> None:
        if weights.dim() != 1:
            raise ValueError(f"weights must be flat (1-D), got shape {tuple(weights.shape)}")
        if not weights.is_floating_point():
            raise ValueError(f"weights must be floating point, got dtype {weights.dtype}")
        if not weights.is_leaf:
            raise ValueError("weights must be a leaf tensor (detach it from the autograd graph)")
        self._weights = weights

    @classmethod
    def sgd(cls, weights: Tensor, *, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False) -> FlatSGD:
        """Build a server SGD optimizer: ``w <- w - lr * g`` without momentum (see `FlatSGD`)."""
        return FlatSGD(weights, lr=lr, momentum=momentum, nesterov=nesterov)

    @classmethod
    def adam(
        cls,
        weights: Tensor,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> FlatAdam:
        """Build a server Adam optimizer, FedAdam (see `FlatAdam`)."""
        return FlatAdam(weights, lr=lr, betas=betas, eps=eps)

    @classmethod
    def adagrad(cls, weights: Tensor, *, lr: float = 0.01, beta1: float = 0.9, tau: float = 1e-3) -> FlatAdaptive:
        """Build FedAdagrad (see `FlatAdaptive`)."""
        return FlatAdaptive(weights, rule="adagrad", lr=lr, beta1=beta1, tau=tau)

    @classmethod
    def yogi(
        cls, weights: Tensor, *, lr: float = 0.01, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3
    ) -> FlatAdaptive:
        """Build FedYogi (see `FlatAdaptive`)."""
        return FlatAdaptive(weights, rule="yogi", lr=lr, beta1=beta1, beta2=beta2, tau=tau)

    @property
    def weights(self) -> Tensor:
        """The global flat weights this optimizer updates in place."""
        return self._weights

    @property
    @abstractmethod
    def state_nbytes(self) -> int:
        """Size of the optimizer's state tensors (momentum, moments), in bytes."""

    def step(self, pseudo_gradient: Tensor) -> None:
        """Take one optimizer step on ``weights`` with ``pseudo_gradient`` as the gradient, in place.

        For plain SGD this is ``w <- w - lr * pseudo_gradient``.

        Args:
            pseudo_gradient: The aggregated delta ``w_base - w_local`` (e.g. `UpdateBuffer.pseudo_gradient`),
                of the shape, dtype and device of ``weights``. It is read, not changed, and not kept after the step.

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
        if pseudo_gradient.requires_grad or self._weights.requires_grad:
            with torch.no_grad():
                self._update(pseudo_gradient.detach())
        else:  # nothing to keep out of a graph: autograd records no operation on these tensors
            self._update(pseudo_gradient)

    @abstractmethod
    def _update(self, gradient: Tensor) -> None:
        """Apply one step (validated ``gradient``, under ``no_grad``)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Return a snapshot of the optimizer state for a checkpoint (tensors copied; weights not included)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the optimizer state from a `state_dict` snapshot.

        Raises:
            ValueError: If ``state`` is not a snapshot of this kind of optimizer over weights of this size.
        """


def _check_hyperparameter(name: str, value: float, low: float, high: float | None = None) -> None:
    if not low <= value or (high is not None and not value < high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _state_tensor(state: dict[str, Any], key: str, like: Tensor) -> Tensor | None:
    """Return ``state[key]`` (None or a tensor of ``like``'s size) copied onto ``like``'s device and dtype."""
    value = state.get(key)
    if value is None:
        return None
    if not isinstance(value, Tensor) or value.shape != like.shape:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"optimizer state {key!r} is {shape}, expected a tensor of shape {tuple(like.shape)}")
    return value.detach().to(device=like.device, dtype=like.dtype, copy=True)


class FlatSGD(ServerOptimizer):
    """SGD on flat weights, with optional heavy-ball or Nesterov momentum.

    ``lr = 1`` and ``momentum = 0`` give FedAvg exactly (``w - mean_delta``); FedBuff's server learning rate
    ``eta_g`` (Nguyen et al., AISTATS 2022) is ``lr``. With momentum ``mu`` this is torch's heavy ball:
    ``b <- mu * b + g`` (``b = g`` on the first step), ``w <- w - lr * b``; with ``nesterov`` the step uses
    ``g + mu * b`` instead (FedAvgM: Hsu et al., 2019, arXiv:1909.06335). The same operations as
    ``torch.optim.SGD`` (dampening 0, no weight decay).

    Args:
        weights: The global model, a flat floating-point leaf tensor.
        lr: Server learning rate, >= 0.
        momentum: Momentum factor, >= 0.
        nesterov: Whether to use Nesterov momentum (needs ``momentum > 0``).

    Raises:
        ValueError: If a hyperparameter is out of range or ``weights`` is invalid.
    """

    def __init__(self, weights: Tensor, *, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(weights)
        _check_hyperparameter("lr", lr, 0.0)
        _check_hyperparameter("momentum", momentum, 0.0)
        if nesterov and momentum <= 0:
            raise ValueError("nesterov momentum needs momentum > 0")
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), nesterov
        self._buffer: Tensor | None = None

    @property
    def state_nbytes(self) -> int:
        """Size of the momentum buffer (0 without momentum or before the first step), in bytes."""
        return 0 if self._buffer is None else self._buffer.numel() * self._buffer.element_size()

    def _update(self, gradient: Tensor) -> None:
        step = gradient
        if self.momentum != 0:
            if self._buffer is None:
                self._buffer = gradient.clone()
            else:
                self._buffer.mul_(self.momentum).add_(gradient)
            step = gradient.add(self._buffer, alpha=self.momentum) if self.nesterov else self._buffer
        self._weights.add_(step, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        """Return the hyperparameters and the momentum buffer (copied; None before the first step)."""
        buffer = None if self._buffer is None else self._buffer.clone()
        return {"kind": "sgd", "lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov, "buffer": buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore hyperparameters and momentum buffer from `state_dict`."""
        if state.get("kind") != "sgd":
            raise ValueError(f"not an SGD optimizer state: kind {state.get('kind')!r}")
        self.lr, self.momentum, self.nesterov = float(state["lr"]), float(state["momentum"]), bool(state["nesterov"])
        self._buffer = _state_tensor(state, "buffer", self._weights)


class _MomentOptimizer(ServerOptimizer):
    """A server optimizer with a first and a second moment of the pseudo-gradient (Adam and its relatives)."""

    def __init__(self, weights: Tensor) -> None:
        super().__init__(weights)
        self.steps = 0
        self._m: Tensor | None = None
        self._v: Tensor | None = None

    @property
    def state_nbytes(self) -> int:
        """Size of the two moments (0 before the first step), in bytes."""
        return sum(t.numel() * t.element_size() for t in (self._m, self._v) if t is not None)

    def _moments_state(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "m": None if self._m is None else self._m.clone(),
            "v": None if self._v is None else self._v.clone(),
        }

    def _load_moments(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self._m = _state_tensor(state, "m", self._weights)
        self._v = _state_tensor(state, "v", self._weights)


class FlatAdam(_MomentOptimizer):
    """Adam on flat weights (FedAdam).

    Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2 (FedAdam)::

        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g**2
        w <- w - lr * m / (sqrt(v) + eps)

    where ``eps`` is the paper's adaptivity ``tau``. Like ``torch.optim.Adam`` (whose operations this repeats), the
    step also applies Adam's bias correction: ``w <- w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) +
    eps)`` at step ``t``; the paper omits it, and the difference fades after the first ``~1 / (1 - beta2)`` steps.
    The paper tunes ``lr`` and ``eps`` (its ``tau``, around ``1e-3``) per task and uses ``betas = (0.9, 0.99)``;
    the defaults here are torch's.

    Args:
        weights: The global model, a flat floating-point leaf tensor.
        lr: Server learning rate, >= 0.
        betas: Decay rates ``(beta1, beta2)`` of the first and second moments, each in ``[0, 1)``.
        eps: Term added to the denominator, >= 0.

    Raises:
        ValueError: If a hyperparameter is out of range or ``weights`` is invalid.
    """

    def __init__(
        self,
        weights: Tensor,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        super().__init__(weights)
        _check_hyperparameter("lr", lr, 0.0)
        _check_hyperparameter("eps", eps, 0.0)
        _check_hyperparameter("beta1", betas[0], 0.0, 1.0)
        _check_hyperparameter("beta2", betas[1], 0.0, 1.0)
        self.lr, self.beta1, self.beta2, self.eps = float(lr), float(betas[0]), float(betas[1]), float(eps)

    def _update(self, gradient: Tensor) -> None:
        if self._m is None or self._v is None:
            self._m, self._v = torch.zeros_like(gradient), torch.zeros_like(gradient)
        self.steps += 1
        self._m.lerp_(gradient, 1 - self.beta1)
        self._v.mul_(self.beta2).addcmul_(gradient, gradient, value=1 - self.beta2)
        t = float(self.steps)
        step_size = self.lr / (1 - self.beta1**t)
        denominator = (self._v.sqrt() / (1 - self.beta2**t) ** 0.5).add_(self.eps)
        self._weights.addcdiv_(self._m, denominator, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        """Return the hyperparameters, the step count and both moments (copied; None before the first step)."""
        return {
            "kind": "adam",
            "lr": self.lr,
            "betas": (self.beta1, self.beta2),
            "eps": self.eps,
            **self._moments_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore hyperparameters, step count and moments from `state_dict`."""
        if state.get("kind") != "adam":
            raise ValueError(f"not an Adam optimizer state: kind {state.get('kind')!r}")
        self.lr, self.eps = float(state["lr"]), float(state["eps"])
        self.beta1, self.beta2 = (float(b) for b in state["betas"])
        self._load_moments(state)


class FlatAdaptive(_MomentOptimizer):
    """FedAdagrad and FedYogi on flat weights, as the paper writes them.

    Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2, with ``g`` the pseudo-gradient (the
    paper's ``-Delta_t``)::

        m <- beta1 * m + (1 - beta1) * g
        Adagrad: v <- v + g**2
        Yogi:    v <- v - (1 - beta2) * g**2 * sign(v - g**2)
        w <- w - lr * m / (sqrt(v) + tau)

    with ``m`` starting at 0 and ``v`` at ``tau**2`` (the paper asks ``v_{-1} >= tau**2``), and no bias correction.
    ``tau`` is the adaptivity: small values let coordinates with small second moments take large steps. (FedAdam is
    `FlatAdam`, whose ``eps`` is this ``tau``.)

    Args:
        weights: The global model, a flat floating-point leaf tensor.
        rule: ``adagrad`` or ``yogi``.
        lr: Server learning rate ``eta``, >= 0.
        beta1: First-moment decay, in ``[0, 1)`` (the paper uses 0.9; 0 gives plain Adagrad).
        beta2: Yogi's second-moment rate, in ``[0, 1)`` (0.99 in the paper; unused by Adagrad).
        tau: Adaptivity, > 0.

    Raises:
        ValueError: If a hyperparameter is out of range or ``weights`` is invalid.
    """

    def __init__(
        self,
        weights: Tensor,
        *,
        rule: str,
        lr: float = 0.01,
        beta1: float = 0.9,
        beta2: float = 0.99,
        tau: float = 1e-3,
    ) -> None:
        super().__init__(weights)
        if rule not in ("adagrad", "yogi"):
            raise ValueError(f"rule must be 'adagrad' or 'yogi', got {rule!r}")
        _check_hyperparameter("lr", lr, 0.0)
        _check_hyperparameter("beta1", beta1, 0.0, 1.0)
        _check_hyperparameter("beta2", beta2, 0.0, 1.0)
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.rule = rule
        self.lr, self.beta1, self.beta2, self.tau = float(lr), float(beta1), float(beta2), float(tau)

    def _update(self, gradient: Tensor) -> None:
        if self._m is None or self._v is None:
            self._m = torch.zeros_like(gradient)
            self._v = torch.full_like(gradient, self.tau**2)
        self.steps += 1
        self._m.mul_(self.beta1).add_(gradient, alpha=1 - self.beta1)
        squared = gradient * gradient
        if self.rule == "adagrad":
            self._v.add_(squared)
        else:
            self._v.sub_(squared * torch.sign(self._v - squared), alpha=1 - self.beta2)
        self._weights.addcdiv_(self._m, self._v.sqrt().add_(self.tau), value=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        """Return the rule, hyperparameters, step count and both moments (copied; None before the first step)."""
        return {
            "kind": self.rule,
            "lr": self.lr,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "tau": self.tau,
            **self._moments_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore hyperparameters, step count and moments from `state_dict`."""
        if state.get("kind") != self.rule:
            raise ValueError(f"not a {self.rule} optimizer state: kind {state.get('kind')!r}")
        self.lr, self.beta1, self.beta2, self.tau = (float(state[k]) for k in ("lr", "beta1", "beta2", "tau"))
        self._load_moments(state)


class TorchServerOptimizer(ServerOptimizer):
    """Steps any ``torch.optim`` optimizer built over exactly ``weights``.

    ``weights`` may have ``requires_grad=False``: the pseudo-gradient is attached as ``weights.grad`` for the length
    of one step only.

    Args:
        weights: The global model, a flat floating-point leaf tensor.
        optimizer: A torch optimizer whose parameter groups hold ``weights`` and nothing else.

    Raises:
        ValueError: If ``weights`` is invalid, or ``optimizer`` optimizes anything other than ``weights`` alone.
    """

    def __init__(self, weights: Tensor, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(weights)
        params = [param for group in optimizer.param_groups for param in group["params"]]
        if len(params) != 1 or params[0] is not weights:
            held = "another tensor" if len(params) == 1 else f"{len(params)} tensors"
            raise ValueError(f"optimizer must optimize exactly `weights` and nothing else, but it holds {held}")
        self._optimizer = optimizer

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

    def _update(self, gradient: Tensor) -> None:
        self._weights.grad = gradient
        try:
            self._optimizer.step()
        finally:
            self._weights.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Return the torch optimizer's state dict, deep-copied (later steps do not change it)."""
        return copy.deepcopy(self._optimizer.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the torch optimizer's state (torch raises ValueError on a mismatch)."""
        self._optimizer.load_state_dict(state)
