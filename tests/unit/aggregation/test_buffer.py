"""Tests of the FedBuff accumulator flasync.aggregation.UpdateBuffer."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from flasync.aggregation import (
    ConstantStaleness,
    HingeStaleness,
    PolynomialStaleness,
    StalenessWeight,
    UpdateBuffer,
    fedbuff,
)

_VALUES = st.floats(min_value=-10.0, max_value=10.0, width=32)


@st.composite
def _updates(draw: st.DrawFn) -> tuple[list[Tensor], list[int], list[float]]:
    num_clients = draw(st.integers(min_value=1, max_value=6))
    num_params = draw(st.integers(min_value=1, max_value=16))
    rows = st.lists(_VALUES, min_size=num_params, max_size=num_params)
    deltas = [torch.tensor(draw(rows), dtype=torch.float32) for _ in range(num_clients)]
    staleness = draw(st.lists(st.integers(0, 20), min_size=num_clients, max_size=num_clients))
    examples = draw(st.lists(st.floats(min_value=0.1, max_value=1000.0), min_size=num_clients, max_size=num_clients))
    return deltas, staleness, examples


def _filled() -> UpdateBuffer:
    buffer = UpdateBuffer(2)
    buffer.add(torch.tensor([2.0, 4.0]), example_weight=1.0, staleness_weight=1.0)
    buffer.add(torch.tensor([8.0, 0.0]), example_weight=3.0, staleness_weight=0.5)
    return buffer


def test_new_buffer_is_empty() -> None:
    """A new buffer has no update, no weight and a zero accumulator."""
    buffer = UpdateBuffer(4)
    assert buffer.count == 0
    assert buffer.total_example_weight == 0.0
    assert buffer.num_params == 4


def test_nbytes_is_accumulator_size() -> None:
    """nbytes is the accumulator's size in bytes."""
    assert UpdateBuffer(10).nbytes == 40
    assert UpdateBuffer(10, dtype=torch.float64).nbytes == 80


def test_pseudo_gradient_hand_computed() -> None:
    """pseudo_gradient is sum_k e_k s_k delta_k / sum_k e_k."""
    buffer = _filled()
    assert buffer.count == 2
    assert buffer.total_example_weight == 4.0
    # (1 * 1 * [2, 4] + 3 * 0.5 * [8, 0]) / 4 = [14, 4] / 4
    assert torch.allclose(buffer.pseudo_gradient(), torch.tensor([3.5, 1.0]))


def test_pseudo_gradient_is_a_new_tensor() -> None:
    """pseudo_gradient returns a tensor that later updates do not change."""
    buffer = _filled()
    result = buffer.pseudo_gradient()
    expected = result.clone()
    buffer.add(torch.tensor([100.0, 100.0]), example_weight=1.0, staleness_weight=1.0)
    buffer.reset()
    assert torch.equal(result, expected)


def test_pseudo_gradient_of_empty_buffer_raises() -> None:
    """pseudo_gradient raises ValueError on an empty buffer."""
    with pytest.raises(ValueError, match="empty"):
        UpdateBuffer(3).pseudo_gradient()


def test_reset_zeroes_in_place() -> None:
    """reset empties the buffer without reallocating the accumulator."""
    buffer = _filled()
    storage = buffer._acc.data_ptr()
    buffer.reset()
    assert buffer.count == 0
    assert buffer.total_example_weight == 0.0
    assert buffer._acc.data_ptr() == storage
    assert torch.equal(buffer.state_dict()["accumulator"], torch.zeros(2))


def test_add_rejects_wrong_length() -> None:
    """add raises ValueError naming both lengths when the delta has the wrong size."""
    with pytest.raises(ValueError, match="delta has 10 elements, expected 12"):
        UpdateBuffer(12).add(torch.zeros(10), example_weight=1.0, staleness_weight=1.0)


def test_add_rejects_non_flat_delta() -> None:
    """add raises ValueError on a delta that is not 1-D."""
    with pytest.raises(ValueError, match=r"flat \(1-D\), got shape \(3, 4\)"):
        UpdateBuffer(12).add(torch.zeros(3, 4), example_weight=1.0, staleness_weight=1.0)


def test_add_rejects_wrong_dtype() -> None:
    """add raises ValueError when the delta's dtype differs from the buffer's."""
    with pytest.raises(ValueError, match=r"delta has dtype torch\.float64, expected torch\.float32"):
        UpdateBuffer(3).add(torch.zeros(3, dtype=torch.float64), example_weight=1.0, staleness_weight=1.0)


@pytest.mark.parametrize("example_weight", [0.0, -1.0, math.nan, math.inf])
def test_add_rejects_non_positive_example_weight(example_weight: float) -> None:
    """add raises ValueError unless the example weight is finite and positive."""
    with pytest.raises(ValueError, match="example_weight"):
        UpdateBuffer(3).add(torch.zeros(3), example_weight=example_weight, staleness_weight=1.0)


@pytest.mark.parametrize("staleness_weight", [-0.5, math.nan])
def test_add_rejects_negative_staleness_weight(staleness_weight: float) -> None:
    """add raises ValueError on a negative or NaN staleness weight."""
    with pytest.raises(ValueError, match="staleness_weight"):
        UpdateBuffer(3).add(torch.zeros(3), example_weight=1.0, staleness_weight=staleness_weight)


def test_rejected_add_leaves_buffer_unchanged() -> None:
    """A rejected update changes neither the accumulator nor the counters."""
    buffer = _filled()
    before = buffer.state_dict()
    with pytest.raises(ValueError, match="example_weight"):
        buffer.add(torch.ones(2), example_weight=0.0, staleness_weight=1.0)
    after = buffer.state_dict()
    assert torch.equal(after["accumulator"], before["accumulator"])
    assert after["count"] == before["count"]
    assert after["total_example_weight"] == before["total_example_weight"]


def test_zero_num_params_rejected() -> None:
    """A buffer needs at least one parameter."""
    with pytest.raises(ValueError, match="num_params must be >= 1"):
        UpdateBuffer(0)


def test_state_dict_round_trip() -> None:
    """load_state_dict restores what state_dict saved into a fresh buffer."""
    source = _filled()
    target = UpdateBuffer(2)
    target.load_state_dict(source.state_dict())
    assert target.count == source.count
    assert target.total_example_weight == source.total_example_weight
    assert torch.equal(target.pseudo_gradient(), source.pseudo_gradient())


def test_state_dict_is_a_snapshot() -> None:
    """state_dict copies the accumulator, so later updates do not change it."""
    buffer = _filled()
    state = buffer.state_dict()
    saved = state["accumulator"].clone()
    buffer.add(torch.ones(2), example_weight=1.0, staleness_weight=1.0)
    assert torch.equal(state["accumulator"], saved)


def test_load_state_dict_rejects_wrong_shape() -> None:
    """load_state_dict raises ValueError on an accumulator of another size."""
    with pytest.raises(ValueError, match="shape"):
        UpdateBuffer(3).load_state_dict(_filled().state_dict())


def test_load_state_dict_rejects_missing_key() -> None:
    """load_state_dict raises ValueError naming a missing key."""
    state = _filled().state_dict()
    del state["count"]
    with pytest.raises(ValueError, match="count"):
        UpdateBuffer(2).load_state_dict(state)


def test_load_state_dict_rejects_inconsistent_counters() -> None:
    """load_state_dict raises ValueError on updates without weight."""
    state = _filled().state_dict()
    state["total_example_weight"] = 0.0
    with pytest.raises(ValueError, match="both must be zero or both positive"):
        UpdateBuffer(2).load_state_dict(state)


@given(
    updates=_updates(),
    weight=st.sampled_from([ConstantStaleness(), PolynomialStaleness(), HingeStaleness(a=0.5, b=2)]),
)
def test_buffer_equals_functional_fedbuff(
    updates: tuple[list[Tensor], list[int], list[float]], weight: StalenessWeight
) -> None:
    """Feeding K deltas into the buffer gives functional.fedbuff of the same deltas."""
    deltas, staleness, examples = updates
    buffer = UpdateBuffer(deltas[0].numel())
    for delta, tau, example in zip(deltas, staleness, examples, strict=True):
        buffer.add(delta, example_weight=example, staleness_weight=weight(tau))
    expected = fedbuff(deltas, staleness, examples, weight)
    assert torch.allclose(buffer.pseudo_gradient(), expected, rtol=1e-5, atol=1e-4)


@given(updates=_updates())
def test_reset_buffer_matches_fresh_buffer(updates: tuple[list[Tensor], list[int], list[float]]) -> None:
    """A buffer reused after reset aggregates exactly like a new one."""
    deltas, _, examples = updates
    reused = UpdateBuffer(deltas[0].numel())
    reused.add(torch.full_like(deltas[0], 3.0), example_weight=2.0, staleness_weight=1.0)
    reused.reset()
    fresh = UpdateBuffer(deltas[0].numel())
    for buffer in (reused, fresh):
        for delta, example in zip(deltas, examples, strict=True):
            buffer.add(delta, example_weight=example, staleness_weight=1.0)
    assert torch.equal(reused.pseudo_gradient(), fresh.pseudo_gradient())


@pytest.mark.slow
def test_add_sum_of_a_partial_equals_adding_its_updates() -> None:
    """An edge's partial (sum of e*s*delta, sum of e) folds to the same pseudo-gradient as its updates one by one."""
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(50, generator=gen) for _ in range(5)]
    examples = [3.0, 1.0, 4.0, 1.0, 5.0]
    stale = [1.0, 0.5, 0.25, 1.0, 0.7]
    flat = UpdateBuffer(50)
    for d, e, s in zip(deltas, examples, stale, strict=True):
        flat.add(d, example_weight=e, staleness_weight=s)
    edge_a = sum(e * s * d for d, e, s in zip(deltas[:2], examples[:2], stale[:2], strict=True))
    edge_b = sum(e * s * d for d, e, s in zip(deltas[2:], examples[2:], stale[2:], strict=True))
    tiered = UpdateBuffer(50)
    tiered.add_sum(edge_a, example_weight=sum(examples[:2]))
    tiered.add_sum(edge_b, example_weight=sum(examples[2:]))
    assert tiered.count == 2
    assert tiered.total_example_weight == flat.total_example_weight
    torch.testing.assert_close(tiered.pseudo_gradient(), flat.pseudo_gradient())
    with pytest.raises(ValueError, match="example_weight"):
        tiered.add_sum(edge_a, example_weight=0.0)
    assert tiered.count == 2


def test_add_stacked_equals_adding_rows_one_by_one() -> None:
    """One fused addmv_ over K rows gives what K calls of add give, and counts K updates."""
    generator = torch.Generator().manual_seed(0)
    deltas = torch.randn(5, 33, generator=generator)
    e = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    s = torch.tensor([1.0, 0.5, 0.25, 1.0, 0.0])
    one_by_one = UpdateBuffer(33)
    for row, ew, sw in zip(deltas, e.tolist(), s.tolist(), strict=True):
        one_by_one.add(row, example_weight=ew, staleness_weight=sw)
    stacked = UpdateBuffer(33)
    stacked.add_stacked(deltas, example_weights=e, staleness_weights=s)
    assert stacked.count == one_by_one.count == 5
    assert stacked.total_example_weight == one_by_one.total_example_weight
    assert torch.allclose(stacked.pseudo_gradient(), one_by_one.pseudo_gradient(), atol=1e-6)


def test_add_stacked_rejects_bad_weights_without_change() -> None:
    """A non-positive example weight is an error and leaves the buffer empty."""
    buffer = UpdateBuffer(3)
    with pytest.raises(ValueError, match="example_weights must be finite and > 0"):
        buffer.add_stacked(torch.ones(2, 3), example_weights=torch.tensor([1.0, 0.0]), staleness_weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"deltas must have shape \(K, 3\)"):
        buffer.add_stacked(torch.ones(2, 4), example_weights=torch.ones(2), staleness_weights=torch.ones(2))
    assert buffer.count == 0


@given(_updates())
def test_mean_in_place_is_the_pseudo_gradient_bit_for_bit(updates: tuple[list[Tensor], list[int], list[float]]) -> None:
    """mean_ turns the accumulator into exactly the tensor pseudo_gradient returns, and reset empties it again."""
    deltas, staleness, examples = updates
    buffer = UpdateBuffer(deltas[0].numel())
    for delta, tau, example in zip(deltas, staleness, examples, strict=True):
        buffer.add(delta, example_weight=example, staleness_weight=1.0 / (1 + tau))
    expected = buffer.pseudo_gradient()
    mean = buffer.mean_()
    assert mean is buffer.weighted_sum
    assert torch.equal(mean, expected)
    buffer.reset()
    assert buffer.count == 0 and torch.equal(buffer.weighted_sum, torch.zeros_like(expected))


def test_mean_in_place_of_empty_buffer_raises() -> None:
    """mean_ raises ValueError on an empty buffer and leaves it as it was."""
    buffer = UpdateBuffer(3)
    with pytest.raises(ValueError, match="empty"):
        buffer.mean_()
    assert torch.equal(buffer.weighted_sum, torch.zeros(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mean_in_place_divides_as_the_python_number_does(dtype: torch.dtype) -> None:
    """mean_ equals the accumulator divided by the total example weight as a Python number, bit for bit, for totals
    that float32 rounds, that underflow it, and beyond its largest value."""
    generator = torch.Generator().manual_seed(0)
    totals = [1.0, 3.0, 1 / 3, 0.1 + 0.2, 7e-46, 1e-300, 123456.789, 3.4028235e38, 1e39, 1e300]
    for total in totals:
        for scale in (1e-30, 1.0, 1e30):
            buffer = UpdateBuffer(2762, dtype=dtype)
            weighted_sum = (torch.randn(2762, generator=generator, dtype=torch.float64) * scale).to(dtype)
            buffer.load_state_dict({"accumulator": weighted_sum, "count": 1, "total_example_weight": total})
            expected = buffer.weighted_sum / buffer.total_example_weight
            mean = buffer.mean_()
            assert torch.equal(mean.isnan(), expected.isnan())
            assert torch.equal(mean.nan_to_num(nan=0.0), expected.nan_to_num(nan=0.0))


@given(
    seed=st.integers(0, 2**31 - 1),
    count=st.integers(0, 9),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    one_weight=st.booleans(),
    size=st.sampled_from([7, 67, 1031]),
)
def test_add_rows_equals_adding_each_row_in_turn(
    seed: int, count: int, dtype: torch.dtype, one_weight: bool, size: int
) -> None:
    """Rows folded together give the accumulator, total weight and count of adding them one by one, bit for bit:
    rows of several weights, and rows of one weight (folded in one call), across vector widths and their tails."""
    generator = torch.Generator().manual_seed(seed)
    rows = (torch.randn(count, size, generator=generator) * 3.0).to(dtype)
    example = [float(x) for x in torch.randint(1, 50, (count,), generator=generator)]
    staleness = [float(x) for x in torch.rand(count, generator=generator)]
    if one_weight:
        example, staleness = example[:1] * count, staleness[:1] * count
    together, one_by_one = UpdateBuffer(size, dtype=dtype), UpdateBuffer(size, dtype=dtype)
    together.add(torch.ones(size, dtype=dtype), example_weight=0.3, staleness_weight=0.7)
    one_by_one.add(torch.ones(size, dtype=dtype), example_weight=0.3, staleness_weight=0.7)
    together.add_rows(list(rows.unbind(0)), example_weights=example, staleness_weights=staleness)
    for row, e, s in zip(rows.unbind(0), example, staleness, strict=True):
        one_by_one.add(row, example_weight=e, staleness_weight=s)
    assert torch.equal(together.weighted_sum, one_by_one.weighted_sum)
    assert together.total_example_weight == one_by_one.total_example_weight
    assert together.count == one_by_one.count == count + 1


@pytest.mark.parametrize(
    ("rows", "example", "staleness", "match"),
    [
        ([torch.ones(4), torch.ones(5)], [1.0, 1.0], [1.0, 1.0], "elements"),
        ([torch.ones(4), torch.ones(4, dtype=torch.float64)], [1.0, 1.0], [1.0, 1.0], "dtype"),
        ([torch.ones(4), torch.ones(4)], [1.0, 0.0], [1.0, 1.0], "example_weight"),
        ([torch.ones(4), torch.ones(4)], [1.0, math.nan], [1.0, 1.0], "example_weight"),
        ([torch.ones(4), torch.ones(4)], [1.0, 1.0], [math.inf, 1.0], "staleness_weight"),
        ([torch.ones(4), torch.ones(4)], [1.0, 1.0], [1.0, -0.5], "staleness_weight"),
        ([torch.ones(4), torch.ones(4)], [1.0], [1.0, 1.0], "one of each"),
    ],
)
def test_add_rows_refuses_a_bad_row_and_adds_none(
    rows: list[Tensor], example: list[float], staleness: list[float], match: str
) -> None:
    """A wrong row or weight anywhere names what is wrong and leaves the buffer as it was (the good rows before it
    are not added)."""
    buffer = UpdateBuffer(4)
    with pytest.raises(ValueError, match=match):
        buffer.add_rows(rows, example_weights=example, staleness_weights=staleness)
    assert buffer.count == 0 and buffer.total_example_weight == 0.0
    assert torch.equal(buffer.weighted_sum, torch.zeros(4))


def test_add_rows_takes_weights_whose_sum_overflows() -> None:
    """Weights each in range whose sum overflows a float (the quick check of them all fails) are still taken."""
    buffer = UpdateBuffer(2, dtype=torch.float64)
    big = 1e308
    buffer.add_rows([torch.zeros(2, dtype=torch.float64)] * 2, example_weights=[big, big], staleness_weights=[1.0, 1.0])
    assert buffer.count == 2 and buffer.total_example_weight == math.inf
