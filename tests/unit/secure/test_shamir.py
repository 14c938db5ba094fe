"""Tests of Shamir secret sharing over GF(2^521 - 1) (flasync.secure.shamir)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.secure.keys import SeededRandom
from flasync.secure.shamir import reconstruct, split


@settings(max_examples=40, deadline=None)
@given(
    secret=st.integers(min_value=0, max_value=2**256 - 1),
    n=st.integers(min_value=1, max_value=7),
    data=st.data(),
)
def test_any_threshold_shares_recover_the_secret(secret: int, n: int, data: st.DataObject) -> None:
    """Every subset of t shares reconstructs the shared secret."""
    t = data.draw(st.integers(min_value=1, max_value=n))
    shares = split(secret, [x + 1 for x in range(n)], t, SeededRandom(n))
    for subset in itertools.combinations(shares, t):
        assert reconstruct(list(subset), t) == secret


def test_fewer_than_threshold_shares_are_refused() -> None:
    """Reconstruction from t - 1 shares is refused rather than returning a wrong value."""
    shares = split(42, [1, 2, 3, 4], 3, SeededRandom(0))
    with pytest.raises(ValueError, match="cannot recover"):
        reconstruct(shares[:2], 3)


def test_split_refuses_bad_points_and_thresholds() -> None:
    """Repeated or zero points and thresholds outside [1, n] are refused."""
    rng = SeededRandom(0)
    with pytest.raises(ValueError, match="distinct"):
        split(1, [1, 1, 2], 2, rng)
    with pytest.raises(ValueError, match="distinct"):
        split(1, [0, 1, 2], 2, rng)
    with pytest.raises(ValueError, match="threshold"):
        split(1, [1, 2], 3, rng)
