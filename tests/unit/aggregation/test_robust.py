"""Robust aggregation rules: coordinate-wise median and trimmed mean."""

from __future__ import annotations

import pytest
import torch

import flasync
from flasync.aggregation import coordinate_median, trimmed_mean
from flasync.core.events import TaskAssigned
from flasync.testing import small_config


def test_median_odd_and_even_counts() -> None:
    """Odd counts take the middle value, even counts the mean of the two middle ones, per coordinate."""
    odd = [torch.tensor([1.0, 9.0]), torch.tensor([3.0, -1.0]), torch.tensor([2.0, 4.0])]
    torch.testing.assert_close(coordinate_median(odd), torch.tensor([2.0, 4.0]))
    even = [*odd, torch.tensor([10.0, 0.0])]
    torch.testing.assert_close(coordinate_median(even), torch.tensor([2.5, 2.0]))


def test_trimmed_mean_cuts_both_ends() -> None:
    """floor(trim * K) values are dropped at each end before averaging; trim 0 is the plain mean."""
    deltas = [torch.tensor([float(v)]) for v in (1, 2, 3, 4, 1000)]
    torch.testing.assert_close(trimmed_mean(deltas, 0.2), torch.tensor([3.0]))
    torch.testing.assert_close(trimmed_mean(deltas, 0.0), torch.tensor([202.0]))
    torch.testing.assert_close(trimmed_mean(deltas, 0.1), torch.tensor([202.0]))  # floor(0.5) = 0


def test_one_outlier_cannot_move_robust_rules_far() -> None:
    """A single huge update shifts the mean arbitrarily but the median and trimmed mean hardly."""
    generator = torch.Generator().manual_seed(0)
    honest = [torch.randn(100, generator=generator) * 0.01 + 1.0 for _ in range(9)]
    poisoned = [*honest, torch.full((100,), 1e6)]
    assert float(torch.stack(poisoned).mean(0).mean()) > 1e4
    assert float((coordinate_median(poisoned) - 1.0).abs().max()) < 0.05
    assert float((trimmed_mean(poisoned, 0.1) - 1.0).abs().max()) < 0.05


@pytest.mark.parametrize("call", [lambda d: coordinate_median(d), lambda d: trimmed_mean(d, 0.1)])
def test_bad_inputs(call: object) -> None:
    """Empty input and mixed shapes are refused."""
    assert callable(call)
    with pytest.raises(ValueError, match="empty"):
        call([])
    with pytest.raises(ValueError, match="shape"):
        call([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="trim_fraction"):
        trimmed_mean([torch.zeros(2)], 0.5)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
@pytest.mark.slow
def test_sync_runs_with_robust_rules(rule: str) -> None:
    """FedAvg rounds aggregate with the robust rule, deterministically, and still learn."""
    config = small_config(
        f"resilience.aggregation={rule}",
        "resilience.trim_fraction=0.2",
        server={"kind": "fedavg", "clients_per_round": 5},
    )
    first, second = flasync.run(config), flasync.run(config)
    assert first.weights_sha256 == second.weights_sha256
    assert first.versions == 12 and first.accuracy > 0.5
    mean = flasync.run(small_config(server={"kind": "fedavg", "clients_per_round": 5}))
    assert mean.weights_sha256 != first.weights_sha256


async def test_clipping_bounds_each_server_step() -> None:
    """With updates clipped to a tiny norm, the model moves by at most that much per version (server SGD, lr 1)."""
    federation = flasync.Federation(small_config("resilience.clip_update_norm=1e-4", "stop.max_versions=4"))
    assigned = federation.bus.subscribe(TaskAssigned, policy="drop_oldest", capacity=1024)
    initial: list[torch.Tensor] = []

    async def grab() -> None:
        await assigned.receive()
        assert federation.server is not None
        initial.append(federation.server.weights.clone())

    import asyncio

    grabber = asyncio.create_task(grab())
    summary = await federation.run()
    await grabber
    assert federation.weights is not None
    moved = float(torch.linalg.vector_norm(federation.weights - initial[0]))
    assert 0 < moved <= summary.versions * 1e-4 * (1 + 1e-5)


def test_robust_rules_are_for_sync_rounds_only() -> None:
    """Asking an async server for a median is a config error naming the field."""
    with pytest.raises(flasync.ConfigError, match=r"resilience\.aggregation: 'median' applies to sync rounds only"):
        small_config("resilience.aggregation=median")
