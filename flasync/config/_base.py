"""The base every configuration section derives from, and the error a cross-field check raises."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class _Section(BaseModel):
    # Infinity and NaN are refused wherever a number is read (a bandwidth may be infinite: an instant link).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _default_kinds(cls, data: Any) -> Any:
        """Give a partial component table the default component's ``kind`` (``--set model.hidden=[32]``)."""
        if not isinstance(data, Mapping):
            return data
        filled: dict[str, Any] | None = None
        for name, info in cls.model_fields.items():
            value = data.get(name)
            default = info.default
            if isinstance(value, Mapping) and "kind" not in value and isinstance(default, BaseModel):
                kind = getattr(default, "kind", None)
                if kind is not None:
                    filled = filled if filled is not None else dict(data)
                    filled[name] = {"kind": kind, **value}
        return data if filled is None else filled


class _FieldError(ValueError):
    """A cross-field check that knows which field is wrong."""

    def __init__(self, loc: tuple[str, ...], message: str) -> None:
        super().__init__(f"{'.'.join(loc)}: {message}")
        self.loc = loc
        self.message = message
