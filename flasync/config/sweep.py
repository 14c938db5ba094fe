"""The ``[sweep]`` section of a config file: what ``flasync sweep CONFIG`` runs without flags.

A grid (the cartesian product of ``grid``'s values) or a search (``search``: Optuna draws ``trials`` points from
``space``), ``set`` applied to every run, ``parallel`` runs at once and the ``objective`` the best run is chosen by
(and a search optimizes)::

    [sweep]
    parallel = 1
    objective = "server/eval/accuracy:max"
    grid = {"server.kind" = ["fedavg", "fedbuff"], seed = "0..4"}
    set = {"stop.max_versions" = 40}

    [sweep.search]                     # instead of grid
    sampler = "tpe"
    trials = 20
    space."client.lr" = {kind = "float", low = 1e-3, high = 0.3, log = true}

``flasync run`` ignores the section (:func:`flasync.config.validate` drops it), so one file serves both commands.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from flasync.config._base import _FieldError, _Section
from flasync.core.errors import ConfigError

__all__ = [
    "MAX_TRIALS",
    "OBJECTIVE_FIELDS",
    "CategoricalParameter",
    "FloatParameter",
    "IntParameter",
    "SearchConfig",
    "SearchParameter",
    "SweepConfig",
    "parse_objective",
    "sweep_section",
    "value_text",
]

SECTION = "sweep"
"""The config file's table that :class:`SweepConfig` reads."""

OBJECTIVE_FIELDS: Mapping[str, str] = {
    "server/eval/accuracy": "accuracy",
    "server/eval/loss": "loss",
    "accuracy": "accuracy",
    "loss": "loss",
    "wall_s": "wall_s",
    "simulated_s": "simulated_s",
    "updates_per_s": "updates_per_s",
    "upload_bytes": "upload_bytes",
}
"""What an objective may name, by the run summary's field it reads: the final value of a metric the central
evaluation logs (``server/eval/accuracy``), or one of the summary's figures."""

_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MAX_TRIALS = 10_000
"""The most trials a search may have."""
_NO_WRAP = 1 << 30


def parse_objective(objective: str) -> tuple[str, str]:
    """Return the run summary's field and the direction (``max`` or ``min``) of ``KEY:max`` or ``KEY:min``.

    Raises:
        ValueError: The key is not one of :data:`OBJECTIVE_FIELDS`, or the direction is neither ``max`` nor ``min``.
    """
    key, colon, direction = objective.rpartition(":")
    if not colon:
        key, direction = objective, ""
    if key not in OBJECTIVE_FIELDS:
        raise ValueError(f"{key!r} is not a figure a run reports (one of: {', '.join(OBJECTIVE_FIELDS)})")
    if direction not in ("max", "min"):
        raise ValueError(f"the direction must be ':max' or ':min', got {direction!r}")
    return OBJECTIVE_FIELDS[key], direction


def _check_paths(table: Mapping[str, Any], where: str) -> None:
    for key in table:
        if not _FIELD_PATH.fullmatch(key):
            raise _FieldError((SECTION, where, key), "not a dotted field path")


class IntParameter(_Section):
    """An integer drawn from ``low..high`` (both included), every ``step``-th, or log-uniformly."""

    kind: Literal["int"] = "int"
    low: int = Field(description="The smallest value.")
    high: int = Field(description="The largest value (at least low).")
    step: int = Field(1, ge=1, description="The spacing of the values drawn from low (1 with log).")
    log: bool = Field(False, description="Draw log-uniformly (low must be at least 1).")

    @model_validator(mode="after")
    def _range(self) -> IntParameter:
        if self.high < self.low:
            raise ValueError(f"high {self.high} is below low {self.low}")
        if self.log and (self.low < 1 or self.step != 1):
            raise ValueError("log = true needs low >= 1 and step = 1")
        return self


class FloatParameter(_Section):
    """A float drawn uniformly from ``[low, high]``, or log-uniformly, or every ``step`` from ``low``."""

    kind: Literal["float"] = "float"
    low: float = Field(description="The smallest value.")
    high: float = Field(description="The largest value (at least low).")
    log: bool = Field(False, description="Draw log-uniformly (low must be above 0).")
    step: float | None = Field(None, gt=0.0, description="Draw only low + k * step (not with log).")

    @model_validator(mode="after")
    def _range(self) -> FloatParameter:
        if self.high < self.low:
            raise ValueError(f"high {self.high} is below low {self.low}")
        if self.log and (self.low <= 0 or self.step is not None):
            raise ValueError("log = true needs low > 0 and no step")
        return self


Choice = bool | int | float | str | list[Any]


class CategoricalParameter(_Section):
    """One of ``choices`` (each a value as a ``--set`` would give it: a string, a number, a bool or a list)."""

    kind: Literal["categorical"] = "categorical"
    choices: list[Choice] = Field(min_length=1, description="The values to choose from (at least one, distinct).")

    @field_validator("choices")
    @classmethod
    def _distinct(cls, choices: list[Choice]) -> list[Choice]:
        seen: list[Choice] = []
        for choice in choices:
            if choice in seen:
                raise ValueError(f"{choice!r} is listed twice")
            seen.append(choice)
        return choices


SearchParameter = Annotated[IntParameter | FloatParameter | CategoricalParameter, Field(discriminator="kind")]
"""One field's search space, chosen by ``kind``: ``int``, ``float`` or ``categorical``."""


class SearchConfig(_Section):
    """A search: Optuna draws ``trials`` points from ``space``, each run's objective guiding the next draws."""

    sampler: Literal["tpe", "random"] = Field(
        "tpe", description="Optuna's sampler: 'tpe' (Tree-structured Parzen Estimator) or 'random'."
    )
    trials: int = Field(ge=1, le=MAX_TRIALS, description="How many runs the search makes, in all.")
    seed: int = Field(
        0, ge=0, lt=2**63, description="The sampler's seed: the same seed and results give the same trials."
    )
    space: dict[str, SearchParameter] = Field(
        min_length=1, description="Each config field searched (a dotted path) and its space."
    )

    @field_validator("space")
    @classmethod
    def _paths(cls, space: dict[str, Any]) -> dict[str, Any]:
        for key in space:
            if not _FIELD_PATH.fullmatch(key):
                raise ValueError(f"{key!r} is not a dotted field path")
        return space


class SweepConfig(_Section):
    """``flasync sweep``'s settings: a grid or a search, fixed settings, parallelism and the objective."""

    grid: dict[str, list[Choice] | str] = Field(
        default_factory=dict,
        description=(
            "Each field swept (a dotted path) and its values: a list, or a text as --grid takes it "
            "('0..4', 'fedavg,fedbuff'). The runs are every combination."
        ),
    )
    search: SearchConfig | None = Field(None, description="A search instead of a grid (Optuna).")
    parallel: int = Field(1, ge=1, le=1024, description="Runs at once, in as many worker processes.")
    objective: str = Field(
        "server/eval/accuracy:max",
        description="KEY:max or KEY:min: what the best run is chosen by and a search optimizes.",
    )
    set: dict[str, Any] = Field(
        default_factory=dict, description="Fields set in every run (dotted path = value), as --set sets them."
    )

    @field_validator("objective")
    @classmethod
    def _objective(cls, objective: str) -> str:
        parse_objective(objective)
        return objective

    @model_validator(mode="after")
    def _one_kind(self) -> SweepConfig:
        for key, values in self.grid.items():
            if not _FIELD_PATH.fullmatch(key):
                raise _FieldError((SECTION, "grid", key), "not a dotted field path")
            if isinstance(values, list) and not values:
                raise _FieldError((SECTION, "grid", key), "no values")
        _check_paths(self.set, "set")
        if self.grid and self.search is not None:
            raise _FieldError((SECTION, "search"), "a sweep is a grid or a search, not both (drop sweep.grid)")
        return self


def sweep_section(data: dict[str, Any]) -> SweepConfig | None:
    """Remove the ``[sweep]`` table from a config's plain mapping and return it validated (None: there is none).

    Raises:
        ConfigError: One line naming the wrong entry (``sweep.search.trials: ...``).
    """
    from flasync.config.loading import format_validation_error

    raw = data.pop(SECTION, None)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{SECTION}: must be a table, got {type(raw).__name__}")
    try:
        return SweepConfig.model_validate(raw)
    except ValidationError as exc:
        message = format_validation_error(exc, raw, model=SweepConfig)
        raise ConfigError(message if message.startswith(f"{SECTION}.") else f"{SECTION}.{message}") from None


def value_text(value: Any) -> str:
    """Return a value as a ``--set`` text that parses back to it (``fedavg``, ``3``, ``1.0e-05``, ``[64, 64]``).

    Raises:
        ConfigError: The value is a float that is not finite.
    """
    import yaml

    from flasync.config.loading import safe_yaml

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{value!r}: a swept value must be finite")
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        # PyYAML reads a float only with a dot in its mantissa: 1e-05 would be the text "1e-05".
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str):
        try:
            parsed = safe_yaml(value) if value.strip() else None
        except (yaml.YAMLError, ValueError):
            parsed = None
        if parsed == value:
            return value
        return yaml.safe_dump(value, default_style='"', allow_unicode=True, width=_NO_WRAP).strip()
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=_NO_WRAP)
    return text.removesuffix("\n...\n").strip()
