"""What crosses the wire: the codec stages and their pipeline per direction."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from flasync.config._base import _FieldError, _Section


class Float16Stage(_Section):
    """Values as IEEE half precision."""

    kind: Literal["fp16"] = "fp16"


class BFloat16Stage(_Section):
    """Values as bfloat16."""

    kind: Literal["bf16"] = "bf16"


class Int8Stage(_Section):
    """Values as int8 with a float32 scale per tensor (``chunk`` unset) or per chunk; stochastic rounding."""

    kind: Literal["int8"] = "int8"
    chunk: int | None = Field(
        None, ge=1, description="Values per float32 scale (None: one scale for the whole vector)."
    )
    stochastic: bool = Field(True, description="Round stochastically (unbiased) rather than to nearest.")


class TopKStage(_Section):
    """Keep the ``ratio`` largest-magnitude values; the rest goes to the client's error-feedback residual."""

    kind: Literal["topk"] = "topk"
    ratio: float = Field(0.01, gt=0.0, le=1.0, description="Share of the values sent.")
    error_feedback: bool = Field(
        True, description="Keep what is not sent in the client's residual and add it to its next update."
    )


class RandomKStage(_Section):
    """Keep a random ``ratio`` of the values."""

    kind: Literal["randomk"] = "randomk"
    ratio: float = Field(0.01, gt=0.0, le=1.0, description="Share of the values sent.")
    error_feedback: bool = Field(
        True, description="Keep what is not sent in the client's residual and add it to its next update."
    )


CodecStage = Annotated[Float16Stage | BFloat16Stage | Int8Stage | TopKStage | RandomKStage, Field(discriminator="kind")]
_SPARSIFIERS = (TopKStage, RandomKStage)
_VALUE_ENCODERS = (Float16Stage, BFloat16Stage, Int8Stage)


class CodecConfig(_Section):
    """What crosses the wire: a pipeline of stages per direction (empty = dense float32, lossless).

    An upload pipeline is at most one sparsifier (``topk``/``randomk``) first, then at most one value encoder
    (``fp16``/``bf16``/``int8``). Downloads take a value encoder only (the model is dense).
    """

    upload: tuple[CodecStage, ...] = ()
    download: tuple[CodecStage, ...] = ()
    max_residuals_in_memory: int = Field(
        1024, ge=1, description="Error-feedback residuals kept in memory; older ones spill to disk."
    )
    residual_dir: str | None = Field(None, description="Where residuals spill (default: a temporary folder).")

    @model_validator(mode="after")
    def _stage_order(self) -> CodecConfig:
        for direction, stages in (("upload", self.upload), ("download", self.download)):
            sparsifiers = [i for i, st in enumerate(stages) if isinstance(st, _SPARSIFIERS)]
            encoders = [i for i, st in enumerate(stages) if isinstance(st, _VALUE_ENCODERS)]
            if direction == "download" and sparsifiers:
                raise _FieldError(("codec", "download"), "only fp16, bf16 and int8 stages apply to downloads")
            if len(sparsifiers) > 1 or (sparsifiers and sparsifiers[0] != 0):
                raise _FieldError(("codec", direction), "at most one topk/randomk stage, and it must come first")
            if len(encoders) > 1 or (encoders and encoders[0] != len(stages) - 1):
                raise _FieldError(("codec", direction), "at most one fp16/bf16/int8 stage, and it must come last")
        return self
