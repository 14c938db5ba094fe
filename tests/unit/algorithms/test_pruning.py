"""Magnitude pruning: the mask, its schedule, the server's side and the gradient mask in local training."""

from __future__ import annotations

import math

import pytest
import torch

from flasync.algorithms.pruning import PruningServer, density_at, layer_mask, magnitude_mask
from flasync.codecs import NonZero, Pipeline, decode
from flasync.training.local import FlatModel, LocalTraining, train
from flasync.training.models import MLP


def test_the_mask_keeps_the_largest_magnitudes_and_breaks_ties_by_index() -> None:
    """ceil(density * n) weights of largest |w| are kept; among equal magnitudes the lower indices win."""
    weights = torch.tensor([0.1, -3.0, 2.0, -2.0, 0.5])
    assert magnitude_mask(weights, 0.4).tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert magnitude_mask(weights, 0.5).tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_a_pruned_weight_stays_pruned() -> None:
    """Choosing again with a mask keeps only weights the mask kept, even if a pruned one is larger now."""
    weights = torch.tensor([5.0, 1.0, 2.0, 3.0])
    kept = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert magnitude_mask(weights, 0.5, kept).tolist() == [0.0, 0.0, 1.0, 1.0]


def test_a_density_outside_the_unit_interval_is_refused() -> None:
    """Density 0 or above 1 raises."""
    with pytest.raises(ValueError, match="density"):
        magnitude_mask(torch.ones(3), 0.0)


def test_the_density_steps_down_geometrically_to_its_target() -> None:
    """The i-th event keeps target ** (i / steps), then the target."""
    assert [round(density_at(i, target=0.25, steps=2), 6) for i in (1, 2, 3)] == [0.5, 0.25, 0.25]


def test_the_server_prunes_on_schedule_and_zeroes_pruned_weights_after_every_step() -> None:
    """No mask before the first event; then the mask keeps the target share, and later steps cannot revive a weight."""
    weights = torch.arange(1.0, 11.0)
    server = PruningServer(weights, target_density=0.3, every_versions=2)
    server.stepped(0)  # makes version 1: no event yet
    assert server.mask is None and server.published(1, Pipeline(), None).nbytes == 0
    server.stepped(1)  # makes version 2: prunes
    assert weights.tolist() == [0.0] * 7 + [8.0, 9.0, 10.0]
    weights.add_(1.0)  # an optimizer's step that moves every weight
    server.stepped(2)
    assert weights.tolist() == [0.0] * 7 + [9.0, 10.0, 11.0]
    extra = server.published(3, Pipeline(), None)
    assert extra.value is server.mask and extra.nbytes == math.ceil(10 / 8)


def test_the_server_state_round_trips() -> None:
    """state_dict / load_state_dict restore the mask and the event count."""
    weights = torch.randn(20, generator=torch.Generator().manual_seed(0))
    server = PruningServer(weights, target_density=0.5, every_versions=1, steps=2)
    server.stepped(0)
    restored = PruningServer(weights.clone(), target_density=0.5, every_versions=1, steps=2)
    restored.load_state_dict(server.state_dict())
    assert server.mask is not None and restored.mask is not None
    assert torch.equal(restored.mask, server.mask) and restored.events == 1
    assert restored.density == server.density == pytest.approx(math.ceil(20 * 0.5**0.5) / 20)


def test_local_training_with_a_mask_leaves_pruned_weights_at_zero(seeded_torch: None) -> None:
    """With momentum and weight decay, the weights a mask prunes stay exactly zero and so does their delta."""
    model = FlatModel(MLP(8, (6,), 3))
    mask = magnitude_mask(model.flat, 0.3)
    base = model.flat * mask
    x, y = torch.randn(40, 8), torch.randint(0, 3, (40,))
    cfg = LocalTraining(epochs=2, batch_size=8, lr=0.5, momentum=0.9, weight_decay=0.1)
    result = train(model, base, x, y, cfg, torch.Generator().manual_seed(1), mask=mask)
    pruned = mask == 0
    assert bool((model.flat[pruned] == 0).all()) and bool((result.delta[pruned] == 0).all())
    assert bool((result.delta[~pruned] != 0).any())
    unmasked = train(FlatModel(MLP(8, (6,), 3)), base, x, y, cfg, torch.Generator().manual_seed(1))
    assert result.peak_mem_bytes == unmasked.peak_mem_bytes + 4 * mask.numel()


@pytest.mark.parametrize("density", [0.05, 0.2, 0.5, 0.9])
def test_nonzero_sends_a_pruned_vector_losslessly_in_fewer_bytes(density: float) -> None:
    """NonZero decodes to the vector bit for bit, sparse while that is smaller, dense beyond."""
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    vector = values * magnitude_mask(values, density)
    payload = Pipeline([NonZero()]).encode(vector).payload
    assert torch.equal(decode(payload, expected_elements=vector.numel()), vector)
    dense = 24 + 4 * vector.numel()
    assert (len(payload) < dense) is (density < 0.8)
    assert len(payload) <= dense


def test_each_weight_tensor_is_pruned_on_its_own_and_biases_are_kept() -> None:
    """A layer of small weights keeps its own share, not none of it; 1-d tensors keep everything."""
    big = torch.tensor([[4.0, -5.0], [6.0, 1.0]])  # 2 x 2
    bias = torch.tensor([0.01, 0.02])
    small = torch.tensor([[0.1, -0.3], [0.2, 0.05]])
    flat = torch.cat([big.reshape(-1), bias, small.reshape(-1)])
    mask = layer_mask(flat, 0.5, [(2, 2), (2,), (2, 2)])
    assert mask.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert magnitude_mask(flat, 0.4)[6:].sum() == 0  # one global threshold empties the small layer
    with pytest.raises(ValueError, match="do not fit"):
        layer_mask(flat, 0.5, [(2, 2)])
