"""Per-address budgets of refused requests."""

from __future__ import annotations

import pytest

from flasync.clients.remote.limits import AddressLimits


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_served_until_its_budget_is_spent_then_waits_for_the_refill() -> None:
    """Each refusal costs one token; with none left the address waits whole seconds until one has come back; other
    addresses are not affected."""
    clock = _Clock()
    limits = AddressLimits(burst=3, per_s=2.0, clock=clock)
    for _ in range(3):
        assert limits.retry_after("a") is None
        limits.refused("a")
    assert limits.retry_after("a") == 1  # half a second to one token, rounded up to a whole second
    assert limits.retry_after("b") is None
    clock.now = 0.5
    assert limits.retry_after("a") is None
    limits.refused("a")
    assert limits.retry_after("a") == 1


def test_a_full_bucket_is_forgotten_and_memory_is_bounded() -> None:
    """An address whose bucket refilled is not remembered; past max_addresses the least recently refused goes."""
    clock = _Clock()
    limits = AddressLimits(burst=2, per_s=1.0, max_addresses=3, clock=clock)
    for address in ("a", "b", "c", "d"):
        limits.refused(address)
    assert len(limits) == 3  # "a" was forgotten first
    clock.now = 10.0
    assert all(limits.retry_after(address) is None for address in "abcd")
    assert len(limits) == 0


@pytest.mark.parametrize("kwargs", [{"burst": 0.5}, {"per_s": 0.0}, {"max_addresses": 0}])
def test_limits_must_be_positive(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="limits must be positive"):
        AddressLimits(**kwargs)  # type: ignore[arg-type]
