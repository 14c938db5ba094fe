"""The regression task's objective, evaluation of a model with one output, and the language model's GRU."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from flasync.training.local import FlatModel, LocalTraining, evaluate, evaluate_segments, flat_parameters, train
from flasync.training.metrics import resolve_metrics
from flasync.training.models import MLP, CharGRU, build
from flasync.training.tasks import SquaredError, task_objective


def _regression(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0]) + 0.1 * torch.randn(n, generator=generator)
    return x, y


def test_squared_error_is_per_sample_and_the_task_picks_it() -> None:
    """The loss is ``(f(x) - y)^2`` per sample; regression gets it unless the caller gives an objective."""
    outputs, targets = torch.tensor([[1.0], [3.0]]), torch.tensor([0.5, 5.0])
    assert torch.equal(SquaredError().loss(outputs, targets), torch.tensor([0.25, 4.0]))
    assert isinstance(task_objective("regression", None), SquaredError)
    assert task_objective("classification", None) is None
    mine = SquaredError()
    assert task_objective("regression", mine) is mine


@pytest.mark.slow
def test_local_training_lowers_the_mean_squared_error_that_evaluate_reports() -> None:
    """SGD on the squared error lowers the MSE; evaluate's loss is the MSE by hand, its accuracy NaN, and the
    metrics see the predictions."""
    torch.manual_seed(0)
    model = FlatModel(MLP(5, (16,), 1))
    x, y = _regression()
    start = model.flat.clone()
    metrics = resolve_metrics(["mse", "mae"], num_classes=1, regression_task=True)
    before = evaluate(model, start, x, y, metrics=metrics, regression=True)
    with torch.no_grad():
        by_hand = float(((model.module(x)[:, 0] - y) ** 2).double().mean())
    assert math.isnan(before.accuracy) and math.isclose(before.loss, by_hand, rel_tol=1e-6)
    assert math.isclose(before.metrics["mse"], by_hand, rel_tol=1e-5)
    cfg = LocalTraining(epochs=20, batch_size=16, lr=0.05, objective=SquaredError())
    result = train(model, start, x, y, cfg, torch.Generator().manual_seed(1))
    after = evaluate(model, start - result.delta, x, y, regression=True)
    assert after.loss < 0.2 * before.loss


def test_segments_give_each_segment_what_evaluate_gives_it() -> None:
    """A regression evaluated in shared batches gives each segment its own MSE."""
    torch.manual_seed(0)
    module = MLP(5, (8,), 1)
    model = FlatModel(module)
    weights = flat_parameters(module)
    x, y = _regression(30)
    results = evaluate_segments(model, weights, x, y, [10, 0, 20], batch_size=7, regression=True)
    alone = [
        evaluate(model, weights, x[:10], y[:10], regression=True),
        None,
        evaluate(model, weights, x[10:], y[10:], regression=True),
    ]
    for got, want in zip(results, alone, strict=True):
        if want is not None:
            assert math.isclose(got.loss, want.loss, rel_tol=1e-6) and math.isnan(got.accuracy)
    assert results[1].num_samples == 0


def test_char_gru_predicts_the_next_character_and_rebuilds_from_flat_weights(tmp_path: Path) -> None:
    """CharGRU maps ids ``(N, context)`` (float or integer) to logits over the characters; ``build`` makes the same
    model from its class name, arguments and flat weights (as MLflow's writer process does)."""
    torch.manual_seed(0)
    model = CharGRU(7, embed=4, hidden=6)
    ids = torch.tensor([[0, 3, 6], [1, 1, 2]])
    logits = model(ids.float())
    assert logits.shape == (2, 7) and torch.equal(logits, model(ids))
    np.save(tmp_path / "w.npy", flat_parameters(model).numpy())
    rebuilt = build("CharGRU", str(tmp_path / "w.npy"), vocabulary=7, embed=4, hidden=6, layers=1)
    assert torch.equal(rebuilt(ids), logits)
