"""One percentile definition for every summary flasync writes (profiles, diagnostics)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile"]


def percentile(ordered: Sequence[float], p: float) -> float:
    """Return the ``p``-quantile of sorted values by linear interpolation between closest ranks.

    This is NumPy's default (``method="linear"``): position ``p (n - 1)`` in the sorted values, interpolated between
    its neighbours.

    Args:
        ordered: Values sorted ascending, at least one.
        p: The quantile, in ``[0, 1]``.

    Raises:
        ValueError: If ``ordered`` is empty or ``p`` is outside ``[0, 1]``.
    """
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    last = len(ordered) - 1
    position = p * last
    low = math.floor(position)
    high = min(low + 1, last)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
