"""A buffered aggregator's rows: weighed and folded together as each update would be alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flasync.aggregation import (
    BufferedAggregator,
    EqualExampleWeight,
    FlatSGD,
    HingeStaleness,
    PolynomialStaleness,
    SampleExampleWeight,
)


def _aggregator(sample_weighted: bool) -> BufferedAggregator:
    weights = torch.zeros(5)
    return BufferedAggregator(
        weights,
        size=100,
        optimizer=FlatSGD(weights),
        staleness=HingeStaleness(a=0.5, b=1) if sample_weighted else PolynomialStaleness(),
        example_weight=SampleExampleWeight() if sample_weighted else EqualExampleWeight(),
    )


@given(
    seed=st.integers(0, 2**31 - 1),
    staleness=st.lists(st.integers(0, 6), max_size=10),
    sample_weighted=st.booleans(),
)
def test_rows_weighed_and_folded_together_equal_adding_each_update(
    seed: int, staleness: list[int], sample_weighted: bool
) -> None:
    """The weights :meth:`weigh` gives are those :meth:`add` gives each update, and folding the rows with them leaves
    the buffer bit for bit as adding the updates one by one."""
    generator = torch.Generator().manual_seed(seed)
    rows = list(torch.randn(len(staleness), 5, generator=generator).unbind(0))
    samples = [1 + int(x) for x in torch.randint(0, 40, (len(staleness),), generator=generator)]
    together, one_by_one = _aggregator(sample_weighted), _aggregator(sample_weighted)
    example_weights, staleness_weights = together.weigh(staleness, samples)
    together.add_rows(rows, example_weights=example_weights, staleness_weights=staleness_weights)
    alone = [
        one_by_one.add(row, staleness=tau, num_samples=n, base=torch.zeros(5))
        for row, tau, n in zip(rows, staleness, samples, strict=True)
    ]
    assert staleness_weights == alone
    assert torch.equal(together.buffer.weighted_sum, one_by_one.buffer.weighted_sum)
    assert together.buffer.total_example_weight == one_by_one.buffer.total_example_weight
    assert together.count() == one_by_one.count() == len(staleness)


@pytest.mark.parametrize("bad", [0, -3])
def test_weigh_stops_before_the_first_update_the_buffer_would_refuse(bad: int) -> None:
    """An update without samples (its example weight 0 or below, under sample weighting) ends the weights given: the
    updates before it are weighed, it and those after it are left to :meth:`add`, which refuses it."""
    aggregator = _aggregator(sample_weighted=True)
    example_weights, staleness_weights = aggregator.weigh([0, 1, 2, 0], [4, 2, bad, 5])
    assert example_weights == [4.0, 2.0] and staleness_weights == [1.0, 1.0]
    with pytest.raises(ValueError, match="example_weight"):
        aggregator.add(torch.zeros(5), staleness=2, num_samples=bad, base=torch.zeros(5))


def test_weigh_takes_weights_whose_sum_overflows() -> None:
    """Example weights each finite whose sum overflows are all given (the quick check of them all is not enough)."""
    aggregator = _aggregator(sample_weighted=True)
    huge = 10**308
    example_weights, _ = aggregator.weigh([0, 0], [huge, huge])
    assert example_weights == [float(huge)] * 2 and math.isinf(sum(example_weights))
