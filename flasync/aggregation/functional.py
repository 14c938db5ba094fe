"""Aggregation rules as free functions over flat tensors: FedAvg, FedBuff and FedAsync.

Every model state and every update is one flat tensor. A client's update is its delta
``delta_k = w_base - w_local`` (a pseudo-gradient: it points uphill, so a server step *subtracts* it). The
functions here never stack their inputs into a ``K x N`` matrix: they add each one, scaled, into a single
preallocated output, so the extra memory is one model, whatever ``K`` is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from flasync.aggregation.staleness import StalenessWeight

__all__ = [
    "fedasync_mix_",
    "fedavg",
    "fedbuff",
    "normalized",
    "weighted_mean",
]


def normalized(weights: Sequence[float]) -> list[float]:
    """Divide non-negative weights by their sum, so that they sum to one.

    Args:
        weights: One finite, non-negative weight per item; at least one must be positive.

    Returns:
        ``[w / sum(weights) for w in weights]``.

    Raises:
        ValueError: If ``weights`` is empty, holds a negative or non-finite value, or sums to zero.
    """
    if len(weights) == 0:
        raise ValueError("weights is empty; need at least one weight")
    for index, weight in enumerate(weights):
        if not math.isfinite(weight):
            raise ValueError(f"weights[{index}] is {weight}; weights must be finite")
        if weight < 0:
            raise ValueError(f"weights[{index}] is {weight}; weights must be >= 0")
    total = math.fsum(weights)
    if total == 0:
        raise ValueError("weights sum to zero; at least one weight must be positive")
    return [weight / total for weight in weights]


def _check_like(tensors: Sequence[Tensor], name: str) -> None:
    if len(tensors) == 0:
        raise ValueError(f"{name} is empty; need at least one tensor")
    first = tensors[0]
    for index, tensor in enumerate(tensors[1:], start=1):
        if tensor.shape != first.shape:
            raise ValueError(
                f"{name}[{index}] has shape {tuple(tensor.shape)}, expected {tuple(first.shape)} like {name}[0]"
            )
        if tensor.dtype != first.dtype:
            raise ValueError(f"{name}[{index}] has dtype {tensor.dtype}, expected {first.dtype} like {name}[0]")


def _check_lengths(first: Sequence[object], first_name: str, second: Sequence[object], second_name: str) -> None:
    if len(first) != len(second):
        raise ValueError(f"{first_name} has {len(first)} items but {second_name} has {len(second)}; need one per item")


def _combine(tensors: Sequence[Tensor], coefficients: Sequence[float]) -> Tensor:
    """Return ``sum_k coefficients[k] * tensors[k]``, accumulated into one new tensor."""
    out = torch.zeros_like(tensors[0])
    for tensor, coefficient in zip(tensors, coefficients, strict=True):
        out.add_(tensor, alpha=coefficient)
    return out


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """Return the weighted mean ``sum_k (w_k / sum_j w_j) * t_k`` of same-shaped tensors.

    The sum is accumulated in place into one preallocated output (no stacking), so the extra memory is one
    tensor.

    Args:
        tensors: ``K >= 1`` tensors of one shape and dtype.
        weights: ``K`` finite, non-negative weights, not all zero; they need not sum to one.

    Returns:
        A new tensor of the shape and dtype of ``tensors[0]``.

    Raises:
        ValueError: If the lengths differ, the tensors differ in shape or dtype, or the weights are invalid
            (see `normalized`).
    """
    _check_lengths(tensors, "tensors", weights, "weights")
    _check_like(tensors, "tensors")
    return _combine(tensors, normalized(weights))


def fedavg(deltas: Sequence[Tensor], num_samples: Sequence[int]) -> Tensor:
    """Average client deltas weighted by their number of training samples (FedAvg).

    McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data", AISTATS 2017,
    Algorithm 1: ``delta = sum_k (n_k / n) * delta_k`` with ``n = sum_k n_k``. The server then applies
    ``w <- w - delta`` (a server SGD step with learning rate 1).

    Args:
        deltas: ``K >= 1`` flat client deltas ``w_base - w_local`` of one shape and dtype.
        num_samples: ``K`` sample counts ``n_k >= 0``, not all zero.

    Returns:
        The sample-weighted mean delta, a new tensor.

    Raises:
        ValueError: If the lengths differ, the deltas differ in shape or dtype, or a count is negative or all
            are zero.
    """
    _check_lengths(deltas, "deltas", num_samples, "num_samples")
    for index, count in enumerate(num_samples):
        if count < 0:
            raise ValueError(f"num_samples[{index}] is {count}; sample counts must be >= 0")
    return weighted_mean(deltas, [float(count) for count in num_samples])


def fedbuff(
    deltas: Sequence[Tensor],
    staleness: Sequence[int],
    example_weights: Sequence[float],
    staleness_weight: StalenessWeight,
) -> Tensor:
    """Combine a buffer of client deltas with example and staleness weights (FedBuff).

    Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022, Algorithm 1::

        delta = sum_k (e_k / sum_j e_j) * s(tau_k) * delta_k

    The normalised example weights sum to one and the staleness weight only discounts: stale updates shrink
    the step, they do not hand their share to fresh ones. With equal example weights this is the paper's
    ``(1 / K) * sum_k s(tau_k) * delta_k``, and FLSim's. With sample-count example weights it is not FLSim's:
    flasync divides by the buffer's actual total ``sum_j e_j``, FLSim by a constant set in advance, so the two
    differ whenever the buffer's total differs from that constant. The server then applies
    ``w <- w - eta_g * delta``.

    `UpdateBuffer` computes the same value incrementally, one update at a time.

    Args:
        deltas: ``K >= 1`` flat client deltas ``w_base - w_local`` of one shape and dtype.
        staleness: ``K`` staleness values ``tau_k >= 0``, in model versions.
        example_weights: ``K`` finite weights ``e_k >= 0`` (e.g. sample counts), not all zero.
        staleness_weight: The discount ``s(tau)``, e.g. `PolynomialStaleness`.

    Returns:
        The weighted delta, a new tensor.

    Raises:
        ValueError: If the lengths differ, the deltas differ in shape or dtype, an example weight is invalid,
            a staleness is negative, or ``staleness_weight`` returns a negative or non-finite value.
    """
    _check_lengths(deltas, "deltas", staleness, "staleness")
    _check_lengths(deltas, "deltas", example_weights, "example_weights")
    _check_like(deltas, "deltas")
    coefficients = []
    for example_weight, tau in zip(normalized(example_weights), staleness, strict=True):
        discount = staleness_weight(tau)
        if not discount >= 0 or not math.isfinite(discount):
            raise ValueError(f"staleness_weight({tau}) returned {discount}; it must be finite and >= 0")
        coefficients.append(example_weight * discount)
    return _combine(deltas, coefficients)


def fedasync_mix_(weights: Tensor, local: Tensor, alpha: float) -> Tensor:
    """Mix a client's local model into the global weights in place (FedAsync).

    Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", 2019, Algorithm 1::

        w <- (1 - alpha) * w + alpha * w_local

    For the staleness-adaptive variant pass ``alpha = alpha_0 * s(tau)`` with a `StalenessWeight` ``s``.

    Args:
        weights: The global flat weights; overwritten.
        local: The client's trained weights ``w_local`` (not its delta), same shape and dtype as ``weights``.
        alpha: Mixing factor in ``[0, 1]``; 0 keeps ``weights``, 1 replaces them with ``local``.

    Returns:
        ``weights``, updated in place.

    Raises:
        ValueError: If ``alpha`` is outside ``[0, 1]``, or ``local`` differs from ``weights`` in shape or
            dtype.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if local.shape != weights.shape:
        raise ValueError(f"local has shape {tuple(local.shape)}, expected {tuple(weights.shape)} like weights")
    if local.dtype != weights.dtype:
        raise ValueError(f"local has dtype {local.dtype}, expected {weights.dtype} like weights")
    return weights.lerp_(local, alpha)
