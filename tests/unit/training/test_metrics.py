"""Evaluation metrics: the built-in ones by name, a user's metric through the protocol, and what a task refuses."""

from __future__ import annotations

import pytest
import torch

from flasync.config.runtime import BUILTIN_METRIC_NAMES, check_metric_names
from flasync.core.errors import ConfigError
from flasync.training.local import FlatModel, evaluate, evaluate_segments
from flasync.training.metrics import BUILTIN_METRICS, resolve_metrics
from tests.unit.training.user_metric import Brier

_BRIER = "brier=tests.unit.training.user_metric:Brier"
_CPU = torch.device("cpu")


def _tally(entries: tuple[str, ...], preds: torch.Tensor, targets: torch.Tensor, **task: int | bool) -> dict:
    """Feed ``preds`` and ``targets`` in two batches to the metrics ``entries`` name; return their figures."""
    tally = resolve_metrics(entries, **task).tally(_CPU)  # type: ignore[arg-type]
    half = len(targets) // 2
    tally.update(preds[:half], targets[:half])
    tally.update(preds[half:], targets[half:])
    return tally.compute()


def test_the_built_in_names_are_the_ones_the_config_accepts() -> None:
    """Every built-in metric's name is one eval.metrics accepts, and no other."""
    assert tuple(BUILTIN_METRICS) == BUILTIN_METRIC_NAMES


@pytest.mark.slow
def test_macro_precision_recall_and_f1_match_a_hand_computation() -> None:
    """Macro precision, recall and F1 are the unweighted means over the classes of the per-class figures."""
    targets = torch.tensor([0, 0, 0, 1, 1, 2])
    predicted = torch.tensor([0, 0, 1, 1, 2, 2])
    logits = torch.nn.functional.one_hot(predicted, 3).float()
    # class 0: tp 2, fp 0, fn 1; class 1: tp 1, fp 1, fn 1; class 2: tp 1, fp 1, fn 0
    precision = [2 / 2, 1 / 2, 1 / 2]
    recall = [2 / 3, 1 / 2, 1 / 1]
    f1 = [2 * p * r / (p + r) for p, r in zip(precision, recall, strict=True)]
    got = _tally(("precision", "recall", "f1"), logits, targets, num_classes=3)
    assert got == pytest.approx({"precision": sum(precision) / 3, "recall": sum(recall) / 3, "f1": sum(f1) / 3})


@pytest.mark.slow
def test_auc_ranks_the_probability_of_class_one() -> None:
    """AUC is the share of (positive, negative) pairs the probability of class 1 orders rightly."""
    targets = torch.tensor([0, 0, 1, 1])
    score = torch.tensor([0.1, 0.6, 0.4, 0.9])  # pairs: (0.4 > 0.1) yes, (0.4 > 0.6) no, 0.9 above both
    logits = torch.stack([torch.zeros(4), torch.logit(score)], dim=1)
    assert _tally(("auc",), logits, targets, num_classes=2) == pytest.approx({"auc": 3 / 4})


def test_mse_and_mae_of_a_regression_output() -> None:
    """MSE and MAE compare the single output with the target."""
    preds = torch.tensor([1.0, 2.0, 4.0, 0.0])
    targets = torch.tensor([1.0, 3.0, 2.0, 0.0])
    got = _tally(("mse", "mae"), preds, targets, num_classes=1, regression_task=True)
    assert got == pytest.approx({"mse": (0 + 1 + 4 + 0) / 4, "mae": (0 + 1 + 2 + 0) / 4})


def test_a_user_metric_sees_every_batch() -> None:
    """A user's metric named NAME=module:attribute is fed every batch and logged as NAME."""
    logits = torch.randn(10, 3, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    whole = Brier()
    whole.update(logits, targets)
    assert _tally((_BRIER,), logits, targets, num_classes=3) == pytest.approx({"brier": whole.compute()})


@pytest.mark.parametrize(
    ("entries", "num_classes", "message"),
    [
        (("f2",), 3, "unknown metric 'f2'"),
        (("auc",), 3, "'auc' needs two classes, but the data has 3"),
        (("mse",), 3, "'mse' needs a regression task"),
        (("f1", "f1"), 3, "metric 'f1' is named twice"),
        (("x=no_such_module_here:Metric",), 3, "x=no_such_module_here:Metric: cannot import it"),
        (("x=tests.unit.training.user_metric:NoCompute",), 3, "has no update(preds, targets) and compute()"),
        (("loss=tests.unit.training.user_metric:Brier",), 3, "needs a new lower-case identifier"),
        (("step=tests.unit.training.user_metric:Brier",), 3, "needs a new lower-case identifier"),
        (("brier=tests.unit.training.user_metric",), 3, "NAME=module:attribute"),
    ],
)
def test_a_metric_that_cannot_be_computed_is_refused(entries: tuple[str, ...], num_classes: int, message: str) -> None:
    """A metric unknown, unfit for the task or not importable is a ConfigError naming eval.metrics."""
    with pytest.raises(ConfigError, match=r"eval\.metrics: ") as caught:
        resolve_metrics(entries, num_classes=num_classes)
    assert message in str(caught.value)


def test_accuracy_and_loss_are_always_there_and_add_nothing() -> None:
    """Naming accuracy or loss adds no metric: every evaluation logs them."""
    assert check_metric_names(("accuracy", "loss", "f1")) == ("accuracy", "loss", "f1")
    assert resolve_metrics(("accuracy", "loss", "f1"), num_classes=3).names == ("f1",)
    assert not resolve_metrics(("accuracy", "loss"), num_classes=3)


def test_evaluate_adds_the_metrics_and_keeps_accuracy_and_loss_exact() -> None:
    """evaluate() with metrics returns the same accuracy and loss as without, and each metric over all batches."""
    generator = torch.Generator().manual_seed(1)
    module = torch.nn.Linear(4, 3)
    model = FlatModel(module)
    weights = model.flat.clone()
    x = torch.randn(50, 4, generator=generator)
    y = torch.randint(0, 3, (50,), generator=generator)
    plain = evaluate(model, weights, x, y, batch_size=16)
    with_metrics = evaluate(model, weights, x, y, batch_size=16, metrics=resolve_metrics(("f1", _BRIER), num_classes=3))
    assert (with_metrics.accuracy, with_metrics.loss) == (plain.accuracy, plain.loss)
    assert plain.metrics == {}
    whole = Brier()
    with torch.no_grad():
        whole.update(module(x), y)
    assert with_metrics.metrics["brier"] == pytest.approx(whole.compute())
    assert set(with_metrics.metrics) == {"f1", "brier"}


def test_segments_evaluated_in_shared_batches_match_one_evaluation_each() -> None:
    """evaluate_segments gives each segment what evaluate gives on its rows alone, batches crossing segments."""
    generator = torch.Generator().manual_seed(2)
    model = FlatModel(torch.nn.Linear(4, 3))
    weights = model.flat.clone()
    x = torch.randn(23, 4, generator=generator)
    y = torch.randint(0, 3, (23,), generator=generator)
    sizes = [5, 0, 11, 7]
    metrics = resolve_metrics(("f1", _BRIER), num_classes=3)
    together = evaluate_segments(model, weights, x, y, sizes, batch_size=4, metrics=metrics)
    start = 0
    for size, result in zip(sizes, together, strict=True):
        alone = evaluate(model, weights, x[start : start + size], y[start : start + size], metrics=metrics)
        start += size
        assert (result.num_samples, result.accuracy) == (alone.num_samples, alone.accuracy)
        assert result.loss == pytest.approx(alone.loss)
        assert result.metrics == pytest.approx(alone.metrics)
