"""Robust aggregation rules for synchronous rounds: coordinate-wise median and trimmed mean.

Both take the ``K`` client deltas of one round (flat tensors of equal shape) and return one delta of that shape.
Unlike the weighted mean they ignore example weights: each client is one vote, so that a few corrupted or malicious
clients with large updates cannot move the aggregate arbitrarily far (Yin et al., "Byzantine-Robust Distributed
Learning: Towards Optimal Statistical Rates", ICML 2018). They stack the deltas into a ``K x N`` matrix: memory is
``K`` models, which a sync round holds anyway.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["coordinate_median", "trimmed_mean"]


def _stack(deltas: Sequence[Tensor]) -> Tensor:
    if len(deltas) == 0:
        raise ValueError("deltas is empty; need at least one update")
    first = deltas[0]
    for index, delta in enumerate(deltas):
        if delta.shape != first.shape or delta.dtype != first.dtype:
            raise ValueError(
                f"deltas[{index}] has shape {tuple(delta.shape)} and dtype {delta.dtype}, "
                f"expected {tuple(first.shape)} and {first.dtype} like deltas[0]"
            )
    return torch.stack(list(deltas))


def coordinate_median(deltas: Sequence[Tensor]) -> Tensor:
    """Return the coordinate-wise median of the deltas (the mean of the two middle values for an even count).

    Raises:
        ValueError: If ``deltas`` is empty or its tensors differ in shape or dtype.
    """
    stacked = _stack(deltas)
    k = stacked.shape[0]
    ordered = stacked.sort(dim=0).values
    if k % 2:
        return ordered[k // 2].clone()
    return 0.5 * (ordered[k // 2 - 1] + ordered[k // 2])


def trimmed_mean(deltas: Sequence[Tensor], trim_fraction: float) -> Tensor:
    """Return the coordinate-wise mean after dropping the ``floor(trim_fraction * K)`` largest and smallest values.

    Args:
        deltas: The round's updates.
        trim_fraction: Share cut at each end, in ``[0, 0.5)``; at least one value per coordinate always remains.

    Raises:
        ValueError: If ``trim_fraction`` is out of range, or ``deltas`` is empty or mixed in shape or dtype.
    """
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    stacked = _stack(deltas)
    k = stacked.shape[0]
    cut = math.floor(trim_fraction * k)
    if cut == 0:
        return stacked.mean(dim=0)
    ordered = stacked.sort(dim=0).values
    return ordered[cut : k - cut].mean(dim=0)
