"""The child process that writes metric batches to MLflow."""

from __future__ import annotations

import time

import mlflow
import pytest
from mlflow.entities import Metric

from tracking import MlflowTracker
from tracking._child import _EXIT_TIMEOUT_S, ChildLogBatch


def _metrics(key: str, steps: range) -> list[Metric]:
    return [Metric(key, float(step), 1_000 + step, step) for step in steps]


def test_child_writes_batches_to_the_store(tracking_uri: str) -> None:
    """Batches sent to the child are in the store when the call returns."""
    client = mlflow.MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("child-writes")).info.run_id
    child = ChildLogBatch(tracking_uri, run_id)
    try:
        child.wait_ready(60)
        child(_metrics("a", range(5)))
        child(_metrics("a", range(5, 8)))
    finally:
        child.close()
    history = client.get_metric_history(run_id, "a")
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == list(range(8))
    assert not child.alive


def test_child_started_before_its_run_exists(tracking_uri: str) -> None:
    """A child started without a run id imports MLflow at once and connects when bind() names the run."""
    child = ChildLogBatch(tracking_uri)
    try:
        with pytest.raises(RuntimeError, match="no run yet"):
            child(_metrics("early", range(1)))
        client = mlflow.MlflowClient(tracking_uri)
        run_id = client.create_run(client.create_experiment("child-binds")).info.run_id
        child.bind(run_id)
        with pytest.raises(ValueError, match="already"):
            child.bind(run_id)
        child.wait_ready(60)
        child(_metrics("late", range(4)))
    finally:
        child.close()
    assert sorted(m.step for m in client.get_metric_history(run_id, "late")) == [0, 1, 2, 3]


def test_unbound_child_is_stopped_at_once(tracking_uri: str) -> None:
    """Closing a child that never got a run kills it rather than waiting for its imports."""
    child = ChildLogBatch(tracking_uri)
    began = time.monotonic()
    child.close()
    assert not child.alive
    assert time.monotonic() - began < _EXIT_TIMEOUT_S


def test_dead_child_raises_connection_error(tracking_uri: str) -> None:
    """A call after the child died raises ConnectionError (so the caller can keep the batch)."""
    client = mlflow.MlflowClient(tracking_uri)
    run_id = client.create_run(client.create_experiment("child-dies")).info.run_id
    child = ChildLogBatch(tracking_uri, run_id)
    child.wait_ready(60)
    child._process.kill()
    child._process.wait(10)
    with pytest.raises(ConnectionError, match="gone"):
        child(_metrics("b", range(3)))
    child.close()


def test_prepared_tracker_uses_its_early_child(tracking_uri: str) -> None:
    """prepare() starts the writer process before the run exists; start() hands it the run and it writes."""
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    child = tracker._child
    assert child is not None and child.alive
    tracker.prepare()
    assert tracker._child is child  # idempotent
    run_id = tracker.start(experiment="prepared")
    assert tracker._child is child
    tracker.log_metrics(_metrics("p", range(6)))
    tracker.finish("FINISHED")
    assert not child.alive
    client = mlflow.MlflowClient(tracking_uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "p")) == list(range(6))


def test_prepared_tracker_that_never_starts_leaves_nothing(tracking_uri: str) -> None:
    """finish() on a prepared but unstarted tracker stops its writer process and creates no run."""
    client = mlflow.MlflowClient(tracking_uri)
    before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    child = tracker._child
    assert child is not None
    tracker.finish("FAILED")
    assert not child.alive and tracker._child is None and tracker.run_id is None
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == before


def test_tracker_falls_back_when_the_child_dies(tracking_uri: str) -> None:
    """If the writer process is killed mid-run, the tracker writes from its own thread and loses nothing."""
    tracker = MlflowTracker(tracking_uri)
    run_id = tracker.start(experiment="child-fallback")
    tracker.log_metrics(_metrics("c", range(10)))
    tracker.flush()
    assert tracker._child is not None
    tracker._child._process.kill()
    tracker._child._process.wait(10)
    tracker.log_metrics(_metrics("c", range(10, 25)))
    tracker.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    steps = sorted(m.step for m in client.get_metric_history(run_id, "c"))
    assert steps == list(range(25))
    assert client.get_run(run_id).info.status == "FINISHED"
