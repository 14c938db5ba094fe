"""Build the codec pipeline a config's stages describe."""

from __future__ import annotations

from collections.abc import Sequence

from flasync import codecs
from flasync.config import BFloat16Stage, CodecStage, Float16Stage, Int8Stage, RandomKStage, TopKStage

__all__ = ["pipeline"]


def pipeline(stages: Sequence[CodecStage], *, sparse: bool = False) -> codecs.Pipeline:
    """Build the codec pipeline a config's stages describe.

    Args:
        stages: The config's stages.
        sparse: Put a :class:`~flasync.codecs.NonZero` stage first (a pruned model's weights and updates).
    """
    built: list[codecs.Stage] = [codecs.NonZero()] if sparse else []
    for stage in stages:
        if isinstance(stage, Float16Stage):
            built.append(codecs.Float16())
        elif isinstance(stage, BFloat16Stage):
            built.append(codecs.BFloat16())
        elif isinstance(stage, Int8Stage):
            built.append(codecs.Int8(chunk=stage.chunk, stochastic=stage.stochastic))
        elif isinstance(stage, TopKStage):
            built.append(codecs.TopK(ratio=stage.ratio, error_feedback=stage.error_feedback))
        elif isinstance(stage, RandomKStage):
            built.append(codecs.RandomK(ratio=stage.ratio, error_feedback=stage.error_feedback))
        else:  # pragma: no cover - the config's union is closed
            raise TypeError(f"unknown codec stage {stage!r}")
    return codecs.Pipeline(built)
