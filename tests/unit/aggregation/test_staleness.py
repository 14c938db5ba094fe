"""Tests of the staleness weights in flasync.aggregation.staleness."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flasync.aggregation import ConstantStaleness, HingeStaleness, PolynomialStaleness, StalenessWeight

# Bounded so that the weights stay far from float underflow, where "> 0" would fail for numeric reasons only.
_EXPONENTS = st.floats(min_value=0.0, max_value=5.0)
_SLOPES = st.floats(min_value=0.0, max_value=100.0)
_HINGES = st.integers(min_value=0, max_value=50)
_STALENESS = st.integers(min_value=0, max_value=10_000)


@st.composite
def _weights(draw: st.DrawFn) -> StalenessWeight:
    kind = draw(st.sampled_from(["constant", "polynomial", "hinge"]))
    if kind == "constant":
        return ConstantStaleness()
    if kind == "polynomial":
        return PolynomialStaleness(a=draw(_EXPONENTS))
    return HingeStaleness(a=draw(_SLOPES), b=draw(_HINGES))


def test_constant_is_one() -> None:
    """ConstantStaleness gives 1 whatever the staleness."""
    weight = ConstantStaleness()
    assert [weight(tau) for tau in (0, 1, 7, 1000)] == [1.0, 1.0, 1.0, 1.0]


def test_polynomial_default_is_inverse_square_root() -> None:
    """PolynomialStaleness() is FedBuff's 1 / sqrt(1 + tau)."""
    weight = PolynomialStaleness()
    assert weight(0) == 1.0
    assert weight(3) == pytest.approx(0.5)
    assert weight(8) == pytest.approx(1 / 3)


def test_polynomial_hand_computed() -> None:
    """PolynomialStaleness(a=2) gives (1 + tau) ** -2."""
    weight = PolynomialStaleness(a=2.0)
    assert weight(1) == pytest.approx(0.25)
    assert weight(4) == pytest.approx(0.04)


def test_polynomial_zero_exponent_is_constant() -> None:
    """PolynomialStaleness(a=0) weighs every update 1."""
    assert PolynomialStaleness(a=0.0)(50) == 1.0


def test_hinge_is_one_up_to_b() -> None:
    """HingeStaleness keeps full weight while tau <= b."""
    weight = HingeStaleness(a=10.0, b=4)
    assert [weight(tau) for tau in range(5)] == [1.0] * 5


def test_hinge_hand_computed_past_b() -> None:
    """HingeStaleness gives 1 / (a (tau - b) + 1) past the hinge."""
    weight = HingeStaleness(a=10.0, b=4)
    assert weight(5) == pytest.approx(1 / 11)
    assert weight(6) == pytest.approx(1 / 21)
    assert HingeStaleness(a=0.5, b=0)(2) == pytest.approx(0.5)


@pytest.mark.parametrize("weight", [ConstantStaleness(), PolynomialStaleness(), HingeStaleness()])
def test_negative_staleness_raises(weight: StalenessWeight) -> None:
    """A negative staleness raises ValueError for every weight."""
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        weight(-1)


@pytest.mark.parametrize("a", [-0.1, math.nan, math.inf])
def test_polynomial_rejects_bad_exponent(a: float) -> None:
    """PolynomialStaleness rejects a negative or non-finite exponent."""
    with pytest.raises(ValueError, match=r"PolynomialStaleness\.a"):
        PolynomialStaleness(a=a)


@pytest.mark.parametrize("a", [-1.0, math.nan, math.inf])
def test_hinge_rejects_bad_slope(a: float) -> None:
    """HingeStaleness rejects a negative or non-finite slope."""
    with pytest.raises(ValueError, match=r"HingeStaleness\.a"):
        HingeStaleness(a=a)


def test_hinge_rejects_negative_hinge() -> None:
    """HingeStaleness rejects a negative hinge b."""
    with pytest.raises(ValueError, match=r"HingeStaleness\.b"):
        HingeStaleness(b=-1)


def test_weights_are_frozen_and_keyword_only() -> None:
    """Staleness weights are immutable and take their parameters by keyword."""
    weight = PolynomialStaleness(a=1.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        weight.a = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        PolynomialStaleness(1.0)  # type: ignore[call-arg]


@given(weight=_weights(), tau=_STALENESS)
def test_weights_are_in_unit_interval(weight: StalenessWeight, tau: int) -> None:
    """Every staleness weight lies in (0, 1]."""
    assert 0.0 < weight(tau) <= 1.0


@given(weight=_weights(), tau=_STALENESS)
def test_weights_do_not_increase_with_staleness(weight: StalenessWeight, tau: int) -> None:
    """Every staleness weight is non-increasing in tau."""
    assert weight(tau + 1) <= weight(tau)


@given(weight=_weights())
def test_fresh_updates_have_full_weight(weight: StalenessWeight) -> None:
    """Every staleness weight gives s(0) = 1."""
    assert weight(0) == 1.0
