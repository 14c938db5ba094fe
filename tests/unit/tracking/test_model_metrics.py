"""Linking a run's evaluation metrics to a logged model, on a real SQLite store."""

from __future__ import annotations

import mlflow
import pytest
import structlog
import structlog.testing
from mlflow.entities import Metric

from flasync.tracking import IdleChild, MetricRow, MlflowTracker
from flasync.tracking.model_metrics import link_evaluation, link_models, logged_model_id


def _run_with_series(tracking_uri: str) -> tuple[mlflow.MlflowClient, str, str]:
    """Return a client, a run holding an evaluation series (a NaN point among them) and one training figure, and
    its experiment."""
    client = mlflow.MlflowClient(tracking_uri)
    experiment = client.create_experiment(f"links-{len(client.search_experiments())}")
    run_id = client.create_run(experiment).info.run_id
    points = [
        Metric("server/eval/accuracy", 0.25, 1_000, 1),
        Metric("server/eval/accuracy", float("nan"), 1_001, 2),
        Metric("server/eval/accuracy", 0.75, 1_002, 3),
        Metric("client_eval/accuracy/mean", 0.5, 1_003, 3),
        Metric("client/train_s", 1.5, 1_004, 3),
    ]
    client.log_batch(run_id, metrics=points, synchronous=True)
    return client, run_id, experiment


def _series(client: mlflow.MlflowClient, run_id: str, key: str) -> list[tuple[int, str, int]]:
    """Return the run's points of ``key`` as (step, value's repr, timestamp): NaN compares equal as a string."""
    return [(m.step, repr(m.value), m.timestamp) for m in client.get_metric_history(run_id, key)]


def test_linking_gives_the_model_the_evaluation_points_and_leaves_the_run_series_alone(tracking_uri: str) -> None:
    """Every finite evaluation point is linked to the model, the training figure is not, and the run's series hold
    each point once, even linked twice."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    before = {key: _series(client, run_id, key) for key in ("server/eval/accuracy", "client/train_s")}
    model = client.create_logged_model(experiment, name="model", source_run_id=run_id)
    assert link_evaluation(client, run_id, model.model_id) == 3
    assert link_evaluation(client, run_id, model.model_id) == 3
    linked = sorted((m.key, m.step, m.value, m.timestamp) for m in client.get_logged_model(model.model_id).metrics)
    assert linked == [
        ("client_eval/accuracy/mean", 3, 0.5, 1_003),
        ("server/eval/accuracy", 1, 0.25, 1_000),
        ("server/eval/accuracy", 3, 0.75, 1_002),
    ]
    assert {key: _series(client, run_id, key) for key in before} == before
    assert client.get_run(run_id).data.metrics["server/eval/accuracy"] == 0.75


def test_a_step_links_only_that_version_s_points(tracking_uri: str) -> None:
    """With a step, only the points of that step are linked (the best version's evaluation)."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    model = client.create_logged_model(experiment, name="best_model", source_run_id=run_id)
    assert link_evaluation(client, run_id, model.model_id, step=1) == 1
    assert [(m.key, m.step) for m in client.get_logged_model(model.model_id).metrics] == [("server/eval/accuracy", 1)]


def test_the_model_id_is_that_of_the_run_s_ready_model_of_the_name(tracking_uri: str) -> None:
    """Only a READY logged model of the run with that name is found."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    pending = client.create_logged_model(experiment, name="model", source_run_id=run_id)
    assert logged_model_id(client, run_id, "model") is None
    client.finalize_logged_model(pending.model_id, "READY")
    assert logged_model_id(client, run_id, "model") == pending.model_id
    assert logged_model_id(client, run_id, "best_model") is None


def test_link_models_links_each_named_model_at_its_step(tracking_uri: str) -> None:
    """Each ready model named gets the points of its step; a name without a ready model links nothing."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    last = client.create_logged_model(experiment, name="model", source_run_id=run_id)
    client.finalize_logged_model(last.model_id, "READY")
    assert link_models(client, run_id, {"model": 3, "best_model": 1}) == 2
    held = sorted((m.key, m.step) for m in client.get_logged_model(last.model_id).metrics)
    assert held == [("client_eval/accuracy/mean", 3), ("server/eval/accuracy", 3)]


@pytest.mark.slow
@pytest.mark.parametrize("writer_process", [False, True], ids=["this process", "writer process"])
def test_a_tracker_links_its_run_s_models_where_it_writes(tracking_uri: str, writer_process: bool) -> None:
    """MlflowTracker.link_models links the run's stored evaluation to its model, from this process or from the
    writer process, once the metrics are flushed."""
    tracker = MlflowTracker(tracking_uri, writer_process=writer_process, idle_writers=IdleChild())
    run_id = tracker.start(experiment=f"tracker-links-{writer_process}")
    tracker.log_metrics([MetricRow("server/eval/accuracy", 0.5, 1_000, 4), MetricRow("client/loss", 1.0, 1_000, 4)])
    assert tracker.flush()
    client = mlflow.MlflowClient(tracking_uri)
    model = client.create_logged_model(client.get_run(run_id).info.experiment_id, name="model", source_run_id=run_id)
    client.finalize_logged_model(model.model_id, "READY")
    try:
        with structlog.testing.capture_logs() as logs:
            assert tracker.link_models({"model": 4}) == 1
    finally:
        tracker.finish("FINISHED")
    assert not [e for e in logs if e["event"] == "tracking.writer_process_job_failed"], logs  # no fallback
    assert [(m.key, m.step) for m in client.get_logged_model(model.model_id).metrics] == [("server/eval/accuracy", 4)]
