"""What a run learns (``task``), and the checks of the other sections against it.

``task = "classification"`` (the default) trains a classifier with cross-entropy on integer labels. ``task =
"regression"`` trains a model with one output to a real target with the mean squared error, on data whose targets
are real numbers (``data.kind = "diabetes"``, or a given data set with float32 targets: the run refuses other data
when it loads it); its evaluations report the mean squared error as their loss, and ``eval.metrics`` may add ``mse``
and ``mae``. ``task = "language_model"`` predicts the next character of a UTF-8 ``.txt`` file (``data.kind =
"files"``, :mod:`flasync.data.text`) with a GRU (``model.kind = "gru"``), clients holding blocks of lines
(``partition.kind = "line_blocks"``); its central evaluation adds the perplexity.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

from flasync.config._base import _FieldError
from flasync.config.data import (
    ByColumnPartition,
    DataSource,
    DiabetesData,
    DirichletPartition,
    FilesData,
    LineBlocksPartition,
    PartitionConfig,
    ShardsPartition,
)
from flasync.config.model import GRUModel, ModelConfig
from flasync.config.runtime import (
    EvalConfig,
    ExecutorConfig,
    RemoteConfig,
    StopConfig,
    check_metric_names,
    parse_select,
)

__all__ = ["CLASSIFICATION_METRICS", "Task", "check_task", "check_task_model_kind"]

Task = Literal["classification", "regression", "language_model"]
"""What a run learns: class labels (cross-entropy), a real target (mean squared error), or the next character of a
text (cross-entropy over the characters; perplexity)."""

CLASSIFICATION_METRICS = frozenset({"accuracy", "precision", "recall", "f1", "auc"})
"""The built-in metrics that need class labels."""


class _TaskSections(Protocol):
    """The sections of a run's config a task is checked against (:class:`~flasync.config.RunConfig` has them)."""

    @property
    def task(self) -> Task: ...
    @property
    def data(self) -> DataSource: ...
    @property
    def partition(self) -> PartitionConfig: ...
    @property
    def eval(self) -> EvalConfig: ...
    @property
    def stop(self) -> StopConfig: ...
    @property
    def executor(self) -> ExecutorConfig: ...
    @property
    def remote(self) -> RemoteConfig: ...
    @property
    def model(self) -> ModelConfig: ...


def check_task(config: _TaskSections) -> None:
    """Refuse the sections of ``config`` that do not fit its ``task``, naming the field.

    Raises:
        _FieldError: Regression data with a classification task, or, for a regression task: a partition by label,
            a classification metric named in ``eval.metrics`` or ``eval.select``, a target accuracy, the vectorized
            executor or remote clients.
    """
    text = isinstance(config.data, FilesData) and config.data.text
    if config.task != "language_model":
        if text:
            raise _FieldError(
                ("data", "train"), "a .txt file makes next-character samples; it needs task = 'language_model'"
            )
        if isinstance(config.partition, LineBlocksPartition):
            raise _FieldError(("partition", "kind"), "'line_blocks' cuts a .txt file; it needs task = 'language_model'")
        if isinstance(config.model, GRUModel):
            raise _FieldError(("model", "kind"), "'gru' reads characters; it needs task = 'language_model'")
    if config.task == "classification":
        if isinstance(config.data, DiabetesData):
            raise _FieldError(("data", "kind"), "'diabetes' has real targets; it needs task = 'regression'")
        return
    if config.task == "language_model":
        _check_language_model(config, text=text)
        return
    _check_regression(config)


def check_task_model_kind(data: object) -> None:
    """Refuse, in a config that failed validation (a mapping), a model kind its task cannot train: ``task =
    'language_model'`` with another model than ``gru``, whose table may lack what the GRU's holds (``--set
    model.kind=mlp`` on a GRU's table is named as such, not as ``model.hidden: ...``).

    Raises:
        _FieldError: Naming ``model.kind``.
    """
    if not isinstance(data, Mapping):
        return
    model = data.get("model")
    kind = model.get("kind") if isinstance(model, Mapping) else None
    if not isinstance(kind, str):
        return
    task = data.get("task", "classification")
    if task == "language_model" and kind != "gru":
        raise _FieldError(("model", "kind"), f"task = 'language_model' needs 'gru', not {kind!r}")


def _check_language_model(config: _TaskSections, *, text: bool) -> None:
    """Refuse what a character-level language model cannot have."""
    if not text:
        raise _FieldError(("data", "kind"), "task = 'language_model' needs data.kind = 'files' with a .txt train file")
    if not isinstance(config.model, GRUModel):
        raise _FieldError(("model", "kind"), f"task = 'language_model' needs 'gru', not {config.model.kind!r}")
    if isinstance(config.partition, ByColumnPartition):
        raise _FieldError(("partition", "kind"), "a .txt file has no client column; use 'line_blocks' or 'iid'")
    if config.executor.kind == "vectorized":
        raise _FieldError(
            ("executor", "kind"), "'vectorized' cannot batch a GRU's clients; task = 'language_model' runs on 'thread'"
        )
    if config.remote.enabled:
        raise _FieldError(("remote", "enabled"), "task = 'language_model' trains in-process clients only")


def _check_regression(config: _TaskSections) -> None:
    """Refuse what a regression run cannot have (see :func:`check_task`)."""
    if isinstance(config.partition, DirichletPartition | ShardsPartition):
        raise _FieldError(
            ("partition", "kind"),
            f"{config.partition.kind!r} splits by class label; task = 'regression' needs 'iid' (or 'by_column')",
        )
    if "metrics" in config.eval.model_fields_set:
        for name in check_metric_names(config.eval.metrics):
            if name in CLASSIFICATION_METRICS:
                raise _FieldError(
                    ("eval", "metrics"), f"{name!r} needs class labels; task = 'regression' has loss (MSE), mse, mae"
                )
    select = config.eval.select
    if select is not None and CLASSIFICATION_METRICS.intersection(parse_select(select)[0].split("/")):
        raise _FieldError(("eval", "select"), f"{select!r} needs class labels; select by a regression metric")
    if config.stop.target_accuracy is not None:
        raise _FieldError(("stop", "target_accuracy"), "task = 'regression' has no accuracy")
    if config.executor.kind == "vectorized":
        raise _FieldError(
            ("executor", "kind"), "'vectorized' trains classifiers only; task = 'regression' runs on 'thread' or 'ray'"
        )
    if config.remote.enabled:
        raise _FieldError(("remote", "enabled"), "task = 'regression' trains in-process clients only")
