"""Partial-model exchange: which parameters an exchange selects, and what a partial model's flat vector holds."""

from __future__ import annotations

import pytest
import torch

from flasync.core.errors import ConfigError
from flasync.training.exchange import Exchanged, LoraSpec, PartialFactory, apply_lora, exchanged_names, matches
from flasync.training.local import FlatModel, LocalTraining, flat_parameters, train
from flasync.training.models import MLP


def _mlp() -> MLP:
    return MLP(8, (6,), 3)


@pytest.mark.parametrize(
    ("name", "pattern", "expected"),
    [
        ("layers.2.weight", "layers.2.weight", True),
        ("layers.2.weight", "layers.2", True),  # a module prefix
        ("layers.0.lora_A.default.weight", "lora_*", True),  # one dotted part
        ("layers.0.base_layer.weight", "lora_*", False),
        ("layers.2.weight", "layers.*.bias", False),
        ("layers.20.weight", "layers.2", False),  # a prefix ends at a dot
    ],
)
def test_a_pattern_matches_a_name_a_part_or_a_module_prefix(name: str, pattern: str, expected: bool) -> None:
    """A pattern selects a whole name, one of its dotted parts or a module prefix, and nothing else."""
    assert matches(name, pattern) is expected


def test_patterns_select_parameters_in_module_order() -> None:
    """The selected names come in the module's order, whatever the patterns' order."""
    assert exchanged_names(_mlp(), ["*.bias", "layers.2"]) == ("layers.0.bias", "layers.2.weight", "layers.2.bias")


def test_a_pattern_that_selects_nothing_is_a_config_error() -> None:
    """A pattern naming no parameter is refused, naming the pattern."""
    with pytest.raises(ConfigError, match="pattern 'head' selects no parameter"):
        exchanged_names(_mlp(), ["layers.2", "head"])


def test_trainable_selects_the_parameters_that_require_grad() -> None:
    """'trainable' selects what requires grad, and refuses a model where nothing does."""
    module = _mlp()
    module.layers[0].weight.requires_grad_(False)
    assert exchanged_names(module, "trainable") == ("layers.0.bias", "layers.2.weight", "layers.2.bias")
    for p in module.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="no parameter of the model requires grad"):
        exchanged_names(module, "trainable")


def test_the_flat_vector_holds_the_exchanged_parameters_only(seeded_torch: None) -> None:
    """A partial model's flat vector is its exchanged parameters, in order; frozen ones keep no gradient."""
    module = _mlp()
    head = torch.cat([module.layers[2].weight.detach().reshape(-1), module.layers[2].bias.detach()])
    partial = Exchanged(module, ["layers.2.weight", "layers.2.bias"])
    assert torch.equal(flat_parameters(partial), head)
    flat = FlatModel(partial)
    assert flat.flat.numel() == flat.num_trainable == head.numel()
    assert partial.frozen_numel() == 8 * 6 + 6
    assert not module.layers[0].weight.requires_grad and module.layers[0].weight.grad is None


def test_local_training_leaves_the_frozen_parameters_as_they_were(seeded_torch: None) -> None:
    """Training a partial model changes its exchanged parameters and leaves the frozen ones bit-identical."""
    partial = Exchanged(_mlp(), ["layers.2.weight", "layers.2.bias"])
    frozen = partial.model.layers[0].weight.detach().clone()
    model = FlatModel(partial)
    base = model.flat.clone()
    x, y = torch.randn(40, 8), torch.randint(0, 3, (40,))
    result = train(
        model,
        base,
        x,
        y,
        LocalTraining(epochs=2, batch_size=8, lr=0.5, weight_decay=0.1),
        torch.Generator().manual_seed(1),
    )
    assert result.delta.shape == base.shape and bool(result.delta.abs().sum() > 0)
    assert torch.equal(partial.model.layers[0].weight, frozen)


def test_an_unknown_exchanged_name_is_refused() -> None:
    """Exchanged refuses a name that is no parameter of the model."""
    with pytest.raises(ValueError, match="unknown"):
        Exchanged(_mlp(), ["layers.9.weight"])


def test_a_partial_factory_builds_copies_with_the_run_initial_weights(seeded_torch: None) -> None:
    """Every copy a PartialFactory builds holds the given initial state, the same exchanged names, bit for bit."""
    first = _mlp()
    state = {k: v.clone() for k, v in first.state_dict().items()}
    factory = PartialFactory(_mlp, ("layers.2.weight", "layers.2.bias"), state)
    one, two = factory(), factory()
    for copy in (one, two):
        assert copy.exchanged == ("layers.2.weight", "layers.2.bias")
        assert all(torch.equal(copy.model.state_dict()[k], v) for k, v in state.items())


@pytest.mark.slow
def test_lora_adapters_start_from_the_model_and_exchange_only_adapters(seeded_torch: None) -> None:
    """LoRA (peft) leaves the model's outputs unchanged at start; 'trainable' then selects adapters and saved heads."""
    module = _mlp()
    x = torch.randn(5, 8)
    before = module(x)
    adapted = apply_lora(module, LoraSpec(r=2, alpha=4.0, target=("layers.0",), modules_to_save=("layers.2",)))
    assert torch.allclose(adapted(x), before)
    names = exchanged_names(adapted, "trainable")
    assert any("lora_A" in n for n in names) and any("lora_B" in n for n in names)
    assert not any("base_layer" in n or "original_module" in n for n in names)
    partial = Exchanged(adapted, names)
    assert flat_parameters(partial).numel() == 2 * 8 + 6 * 2 + 6 * 3 + 3


@pytest.mark.slow
def test_lora_with_a_target_that_names_no_layer_is_a_config_error() -> None:
    """peft's refusal of a target naming no layer becomes a one-line config error."""
    with pytest.raises(ConfigError, match=r"^model\.adapter: [^\n]*$"):
        apply_lora(_mlp(), LoraSpec(r=2, alpha=4.0, target=("nothing",)))
