"""Partial-model exchange: the part of a model that trains and travels, and LoRA adapters put on a model.

A federated run's model state is one flat float32 vector (:class:`flasync.training.local.FlatModel`). With a
partial exchange (``model.exchange``, ``model.adapter``) that vector holds only the *exchanged* parameters, followed
by the model's floating-point buffers; every other parameter is frozen at its initial value, on the server and on
every client, and is never sent. Codecs, error feedback, SCAFFOLD, differential privacy and the aggregators see the
exchanged vector only, so a run's bytes on the wire shrink with it.

:class:`Exchanged` is the model such a run trains: the user's module, with the parameters it exchanges named. The
frozen values are the run's initial weights (drawn from the run's seed), which :class:`PartialFactory` loads into
every copy it builds, so a worker's, an evaluator's and a resumed run's models agree on them bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

import torch
from torch import nn

from flasync.core.errors import ConfigError

__all__ = ["Exchanged", "LoraSpec", "PartialFactory", "apply_lora", "exchanged_names", "matches", "merge_lora"]


def matches(name: str, pattern: str) -> bool:
    """Tell whether the parameter ``name`` is selected by the fnmatch ``pattern``.

    A pattern selects a parameter when it matches the whole dotted name (``layers.2.weight``), any one of its parts
    (``lora_*`` selects ``layers.0.lora_A.default.weight``), or a module prefix of it (``layers.2``).
    """
    return (
        fnmatchcase(name, pattern)
        or fnmatchcase(name, f"{pattern}.*")
        or any(fnmatchcase(part, pattern) for part in name.split("."))
    )


def exchanged_names(module: nn.Module, exchange: Sequence[str] | Literal["trainable"]) -> tuple[str, ...]:
    """Return the names of ``module``'s parameters an ``exchange`` selects, in module order.

    Args:
        module: The model, as built (with its adapters, if any).
        exchange: Name patterns (see :func:`matches`), or ``"trainable"``: the parameters that require grad.

    Raises:
        ConfigError: If a pattern selects no parameter, or nothing is selected.
    """
    named = list(module.named_parameters())
    if exchange == "trainable":
        chosen = tuple(name for name, p in named if p.requires_grad)
        if not chosen:
            raise ConfigError("model.exchange: 'trainable', but no parameter of the model requires grad")
        return chosen
    names = [name for name, _ in named]
    for pattern in exchange:
        if not any(matches(name, pattern) for name in names):
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise ConfigError(f"model.exchange: pattern {pattern!r} selects no parameter of the model ({shown})")
    return tuple(name for name in names if any(matches(name, pattern) for pattern in exchange))


class Exchanged(nn.Module):
    """A model of which only the parameters ``exchanged`` names train and travel.

    The other parameters are frozen (``requires_grad = False``: autograd computes no gradient for them) and stay
    outside the flat vector. The model's floating-point buffers travel with the exchanged parameters, as in a
    whole-model run.

    Args:
        model: The user's module (it becomes the submodule ``model``).
        exchanged: Names of ``model``'s parameters that train and travel.

    Raises:
        ValueError: If a name is not one of ``model``'s parameters, or none is given.
    """

    def __init__(self, model: nn.Module, exchanged: Iterable[str]) -> None:
        super().__init__()
        chosen = set(exchanged)
        named = dict(model.named_parameters())
        unknown = sorted(chosen - named.keys())
        if unknown or not chosen:
            raise ValueError(f"exchanged parameters must be some of the model's; unknown: {unknown}")
        self.model = model
        self.exchanged = tuple(name for name in named if name in chosen)
        for name, parameter in named.items():
            parameter.requires_grad_(name in chosen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the wrapped model's outputs."""
        out: torch.Tensor = self.model(x)
        return out

    def exchanged_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Return the exchanged parameters, named as in the wrapped model, in module order."""
        chosen = set(self.exchanged)
        return [(name, p) for name, p in self.model.named_parameters() if name in chosen]

    def frozen_numel(self) -> int:
        """Return the number of values that stay at their initial values (the frozen parameters)."""
        chosen = set(self.exchanged)
        return sum(p.numel() for name, p in self.model.named_parameters() if name not in chosen)


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """LoRA adapters to put on a model (mirrors :class:`flasync.config.LoraAdapter`).

    Attributes:
        r: Rank of each adapter.
        alpha: Scale numerator (an adapter adds ``(alpha / r) B A``).
        target: Module names (or suffixes) that get an adapter (peft's ``target_modules``).
        modules_to_save: Modules trained whole beside the adapters.
    """

    r: int
    alpha: float
    target: tuple[str, ...]
    modules_to_save: tuple[str, ...] = ()


def apply_lora(module: nn.Module, spec: LoraSpec) -> nn.Module:
    """Return ``module`` with ``spec``'s LoRA adapters put on it by ``peft`` (base weights frozen).

    The adapters' ``A`` matrices draw from torch's default generator (seed it for reproducible weights, as the
    runtime does); ``B`` starts at zero, so the adapted model computes what ``module`` did. No dropout: training
    stays a deterministic function of weights, data and batch order.

    Raises:
        ConfigError: If ``peft`` is not installed or refuses the spec (a target that names no layer it adapts).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - peft is a declared dependency
        raise ConfigError(f"model.adapter needs the peft library ({exc}); pip install peft") from None
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]  # peft annotates int; it scales by alpha / r as a float
        lora_dropout=0.0,
        target_modules=list(spec.target),
        modules_to_save=list(spec.modules_to_save) or None,
    )
    try:
        adapted: nn.Module = get_peft_model(module, config)  # type: ignore[arg-type]
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"model.adapter: {exc}".splitlines()[0]) from None
    return adapted


def merge_lora(module: nn.Module) -> nn.Module:
    """Return the plain model of a model :func:`apply_lora` adapted, each adapter merged into the layer it adapts.

    peft's ``merge_and_unload``: each targeted weight becomes ``W + (alpha / r) B A`` and the adapters go, so the
    result is the user's module class again (what the run logs as its model).

    Raises:
        TypeError: If ``module`` is not a peft model.
    """
    from peft import PeftModel

    if not isinstance(module, PeftModel):
        raise TypeError(f"merge_lora takes a peft model, not {type(module).__name__}")
    merged: nn.Module = module.merge_and_unload()
    return merged


@dataclass(frozen=True, slots=True, eq=False)
class PartialFactory:
    """Build copies of a partial model: the user's module, adapted, holding the run's initial weights.

    Attributes:
        base: Builds the user's module (its random initial weights are overwritten by ``state``).
        exchanged: Names of the parameters that train and travel.
        state: The run's initial ``state_dict`` of the (adapted) model: the frozen part's values. Shared read only
            by every copy built.
        adapter: LoRA adapters put on each module built (None: none).
    """

    base: Callable[[], nn.Module]
    exchanged: tuple[str, ...]
    state: Mapping[str, torch.Tensor]
    adapter: LoraSpec | None = None

    def __call__(self) -> Exchanged:
        """Return a new :class:`Exchanged` model holding the run's initial weights."""
        module = self.base()
        if self.adapter is not None:
            module = apply_lora(module, self.adapter)
        module.load_state_dict(self.state)
        return Exchanged(module, self.exchanged)
