"""The child process that writes metric batches to MLflow."""

from __future__ import annotations

import mlflow
import pytest
from mlflow.entities import Metric

from tracking import MlflowTracker
from tracking._child import ChildLogBatch


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
