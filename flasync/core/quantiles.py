"""One percentile definition for every summary flasync writes (profiles, diagnostics), and bounded keepers for
runs too long to keep every value: :class:`StreamSummary` (quantiles of a stream) and :class:`Thinned` (a series).
"""

from __future__ import annotations

import itertools
import math
import operator
import random
from collections.abc import Mapping, Sequence
from functools import reduce
from typing import Generic, TypeVar

__all__ = ["StreamSummary", "Thinned", "add_columns", "counted_percentile", "percentile"]

T = TypeVar("T")


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


def counted_percentile(counts: Mapping[int, int], p: float) -> float:
    """Return :func:`percentile` of integers given as ``value -> count`` (a histogram), without expanding it.

    Raises:
        ValueError: If there are no counts or ``p`` is outside ``[0, 1]``.
    """
    total = sum(counts.values())
    if total <= 0:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p}")
    position = p * (total - 1)
    low, high = math.floor(position), min(math.floor(position) + 1, total - 1)
    found: dict[int, float] = {}
    seen = 0
    for value in sorted(counts):
        following = seen + counts[value]
        for rank in (low, high):
            if seen <= rank < following:
                found[rank] = float(value)
        seen = following
    return found[low] + (found[high] - found[low]) * (position - low)


class StreamSummary:
    """Count, mean and max of a stream of values, exactly, and its quantiles from a bounded uniform sample.

    The first ``capacity`` values are all kept, so quantiles are exact up to that many; after that each new value
    replaces a kept one with probability ``capacity / count`` (reservoir sampling, Vitter's algorithm R), so the kept
    values stay a uniform sample of the whole stream and memory stays ``capacity`` floats however long the run.

    Args:
        capacity: How many values to keep, at least 1.
        rng: The sampler's random generator (a seeded one makes the summary reproducible).
    """

    __slots__ = ("_capacity", "_rng", "_sample", "count", "max", "total")

    def __init__(self, capacity: int, rng: random.Random) -> None:
        """Start empty."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._rng = rng
        self._sample: list[float] = []
        self.count = 0
        self.total = 0.0
        self.max = -math.inf

    def add(self, value: float) -> None:
        """Take one value."""
        count = self.count = self.count + 1
        self.total += value
        if value > self.max:  # as max(): a NaN never replaces the maximum
            self.max = value
        if count <= self._capacity:
            self._sample.append(value)
            return
        slot = self._rng.randrange(count)
        if slot < self._capacity:
            self._sample[slot] = value

    def add_many(self, values: Sequence[float]) -> None:
        """Take ``values`` in order: the same state, and the same draws from the generator, as :meth:`add` of each."""
        add_columns((self,), (values,))

    def quantile(self, p: float) -> float:
        """The ``p``-quantile of the kept values (:func:`percentile`; NaN when empty)."""
        return percentile(sorted(self._sample), p) if self._sample else math.nan

    @property
    def sample(self) -> list[float]:
        """The kept values (every value while ``count <= capacity``), in no particular order."""
        return list(self._sample)

    def summary(self) -> dict[str, float] | None:
        """Return ``p50``, ``p90``, ``max``, ``mean`` and ``count`` (None when empty); max, mean and count are exact."""
        if not self.count:
            return None
        ordered = sorted(self._sample)
        return {
            "p50": percentile(ordered, 0.5),
            "p90": percentile(ordered, 0.9),
            "max": self.max,
            "mean": self.total / self.count,
            "count": float(self.count),
        }


def add_columns(summaries: Sequence[StreamSummary], columns: Sequence[Sequence[float]]) -> None:
    """Give each summary its column, row by row: the state of ``summaries[j].add(columns[j][i])`` for each row ``i``
    and, within a row, each ``j`` in turn.

    Several summaries may share one generator; their draws are made in that same interleaved order, so the kept
    samples are exactly those of the calls one at a time. Counts, totals and maxima are folded a column at a time
    (each total is still added value by value, in order).

    Args:
        summaries: The summaries, each at most once.
        columns: One sequence of values per summary, all of one length.

    Raises:
        ValueError: If the columns do not match the summaries or differ in length.
    """
    if len(columns) != len(summaries):
        raise ValueError(f"{len(summaries)} summaries need as many columns, got {len(columns)}")
    if len(set(map(len, columns))) > 1:
        raise ValueError("every column must have one length")
    rows = len(columns[0]) if columns else 0
    if not rows:
        return
    first = summaries[0]
    count, capacity = first.count, first._capacity
    for summary in summaries:
        if summary.count != count or summary._capacity != capacity or type(summary._rng) is not random.Random:
            for row in range(rows):
                for each, column in zip(summaries, columns, strict=True):
                    each.add(column[row])
            return
    free = max(0, min(capacity - count, rows))  # the rows every summary keeps without a draw
    for summary, column in zip(summaries, columns, strict=True):
        summary.count = count + rows
        summary.total = reduce(operator.add, column, summary.total)
        # As add(): a value replaces the maximum only when greater (so a NaN never does).
        summary.max = max(itertools.chain((summary.max,), column))
        summary._sample.extend(column[:free])
    lanes = [(s._rng.getrandbits, s._sample, column) for s, column in zip(summaries, columns, strict=True)]
    seen = count + free
    bits = (seen + 1).bit_length()  # of the next row's count; it grows by one bit when the count reaches ``top``
    top = 1 << bits
    for row in range(free, rows):
        seen += 1
        if seen == top:
            bits += 1
            top <<= 1
        # random.Random.randrange(seen), inlined: the same draws from the same generator, row by row.
        for getrandbits, sample, column in lanes:
            slot = getrandbits(bits)
            while slot >= seen:
                slot = getrandbits(bits)
            if slot < capacity:
                sample[slot] = column[row]


class Thinned(Generic[T]):
    """At most ``capacity`` items of a stream, evenly spaced, and always the latest.

    Every item is kept until ``capacity`` are; then every second kept item is dropped and from then on only every
    second arriving item is kept (every fourth after the next halving, and so on).

    Args:
        capacity: The most items kept (at least 2).
    """

    def __init__(self, capacity: int = 1024) -> None:
        """Start empty."""
        if capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {capacity}")
        self.capacity = capacity
        self._items: list[T] = []
        self._stride = 1
        self._seen = 0
        self._latest: T | None = None

    def add(self, item: T) -> None:
        """Offer one item."""
        self._latest = item
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        self._items.append(item)
        if len(self._items) >= self.capacity:
            self._items = self._items[::2]
            self._stride *= 2

    def add_many(self, items: Sequence[T]) -> None:
        """Offer ``items`` in order: the same state as :meth:`add` of each."""
        start, end = 0, len(items)
        while start < end:
            stride, kept = self._stride, self._items
            # Item ``i`` is the (seen + i - start + 1)-th offered: kept when (seen + i - start) is a multiple of stride.
            first = start + (-self._seen) % stride
            taken = items[first:end:stride][: self.capacity - len(kept)]
            kept.extend(taken)
            if len(kept) < self.capacity:
                self._seen += end - start
                break
            last = first + (len(taken) - 1) * stride
            self._seen += last - start + 1
            self._items = kept[::2]
            self._stride *= 2
            start = last + 1
        if end:
            self._latest = items[-1]

    def items(self) -> list[T]:
        """The kept items in arrival order, ending with the latest."""
        if self._latest is not None and (not self._items or self._items[-1] is not self._latest):
            return [*self._items, self._latest]
        return list(self._items)
