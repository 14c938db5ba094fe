"""Tasks beyond classification in whole runs: a regression trains, reports its metrics to MLflow, and is exact."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import mlflow
import numpy as np
import pytest

import flasync
from flasync.core.events import ClientEvaluated, Evaluated
from flasync.testing import EventRecorder, small_config

_REGRESSION = (
    "task=regression",
    "data.kind=diabetes",
    "client.lr=0.02",
    "client.batch_size=8",
    "stop.max_versions=24",
)


@pytest.mark.slow
def test_a_regression_trains_and_logs_its_metrics_to_mlflow(store: str) -> None:
    """On diabetes the mean squared error falls well below the mean predictor's (about 1 on standardized targets);
    the central evaluation logs loss (MSE), mse and mae, and no accuracy, to a SQLite MLflow store; the clients'
    evaluations report their MSE too."""
    config = small_config(
        *_REGRESSION,
        "eval.metrics=[loss, mse, mae]",
        "eval.clients.fraction=0.5",
        "tracking.enabled=true",
        f"tracking.uri={store}",
        "tracking.experiment=tasks",
    )
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())

    evaluated = recorder.of(Evaluated)
    first, last = evaluated[0], evaluated[-1]
    assert int(first.version) == 0 and last.loss < 0.8 * first.loss
    assert all(math.isnan(e.accuracy) for e in evaluated)
    for e in evaluated:  # the loss is the MSE; torchmetrics' mse agrees to float rounding
        assert e.metrics["mse"] == pytest.approx(e.loss, rel=1e-5)
        assert 0.0 < e.metrics["mae"] <= math.sqrt(e.metrics["mse"]) + 1e-6
    reports = recorder.of(ClientEvaluated)
    assert reports and all(r.loss >= 0.0 and r.metrics["mse"] == pytest.approx(r.loss, rel=1e-5) for r in reports)

    client = mlflow.MlflowClient(store)
    experiment = client.get_experiment_by_name("tasks")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["task"] == "regression"
    for name in ("loss", "mse", "mae"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"server/eval/{name}"))
        assert [step for step, _ in history] == [int(e.version) for e in evaluated]
        expected = [e.loss if name == "loss" else e.metrics[name] for e in evaluated]
        assert [value for _, value in history] == pytest.approx(expected)
    assert "server/eval/accuracy" not in run.data.metrics
    assert "client_eval/mse/mean" in run.data.metrics
    assert not [key for key in run.data.metrics if "accuracy" in key]
    assert summary.eval_metrics == last.metrics


@pytest.mark.slow
def test_a_regression_run_is_bit_exact() -> None:
    """The same regression config gives the same weights twice, bit for bit (virtual clock, threads)."""
    config = small_config(*_REGRESSION, "stop.max_versions=8", "executor.workers=2")
    first = asyncio.run(flasync.Federation(config).run())
    second = asyncio.run(flasync.Federation(config).run())
    assert first.weights_sha256 == second.weights_sha256
    assert math.isfinite(first.loss)


def _write_text(path: Path, lines: int = 200) -> Path:
    """Write a text of short sentences from a seeded generator: learnable, not memorised from one line."""
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "sun", "hill"]
    text = "\n".join(" ".join(rng.choice(words, size=6)) + "." for _ in range(lines)) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def _language_model(text: Path, *overrides: str) -> flasync.RunConfig:
    return small_config(
        "task=language_model",
        "data.kind=files",
        f"data.train={text}",
        "data.context=8",
        "partition.kind=line_blocks",
        "model.kind=gru",
        "model.embed=16",
        "model.hidden=48",
        "client.epochs=1",
        "client.batch_size=32",
        "client.lr=0.5",
        "client.clip_norm=1.0",
        *overrides,
    )


@pytest.mark.slow
def test_a_character_language_model_trains_on_line_blocks_and_reports_perplexity(tmp_path: Path) -> None:
    """A GRU on a generated text, its lines cut into one block per client: the perplexity the central evaluation
    reports is exp of its loss and falls well below the initial one (about the number of characters); the same
    config gives the same weights twice."""
    config = _language_model(_write_text(tmp_path / "text.txt"), "stop.max_versions=16")
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    summary = asyncio.run(federation.run())
    evaluated = recorder.of(Evaluated)
    first, last = evaluated[0].metrics["perplexity"], evaluated[-1].metrics["perplexity"]
    assert all(e.metrics["perplexity"] == pytest.approx(math.exp(e.loss)) for e in evaluated)
    assert last < 0.5 * first
    assert summary.eval_metrics["perplexity"] == last
    again = asyncio.run(flasync.Federation(config).run())
    assert again.weights_sha256 == summary.weights_sha256
