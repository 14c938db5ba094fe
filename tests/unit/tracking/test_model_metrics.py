"""Linking a run's evaluation metrics to a logged model, on a real SQLite store."""

from __future__ import annotations

import math
import sys

import mlflow
import pytest
import structlog
import structlog.testing
from mlflow.entities import Metric

from flasync.tracking import IdleChild, MetricRow, MlflowTracker
from flasync.tracking.model_metrics import link_evaluation, link_models, logged_model_id
from flasync.tracking.sqlite_metrics import SqliteMetrics
from tests.conftest import ready_models


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


def _reader(tracking_uri: str, direct: bool) -> SqliteMetrics | None:
    """Return the store's SQLite reader when ``direct``, else None (the points are read through the client)."""
    if not direct:
        return None
    reader = SqliteMetrics.open(tracking_uri)
    assert reader is not None
    return reader


THROUGH = pytest.mark.parametrize("direct", [False, True], ids=["client", "sqlite"])


@THROUGH
def test_linking_gives_the_model_the_evaluation_points_and_leaves_the_run_series_alone(
    tracking_uri: str, direct: bool
) -> None:
    """Every finite evaluation point is linked to the model, the training figure is not, and the run's series hold
    each point once, even linked twice; read through the client or straight from the SQLite store."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    before = {key: _series(client, run_id, key) for key in ("server/eval/accuracy", "client/train_s")}
    model = client.create_logged_model(experiment, name="model", source_run_id=run_id)
    reader = _reader(tracking_uri, direct)
    assert link_evaluation(client, run_id, model.model_id, direct=reader) == 3
    assert link_evaluation(client, run_id, model.model_id, direct=reader) == 3
    linked = sorted((m.key, m.step, m.value, m.timestamp) for m in client.get_logged_model(model.model_id).metrics)
    assert linked == [
        ("client_eval/accuracy/mean", 3, 0.5, 1_003),
        ("server/eval/accuracy", 1, 0.25, 1_000),
        ("server/eval/accuracy", 3, 0.75, 1_002),
    ]
    assert {key: _series(client, run_id, key) for key in before} == before
    assert client.get_run(run_id).data.metrics["server/eval/accuracy"] == 0.75


@THROUGH
def test_a_step_links_only_that_version_s_points(tracking_uri: str, direct: bool) -> None:
    """With a step, only the points of that step are linked (the best version's evaluation)."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    model = client.create_logged_model(experiment, name="best_model", source_run_id=run_id)
    assert link_evaluation(client, run_id, model.model_id, step=1, direct=_reader(tracking_uri, direct)) == 1
    assert [(m.key, m.step) for m in client.get_logged_model(model.model_id).metrics] == [("server/eval/accuracy", 1)]


def test_the_model_id_is_that_of_the_run_s_ready_model_of_the_name(tracking_uri: str) -> None:
    """Only a READY logged model of the run with that name is found."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    pending = client.create_logged_model(experiment, name="model", source_run_id=run_id)
    assert logged_model_id(client, run_id, "model") is None
    client.finalize_logged_model(pending.model_id, "READY")
    assert logged_model_id(client, run_id, "model") == pending.model_id
    assert logged_model_id(client, run_id, "best_model") is None


def test_the_model_id_is_that_of_the_latest_ready_model_of_the_name(tracking_uri: str) -> None:
    """Of several READY models of the run with one name (a resumed run logs its model again), the one created last
    is found; one still pending is not."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    made = ready_models(client, experiment, run_id, "model")
    assert logged_model_id(client, run_id, "model") == made[-1].model_id


def test_the_store_s_reader_gives_the_points_the_client_reads(tracking_uri: str) -> None:
    """SqliteMetrics.points gives, in one query, the finite points of the series a prefix names (infinities as
    MLflow stores them, a ``_`` of a prefix no wildcard), of one step or all, as get_metric_history has them."""
    client, run_id, _ = _run_with_series(tracking_uri)
    extra = [
        Metric("server/eval/loss", float("inf"), 1_005, 3),
        Metric("server/eval/loss", float("-inf"), 1_006, 4),
        Metric("clientxeval/accuracy", 1.0, 1_007, 3),
    ]
    client.log_batch(run_id, metrics=extra, synchronous=True)
    reader = SqliteMetrics.open(tracking_uri)
    assert reader is not None
    prefixes = ("server/eval/", "client_eval/")
    keys = sorted(key for key in client.get_run(run_id).data.metrics if key.startswith(prefixes))
    for step in (None, 3):
        history = [
            (m.key, m.value, m.timestamp, m.step)
            for key in keys
            for m in client.get_metric_history(run_id, key)
            if (step is None or m.step == step) and not math.isnan(m.value)
        ]
        assert reader.points(run_id, prefixes, step) == sorted(history, key=lambda row: (row[0], row[2], row[3]))
    assert ("server/eval/loss", sys.float_info.max, 1_005, 3) in reader.points(run_id, prefixes, 3)
    assert reader.points(run_id, prefixes, 7) == []


def test_a_model_id_the_caller_knows_is_linked_as_given(tracking_uri: str) -> None:
    """link_models links the points to the model id the caller gives for a name (the model it logged) without
    searching the store: here a model still pending, which a search would not find."""
    client, run_id, experiment = _run_with_series(tracking_uri)
    pending = client.create_logged_model(experiment, name="model", source_run_id=run_id)
    assert link_models(client, run_id, {"model": 3}) == 0
    assert link_models(client, run_id, {"model": 3}, logged={"model": pending.model_id}) == 2
    held = sorted((m.key, m.step) for m in client.get_logged_model(pending.model_id).metrics)
    assert held == [("client_eval/accuracy/mean", 3), ("server/eval/accuracy", 3)]


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
