"""Evaluation metrics: the built-in ones by name (torchmetrics), and a user's own through the :class:`Metric` protocol.

``eval.metrics`` names what an evaluation computes besides accuracy and mean cross-entropy, which every evaluation
logs (they are exact counts, :func:`flasync.training.local.evaluate`). A metric sees every batch of the evaluated
split: ``update(preds, targets)`` with the model's outputs ``(N, C)`` (float32 logits, on the model's device) and the
labels ``(N,)``, then ``compute()`` once. A fresh instance is made for every evaluation, in the worker thread that runs
it, so an instance never sees two evaluations or two threads.

Built-in names:

============  =====================================================================  ==============
name          what                                                                   data
============  =====================================================================  ==============
``accuracy``  share of samples whose arg-max output is the label (always logged)     any
``loss``      mean cross-entropy (always logged)                                     any
``precision`` macro-averaged precision (``torchmetrics`` ``MulticlassPrecision``)    classification
``recall``    macro-averaged recall (``MulticlassRecall``)                           classification
``f1``        macro-averaged F1 score (``MulticlassF1Score``)                        classification
``auc``       area under the ROC curve of class 1's probability (``BinaryAUROC``)    two classes
``mse``       mean squared error of the single output (``MeanSquaredError``)         regression
``mae``       mean absolute error of the single output (``MeanAbsoluteError``)       regression
============  =====================================================================  ==============

A user's metric is ``"NAME=module:attribute"``: ``attribute`` is a class (or any callable without arguments)
returning an object with ``update(preds, targets)`` and ``compute()``; its figure is logged as ``NAME``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from flasync.config.runtime import ALWAYS_METRICS as ALWAYS
from flasync.config.runtime import check_metric_names
from flasync.core.errors import ConfigError

__all__ = [
    "ALWAYS",
    "BUILTIN_METRICS",
    "Metric",
    "MetricFactory",
    "MetricSet",
    "Tally",
    "resolve_metrics",
]


@runtime_checkable
class Metric(Protocol):
    """A figure accumulated over an evaluation's batches (torchmetrics' ``Metric`` is one)."""

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        """Take one batch: the model's outputs ``(N, C)`` (float32 logits) and the labels ``(N,)``."""
        ...

    def compute(self) -> float | torch.Tensor:
        """Return the figure over every batch taken (a float or a tensor of one element)."""
        ...


MetricFactory = Callable[[], Metric]
"""Make a fresh :class:`Metric` (one per evaluation)."""


@dataclass(frozen=True, slots=True)
class _Builtin:
    """A built-in metric: what data it needs, and the torchmetrics class with its arguments (``num_classes``: filled
    in with the data's classes)."""

    data: str  # "classification", "binary" or "regression"
    module: str  # torchmetrics' submodule
    cls: str
    args: tuple[tuple[str, object], ...] = ()
    probability: bool = False  # fed class 1's softmax probability rather than the logits

    def make(self, num_classes: int) -> Metric:
        """Return a fresh instance (torchmetrics is imported here: it takes seconds, and most runs need none)."""
        namespace = importlib.import_module(f"torchmetrics.{self.module}")
        kwargs = {key: (num_classes if value is _CLASSES else value) for key, value in self.args}
        metric: Metric = getattr(namespace, self.cls)(**kwargs)
        return metric


_CLASSES = object()
_MACRO = (("num_classes", _CLASSES), ("average", "macro"))
BUILTIN_METRICS: Mapping[str, _Builtin] = {
    "precision": _Builtin("classification", "classification", "MulticlassPrecision", _MACRO),
    "recall": _Builtin("classification", "classification", "MulticlassRecall", _MACRO),
    "f1": _Builtin("classification", "classification", "MulticlassF1Score", _MACRO),
    "auc": _Builtin("binary", "classification", "BinaryAUROC", probability=True),
    "mse": _Builtin("regression", "regression", "MeanSquaredError"),
    "mae": _Builtin("regression", "regression", "MeanAbsoluteError"),
}
"""The built-in metrics besides :data:`ALWAYS`, by name (the names ``eval.metrics`` accepts)."""


@dataclass(frozen=True, slots=True)
class MetricSet:
    """The metrics an evaluation computes besides accuracy and loss, ready to make fresh per evaluation.

    Args:
        names: Their names, in the order of ``eval.metrics``.
        factories: Make each one on a device.
        probability: For each, whether it takes class 1's probability rather than the logits (``auc``).
    """

    names: tuple[str, ...] = ()
    factories: tuple[Callable[[torch.device], Metric], ...] = ()
    probability: tuple[bool, ...] = ()

    def __bool__(self) -> bool:
        """Tell whether there is any metric to compute."""
        return bool(self.names)

    def tally(self, device: torch.device) -> Tally:
        """Return fresh instances of the metrics on ``device`` for one evaluation."""
        return Tally(self, tuple(make(device) for make in self.factories))


class Tally:
    """One evaluation's metrics: fed batch after batch, computed once.

    Args:
        metrics: The set they come from.
        instances: One fresh instance of each.
    """

    __slots__ = ("instances", "metrics")

    def __init__(self, metrics: MetricSet, instances: Sequence[Metric]) -> None:
        """Bind the instances."""
        self.metrics = metrics
        self.instances = tuple(instances)

    def update(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Feed one batch of outputs ``(N, C)`` and labels ``(N,)`` to every metric."""
        probability: torch.Tensor | None = None
        for metric, wants_probability in zip(self.instances, self.metrics.probability, strict=True):
            if wants_probability:
                if probability is None:
                    probability = torch.softmax(logits, dim=1)[:, 1]
                metric.update(probability, targets)
            else:
                metric.update(logits, targets)

    def compute(self) -> dict[str, float]:
        """Return every metric's figure by name (a metric whose figure is not one number: an error naming it)."""
        out: dict[str, float] = {}
        for name, metric in zip(self.metrics.names, self.instances, strict=True):
            value = metric.compute()
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise ValueError(f"metric {name!r} computed {value.numel()} values, not one")
                value = value.item()
            out[name] = float(value)
        return out


def resolve_metrics(entries: Iterable[str], *, num_classes: int, regression_task: bool = False) -> MetricSet:
    """Return the :class:`MetricSet` of ``eval.metrics`` for a task (user metrics imported here).

    Args:
        entries: ``eval.metrics``.
        num_classes: Classes of the data (outputs of the model).
        regression_task: Whether the model predicts one number per sample rather than class logits.

    Raises:
        ConfigError: A name is unknown, a metric does not fit the task (``auc`` needs two classes, ``mse`` and
            ``mae`` a regression task, the classification metrics a classification task), or a user's metric
            cannot be imported or does not make a :class:`Metric`.
    """
    entries = tuple(entries)
    try:
        check_metric_names(entries)
    except ValueError as exc:
        raise ConfigError(f"eval.metrics: {exc}") from None
    names: list[str] = []
    factories: list[Callable[[torch.device], Metric]] = []
    probability: list[bool] = []
    for entry in entries:
        name, eq, target = entry.partition("=")
        name = name.strip()
        if name in ALWAYS:
            continue
        if eq:
            factories.append(_user_factory(name, target.strip()))
            probability.append(False)
        else:
            builtin = BUILTIN_METRICS[name]
            _check_fits(name, builtin.data, num_classes=num_classes, regression_task=regression_task)
            factories.append(_builtin_factory(builtin, num_classes))
            probability.append(builtin.probability)
        names.append(name)
    return MetricSet(tuple(names), tuple(factories), tuple(probability))


def _check_fits(name: str, data: str, *, num_classes: int, regression_task: bool) -> None:
    if data == "regression" and not regression_task:
        raise ConfigError(
            f"eval.metrics: {name!r} needs a regression task, but the model predicts {num_classes} classes"
        )
    if data != "regression" and regression_task:
        raise ConfigError(f"eval.metrics: {name!r} needs a classification task, but the model predicts one number")
    if data == "binary" and num_classes != 2:
        raise ConfigError(f"eval.metrics: {name!r} needs two classes, but the data has {num_classes}")


def _builtin_factory(builtin: _Builtin, num_classes: int) -> Callable[[torch.device], Metric]:
    def make(device: torch.device) -> Metric:
        metric: Any = builtin.make(num_classes)
        moved: Metric = metric.to(device)
        return moved

    return make


def _user_factory(name: str, target: str) -> Callable[[torch.device], Metric]:
    module_name, _, attribute = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"eval.metrics: {name}={target}: cannot import it ({type(exc).__name__}: {exc})") from None
    if not callable(factory):
        raise ConfigError(f"eval.metrics: {name}={target} is not a class or a function")
    try:
        probe = factory()
    except Exception as exc:
        raise ConfigError(f"eval.metrics: {name}={target}() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(probe, Metric):
        raise ConfigError(f"eval.metrics: {name}={target}() has no update(preds, targets) and compute()")

    def make(device: torch.device) -> Metric:
        metric: Metric = factory()
        return metric

    return make
