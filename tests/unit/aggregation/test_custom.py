"""A user's aggregation rule as the server holds it: CustomAggregator."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flasync.aggregation import (
    Aggregator,
    BufferedAggregator,
    ConstantStaleness,
    CustomAggregator,
    FlatSGD,
    SampleExampleWeight,
)
from flasync.core.errors import CheckpointError


class _Sum:
    """Step the weights by minus the sum of the deltas folded in since the last step."""

    def __init__(self, weights: torch.Tensor) -> None:
        self.weights = weights
        self.total = torch.zeros_like(weights)
        self.calls: list[tuple[int, int]] = []

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        self.total += delta
        self.calls.append((staleness, num_samples))
        return 0.5

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        raise ValueError("no partials")

    def ready(self) -> bool:
        return len(self.calls) >= 2

    def step(self) -> None:
        self.weights -= self.total
        self.total.zero_()
        self.calls.clear()

    def count(self) -> int:
        return len(self.calls)

    @property
    def nbytes(self) -> int:
        return self.total.numel() * 4

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total.clone(), "calls": list(self.calls)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total.copy_(state["total"])
        self.calls = list(state["calls"])


def test_calls_are_forwarded_to_the_rule() -> None:
    """add, ready, count, nbytes and step reach the rule with their arguments; its step changes the weights."""
    weights = torch.zeros(3)
    rule = _Sum(weights)
    wrapped: Aggregator = CustomAggregator(rule, "_Sum")
    assert wrapped.add(torch.ones(3), staleness=2, num_samples=7, base=weights) == 0.5
    assert not wrapped.ready()
    wrapped.add(torch.ones(3), staleness=0, num_samples=4, base=weights)
    assert rule.calls == [(2, 7), (0, 4)]
    assert wrapped.ready() and wrapped.count() == 2 and wrapped.nbytes == 12
    wrapped.step()
    torch.testing.assert_close(weights, torch.full((3,), -2.0))
    assert wrapped.count() == 0
    with pytest.raises(ValueError, match="no partials"):
        wrapped.add_partial(torch.ones(3), example_weight=1.0, staleness=0)


def test_state_is_kept_under_the_rule_name_and_restored() -> None:
    """state_dict wraps the rule's state with kind and name; a rule of the same name restores it."""
    first = CustomAggregator(_Sum(torch.zeros(2)), "_Sum")
    first.add(torch.tensor([1.0, 2.0]), staleness=1, num_samples=3, base=torch.zeros(2))
    state = first.state_dict()
    assert state["kind"] == "custom" and state["rule"] == "_Sum"
    second = _Sum(torch.zeros(2))
    CustomAggregator(second, "_Sum").load_state_dict(state)
    torch.testing.assert_close(second.total, torch.tensor([1.0, 2.0]))
    assert second.calls == [(1, 3)]


def test_a_checkpoint_of_another_rule_is_refused() -> None:
    """A custom state loads into neither a rule of another name nor a built-in rule, and vice versa."""
    state = CustomAggregator(_Sum(torch.zeros(2)), "_Sum").state_dict()
    with pytest.raises(CheckpointError, match="custom aggregator '_Sum', this run 'Other'"):
        CustomAggregator(_Sum(torch.zeros(2)), "Other").load_state_dict(state)
    weights = torch.zeros(2)
    buffered = BufferedAggregator(
        weights,
        size=2,
        optimizer=FlatSGD(weights, lr=1.0),
        staleness=ConstantStaleness(),
        example_weight=SampleExampleWeight(),
    )
    with pytest.raises(CheckpointError, match="holds a 'custom' aggregator, this run a buffered one"):
        buffered.load_state_dict(state)
    with pytest.raises(CheckpointError, match="holds a 'buffered' aggregator, this run a custom one"):
        CustomAggregator(_Sum(torch.zeros(2)), "_Sum").load_state_dict(buffered.state_dict())
