"""Local training on one client or a vectorized cohort, the models, the jobs and the executors."""

from flasync.training.local import (
    EvalResult,
    FlatModel,
    LocalObjective,
    LocalResult,
    LocalTraining,
    evaluate,
    flat_parameters,
    train,
)

__all__ = [
    "EvalResult",
    "FlatModel",
    "LocalObjective",
    "LocalResult",
    "LocalTraining",
    "evaluate",
    "flat_parameters",
    "train",
]
