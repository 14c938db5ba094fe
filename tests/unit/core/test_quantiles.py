"""The batch entry points of the streamed keepers give exactly the state of their one-at-a-time calls."""

from __future__ import annotations

import math
import random

import pytest

from flasync.core.quantiles import StreamSummary, Thinned, add_columns


def _state(summary: StreamSummary) -> tuple[object, ...]:
    """Everything a summary keeps, NaN made comparable."""
    return (
        summary.count,
        repr(summary.total),
        repr(summary.max),
        [repr(v) for v in summary.sample],
    )


def _values(rng: random.Random, n: int) -> list[float]:
    """Random values with a few NaNs, infinities and repeats among them."""
    specials = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0]
    return [rng.choice(specials) if rng.random() < 0.05 else rng.gauss(0.0, 10.0) for _ in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_add_many_equals_add_one_at_a_time(seed: int) -> None:
    """add_many in random chunks keeps the same values, totals and maxima, and draws the same random numbers."""
    rng = random.Random(seed)
    capacity = rng.choice([1, 2, 7, 64])
    one, many = StreamSummary(capacity, random.Random(seed)), StreamSummary(capacity, random.Random(seed))
    for _ in range(12):
        chunk = _values(rng, rng.randrange(0, 3 * capacity + 5))
        for value in chunk:
            one.add(value)
        many.add_many(chunk)
        assert _state(many) == _state(one)
        assert many._rng.getstate() == one._rng.getstate()


@pytest.mark.parametrize("seed", range(6))
def test_add_columns_on_a_shared_generator_draws_row_by_row(seed: int) -> None:
    """Summaries sharing a generator, given columns, end as if each row's values were added in turn."""
    rng = random.Random(100 + seed)
    capacity = rng.choice([1, 3, 16, 50])
    shared_one, shared_many = random.Random(seed), random.Random(seed)
    ones = [StreamSummary(capacity, shared_one) for _ in range(5)]
    manys = [StreamSummary(capacity, shared_many) for _ in range(5)]
    for _ in range(8):
        rows = rng.randrange(0, 2 * capacity + 9)
        columns = [_values(rng, rows) for _ in ones]
        for row in range(rows):
            for summary, column in zip(ones, columns, strict=True):
                summary.add(column[row])
        add_columns(manys, columns)
        assert [_state(s) for s in manys] == [_state(s) for s in ones]
        assert shared_many.getstate() == shared_one.getstate()


class _OwnRandom(random.Random):
    """A generator subclass: its draws may not be inlined."""

    def randrange(self, *args: int) -> int:  # type: ignore[override]
        """Draw through the base class, counting nothing extra."""
        return super().randrange(*args)


def test_add_columns_of_unlike_summaries_equals_add_one_at_a_time() -> None:
    """Summaries of different counts, capacities or generator classes still end as with add of each row."""
    rng = random.Random(7)

    def build(gen: random.Random) -> list[StreamSummary]:
        summaries = [StreamSummary(4, gen), StreamSummary(9, _OwnRandom(3)), StreamSummary(4, gen)]
        summaries[0].add(1.0)
        return summaries

    gen_one, gen_many = random.Random(1), random.Random(1)
    ones, manys = build(gen_one), build(gen_many)
    for _ in range(6):
        columns = [_values(rng, 13) for _ in ones]
        for row in range(13):
            for summary, column in zip(ones, columns, strict=True):
                summary.add(column[row])
        add_columns(manys, columns)
        assert [_state(s) for s in manys] == [_state(s) for s in ones]
    assert gen_many.getstate() == gen_one.getstate()


def test_add_columns_refuses_mismatched_columns() -> None:
    """A column missing, or columns of different lengths, is an error and changes nothing."""
    summaries = [StreamSummary(4, random.Random(0)), StreamSummary(4, random.Random(0))]
    with pytest.raises(ValueError, match="as many columns"):
        add_columns(summaries, [[1.0]])
    with pytest.raises(ValueError, match="one length"):
        add_columns(summaries, [[1.0], [1.0, 2.0]])
    assert [s.count for s in summaries] == [0, 0]


@pytest.mark.parametrize("seed", range(8))
def test_thinned_add_many_equals_add_one_at_a_time(seed: int) -> None:
    """Thinned.add_many in random chunks keeps the same items as add of each, through several halvings."""
    rng = random.Random(seed)
    capacity = rng.choice([2, 3, 4, 10])
    one: Thinned[int] = Thinned(capacity)
    many: Thinned[int] = Thinned(capacity)
    offered = 0
    for _ in range(20):
        chunk = list(range(offered, offered + rng.randrange(0, 4 * capacity)))
        offered += len(chunk)
        for item in chunk:
            one.add(item)
        many.add_many(chunk)
        assert many.items() == one.items()
        assert (many._seen, many._stride) == (one._seen, one._stride)
