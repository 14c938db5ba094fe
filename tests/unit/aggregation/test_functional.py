"""Tests of the aggregation rules in flasync.aggregation.functional."""

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
    fedasync_mix_,
    fedavg,
    fedbuff,
    normalized,
    weighted_mean,
)

_VALUES = st.floats(min_value=-10.0, max_value=10.0, width=32)


@st.composite
def _deltas(draw: st.DrawFn) -> list[Tensor]:
    num_clients = draw(st.integers(min_value=1, max_value=6))
    num_params = draw(st.integers(min_value=1, max_value=16))
    rows = st.lists(_VALUES, min_size=num_params, max_size=num_params)
    return [torch.tensor(draw(rows), dtype=torch.float32) for _ in range(num_clients)]


_STALENESS_WEIGHTS = st.sampled_from([ConstantStaleness(), PolynomialStaleness(), HingeStaleness(a=0.5, b=1)])


def _close(actual: Tensor, expected: Tensor) -> bool:
    return torch.allclose(actual, expected, rtol=1e-5, atol=1e-4)


def test_normalized_hand_computed() -> None:
    """normalized divides each weight by the sum."""
    assert normalized([1.0, 3.0]) == [0.25, 0.75]
    assert normalized([0.0, 2.0]) == [0.0, 1.0]


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([], "empty"),
        ([1.0, -0.5], "must be >= 0"),
        ([0.0, 0.0], "sum to zero"),
        ([1.0, math.nan], "finite"),
        ([math.inf, 1.0], "finite"),
    ],
)
def test_normalized_rejects_invalid_weights(weights: list[float], message: str) -> None:
    """normalized raises ValueError on empty, negative, non-finite or all-zero weights."""
    with pytest.raises(ValueError, match=message):
        normalized(weights)


@given(st.lists(st.floats(min_value=0.0, max_value=1e6), min_size=1).filter(lambda ws: sum(ws) > 0))
def test_normalized_sums_to_one(weights: list[float]) -> None:
    """Normalized weights sum to one."""
    assert math.fsum(normalized(weights)) == pytest.approx(1.0)


def test_weighted_mean_hand_computed() -> None:
    """weighted_mean gives sum_k (w_k / sum w) t_k."""
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    assert torch.equal(weighted_mean(tensors, [1.0, 3.0]), torch.tensor([2.5, 5.0]))


def test_weighted_mean_leaves_inputs_unchanged() -> None:
    """weighted_mean returns a new tensor and does not write into its inputs."""
    first = torch.tensor([1.0, 2.0])
    result = weighted_mean([first], [2.0])
    assert torch.equal(first, torch.tensor([1.0, 2.0]))
    assert result.data_ptr() != first.data_ptr()


def test_weighted_mean_rejects_length_mismatch() -> None:
    """weighted_mean raises ValueError when tensors and weights differ in length."""
    with pytest.raises(ValueError, match="tensors has 2 items but weights has 1"):
        weighted_mean([torch.zeros(2), torch.zeros(2)], [1.0])


def test_weighted_mean_rejects_shape_mismatch() -> None:
    """weighted_mean raises ValueError when the tensors differ in shape."""
    with pytest.raises(ValueError, match=r"tensors\[1\] has shape \(3,\), expected \(2,\)"):
        weighted_mean([torch.zeros(2), torch.zeros(3)], [1.0, 1.0])


def test_weighted_mean_rejects_dtype_mismatch() -> None:
    """weighted_mean raises ValueError when the tensors differ in dtype."""
    with pytest.raises(ValueError, match="dtype"):
        weighted_mean([torch.zeros(2), torch.zeros(2, dtype=torch.float64)], [1.0, 1.0])


def test_weighted_mean_rejects_empty() -> None:
    """weighted_mean raises ValueError on no tensors."""
    with pytest.raises(ValueError, match="empty"):
        weighted_mean([], [])


def test_fedavg_hand_computed() -> None:
    """fedavg weighs each delta by its share of the samples."""
    deltas = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 4.0])]
    assert torch.equal(fedavg(deltas, [3, 1]), torch.tensor([0.75, 1.0]))


def test_fedavg_rejects_negative_count() -> None:
    """fedavg raises ValueError on a negative sample count."""
    with pytest.raises(ValueError, match=r"num_samples\[1\] is -2"):
        fedavg([torch.zeros(2), torch.zeros(2)], [3, -2])


def test_fedavg_rejects_all_zero_counts() -> None:
    """fedavg raises ValueError when no client has a sample."""
    with pytest.raises(ValueError, match="sum to zero"):
        fedavg([torch.zeros(2)], [0])


def test_fedbuff_hand_computed() -> None:
    """fedbuff gives sum_k (e_k / sum e) s(tau_k) delta_k."""
    deltas = [torch.tensor([2.0, 4.0]), torch.tensor([8.0, 0.0])]
    # e = (1, 1) -> (1/2, 1/2); s(0) = 1, s(3) = 1/2 with s(tau) = (1 + tau) ** -1/2.
    result = fedbuff(deltas, [0, 3], [1.0, 1.0], PolynomialStaleness())
    assert torch.allclose(result, torch.tensor([0.5 * 2.0 + 0.25 * 8.0, 0.5 * 4.0]))


def test_fedbuff_staleness_only_discounts() -> None:
    """fedbuff shrinks the step of stale updates instead of handing their share to fresh ones."""
    deltas = [torch.tensor([1.0]), torch.tensor([1.0])]
    result = fedbuff(deltas, [10, 10], [1.0, 1.0], HingeStaleness(a=1.0, b=0))
    assert torch.allclose(result, torch.tensor([1 / 11]))


def test_fedbuff_rejects_length_mismatch() -> None:
    """fedbuff raises ValueError when staleness and deltas differ in length."""
    with pytest.raises(ValueError, match="staleness has 1"):
        fedbuff([torch.zeros(2), torch.zeros(2)], [0], [1.0, 1.0], ConstantStaleness())


def test_fedbuff_rejects_negative_staleness() -> None:
    """fedbuff raises ValueError on a negative staleness."""
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        fedbuff([torch.zeros(2)], [-1], [1.0], ConstantStaleness())


def test_fedbuff_rejects_bad_staleness_weight() -> None:
    """fedbuff raises ValueError when the staleness weight returns a negative value."""
    with pytest.raises(ValueError, match="staleness_weight"):
        fedbuff([torch.zeros(2)], [0], [1.0], lambda staleness: -1.0)


@given(deltas=_deltas(), weight=_STALENESS_WEIGHTS)
def test_fresh_equal_weight_fedbuff_is_the_mean(deltas: list[Tensor], weight: StalenessWeight) -> None:
    """fedbuff with equal example weights and tau = 0 equals the plain mean (FedAvg with equal samples)."""
    ones = [1.0] * len(deltas)
    result = fedbuff(deltas, [0] * len(deltas), ones, weight)
    mean = torch.stack(deltas).mean(dim=0)
    assert _close(result, mean)
    assert _close(fedavg(deltas, [1] * len(deltas)), mean)


@given(data=st.data(), deltas=_deltas(), weight=_STALENESS_WEIGHTS)
def test_fresh_sample_weighted_fedbuff_is_fedavg(
    data: st.DataObject, deltas: list[Tensor], weight: StalenessWeight
) -> None:
    """fedbuff with sample counts as example weights and tau = 0 equals fedavg."""
    counts = data.draw(st.lists(st.integers(1, 1000), min_size=len(deltas), max_size=len(deltas)))
    result = fedbuff(deltas, [0] * len(deltas), [float(n) for n in counts], weight)
    assert _close(result, fedavg(deltas, counts))


def test_fedasync_mix_hand_computed() -> None:
    """fedasync_mix_ gives (1 - alpha) w + alpha w_local."""
    weights = torch.tensor([0.0, 4.0])
    fedasync_mix_(weights, torch.tensor([2.0, 0.0]), 0.25)
    assert torch.allclose(weights, torch.tensor([0.5, 3.0]))


def test_fedasync_mix_is_in_place() -> None:
    """fedasync_mix_ overwrites and returns the weights tensor itself."""
    weights = torch.zeros(3)
    assert fedasync_mix_(weights, torch.ones(3), 1.0) is weights
    assert torch.equal(weights, torch.ones(3))


def test_fedasync_mix_zero_alpha_keeps_weights() -> None:
    """fedasync_mix_ with alpha = 0 leaves the weights as they are."""
    weights = torch.tensor([1.0, -2.0])
    fedasync_mix_(weights, torch.tensor([5.0, 5.0]), 0.0)
    assert torch.equal(weights, torch.tensor([1.0, -2.0]))


@pytest.mark.parametrize("alpha", [-0.1, 1.5, math.nan])
def test_fedasync_mix_rejects_alpha_outside_unit_interval(alpha: float) -> None:
    """fedasync_mix_ raises ValueError unless 0 <= alpha <= 1."""
    with pytest.raises(ValueError, match="alpha must be in"):
        fedasync_mix_(torch.zeros(2), torch.zeros(2), alpha)


def test_fedasync_mix_rejects_shape_mismatch() -> None:
    """fedasync_mix_ raises ValueError when local and weights differ in shape."""
    with pytest.raises(ValueError, match="local has shape"):
        fedasync_mix_(torch.zeros(2), torch.zeros(3), 0.5)
