"""The child process that writes metric batches to MLflow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import mlflow.pytorch
import numpy as np
import psutil
import pytest
import structlog
import torch
from mlflow.entities import Metric

import flasync
from flasync.testing import small_config
from flasync.tracking import MetricRow, MlflowTracker, _files, sqlite_metrics
from flasync.tracking._child import (
    _EXIT_TIMEOUT_S,
    FORKS_HELPER,
    IDLE,
    ChildLogBatch,
    IdleChild,
    close_idle_writer,
    warm_idle_writer,
)
from flasync.tracking.exports import ExportCache, default_export_cache
from flasync.training import models
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


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
    child = tracker._writers.child
    assert child is not None and child.alive
    tracker.prepare()
    assert tracker._writers.child is child  # idempotent
    run_id = tracker.start(experiment="prepared")
    assert tracker._writers.child is child
    tracker.log_metrics(_metrics("p", range(6)))
    tracker.finish("FINISHED")
    assert IDLE.child is child and child.idle  # kept for the next run of this process
    client = mlflow.MlflowClient(tracking_uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "p")) == list(range(6))


def test_prepared_tracker_that_never_starts_leaves_nothing(tracking_uri: str) -> None:
    """finish() on a prepared but unstarted tracker creates no run; its writer process is kept idle, or stopped."""
    client = mlflow.MlflowClient(tracking_uri)
    before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    child = tracker._writers.child
    assert child is not None
    tracker.finish("FAILED")
    assert IDLE.child is child and tracker._writers.child is None and tracker.run_id is None
    close_idle_writer()
    assert not child.alive
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == before


def test_tracker_falls_back_when_the_child_dies(tracking_uri: str) -> None:
    """If the writer process is killed mid-run, the tracker writes from its own thread and loses nothing."""
    tracker = MlflowTracker(tracking_uri)
    run_id = tracker.start(experiment="child-fallback")
    tracker.log_metrics(_metrics("c", range(10)))
    tracker.flush()
    assert tracker._writers.child is not None
    tracker._writers.child._process.kill()
    tracker._writers.child._process.wait(10)
    tracker.log_metrics(_metrics("c", range(10, 25)))
    tracker.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    steps = sorted(m.step for m in client.get_metric_history(run_id, "c"))
    assert steps == list(range(25))
    assert client.get_run(run_id).info.status == "FINISHED"


def test_child_creates_the_run_and_does_its_jobs(tracking_uri: str, tmp_path: Path) -> None:
    """A started tracker's writer process creates the run (context tags, params, the runs view) and logs its files,
    tags, dataset and end; this process never connects to the store."""
    tracker = MlflowTracker(tracking_uri, runs_view={"selectedColumns": ["metrics.`a`"]})
    tracker.prepare()
    run_id = tracker.start(experiment="child-opens", run_name="r1", params={"lr": 0.1}, tags={"mode": "sim"})
    assert tracker._run.client is None  # the child made the run
    tracker.log_metrics(_metrics("m", range(3)))
    tracker.log_bytes(b'{"x": 1}', "out/summary.json")
    tracker.set_tags({"alerts": "none"})
    tracker.log_dataset("digits", "abc123", "sklearn", {"rows": 10})
    tracker.finish("FINISHED")
    assert tracker._run.client is None
    client = mlflow.MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params == {"lr": "0.1"}
    assert run.data.tags["mode"] == "sim" and run.data.tags["alerts"] == "none"
    assert "mlflow.source.name" in run.data.tags and "mlflow.user" in run.data.tags
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["digits"]
    assert sorted(m.step for m in client.get_metric_history(run_id, "m")) == [0, 1, 2]
    local = client.download_artifacts(run_id, "out/summary.json", str(tmp_path))
    assert Path(local).read_bytes() == b'{"x": 1}'
    experiment = client.get_experiment(run.info.experiment_id)
    assert "metrics.`a`" in experiment.tags["mlflow.sharedViewState.flasync"]


def test_child_that_cannot_open_the_run_leaves_it_to_the_tracker(tracking_uri: str) -> None:
    """If the writer process fails to create the run, the tracker creates it itself and writes from its own thread."""
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    assert tracker._writers.child is not None
    tracker._writers.child._process.kill()
    tracker._writers.child._process.wait(10)
    run_id = tracker.start(experiment="child-fails-to-open")
    assert tracker._writers.child is None
    tracker.log_metrics(_metrics("f", range(4)))
    tracker.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "f")) == [0, 1, 2, 3]


def test_model_from_builder_is_logged_by_the_child(tracking_uri: str, tmp_path: Path) -> None:
    """log_model_from has the writer process build, export (pt2) and log the model; a builder it cannot import
    falls back to this process, which reports the failure."""
    weights = tmp_path / "w.npy"
    model = models.MLP(8, [4], 3)
    np.save(weights, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    tracker = MlflowTracker(tracking_uri, preload=("flasync.tracking._model:warm_up",))
    run_id = tracker.start(experiment="child-model")
    example = np.zeros((2, 8), dtype=np.float32)
    kwargs = {"model": "MLP", "weights": str(weights), "in_features": 8, "hidden": [4], "num_classes": 3}
    tracker.log_model_from("flasync.training.models:build", kwargs, name="mlp", input_example=example)
    with pytest.raises(ModuleNotFoundError):
        tracker.log_model_from("no_such_module:build", {}, name="nope", input_example=example)
    tracker.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    found = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    # The failed one is marked so (its builder failed in the writer's helper), never left pending.
    assert {(m.name, str(m.status)) for m in found} == {("mlp", "READY"), ("nope", "FAILED")}
    [logged] = [m for m in found if m.name == "mlp"]
    assert logged.source_run_id == run_id
    loaded = mlflow.pytorch.load_model(logged.artifact_location)
    x = torch.randn(5, 8)
    assert torch.allclose(loaded(x), model(x), atol=1e-6)


def test_system_monitor_runs_in_the_child(tracking_uri: str) -> None:
    """With system metrics on, MLflow's monitor samples in the writer process at the tracker's interval; its samples
    reach the run."""
    tracker = MlflowTracker(tracking_uri, system_metrics=True, system_metrics_interval_s=0.4)
    tracker.prepare()
    run_id = tracker.start(experiment="child-monitor")
    assert tracker._writers.monitor_in_child and tracker._writers.monitor is None
    time.sleep(2.0)  # about 5 samples at 0.4 s (at most 1 at the default 2 s)
    tracker.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    assert any(key.startswith("system/") for key in run.data.metrics)
    assert len(client.get_metric_history(run_id, "system/cpu_utilization_percentage")) >= 2
    assert run.info.status == "FINISHED"


PLOTS = {"accuracy.svg", "staleness.svg", "time_breakdown.svg", "client_times.svg"}


def _artifacts(tracking_uri: str, run_id: str, folder: str) -> set[str]:
    return {Path(a.path).name for a in mlflow.MlflowClient(tracking_uri).list_artifacts(run_id, folder)}


def _steps(client: mlflow.MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _tracked_run(tracking_uri: str, experiment: str, key: str, *, status: str = "FINISHED") -> str:
    """Run one tracker to its end: metrics ``key`` at steps 0-4 and an artifact naming ``key``; return the run id."""
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    run_id = tracker.start(experiment=experiment)
    tracker.log_metrics(_metrics(key, range(5)))
    tracker.log_bytes(key.encode(), f"{key}.txt")
    tracker.finish(status)  # type: ignore[arg-type]
    return run_id


def test_a_schema_mismatch_is_told_once_for_the_runs_one_writer_process_serves(
    tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs that share a writer process (a sweep's child runs, consecutive runs of one process) warn of a store
    schema the direct writes were not written for once between them; a new writer process says it again."""
    close_idle_writer()
    monkeypatch.setattr(sqlite_metrics, "SCHEMA_REVISIONS", frozenset({"0123456789ab"}))
    with structlog.testing.capture_logs() as logs:
        _tracked_run(tracking_uri, "told", "one")
        kept = IDLE.child
        _tracked_run(tracking_uri, "told", "two")
        assert kept is not None and IDLE.child is kept  # one writer process served both runs
        told = len([log for log in logs if log["event"] == "tracking.sqlite_schema_mismatch"])
        close_idle_writer()
        _tracked_run(tracking_uri, "told", "three")
    assert told == 1
    warnings = [log for log in logs if log["event"] == "tracking.sqlite_schema_mismatch"]
    assert len(warnings) == 2 and warnings[0]["expected_revisions"] == "0123456789ab"


def test_a_warmed_writer_process_serves_the_next_tracker(tracking_uri: str) -> None:
    """``warm_idle_writer`` starts the writer process the next tracker on that store takes; a second call keeps it,
    and a remote store gets none."""
    close_idle_writer()
    warm_idle_writer(tracking_uri)
    kept = IDLE.child
    assert kept is not None
    warm_idle_writer(tracking_uri)
    assert IDLE.child is kept
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    assert tracker._writers.child is kept and tracker.writer_reused
    tracker.finish("FINISHED")
    close_idle_writer()
    warm_idle_writer("http://127.0.0.1:9")
    assert IDLE.child is None


def test_a_second_run_reuses_the_idle_child_and_writes_to_its_own_run(tracking_uri: str) -> None:
    """The writer process of an ended run serves the next tracker on the same store (same pid): each run gets only
    its own metrics and artifacts, and each ends with its own status."""
    close_idle_writer()
    first = _tracked_run(tracking_uri, "reuse", "one", status="FAILED")
    kept = IDLE.child
    assert kept is not None and kept.idle
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    assert tracker._writers.child is kept and tracker.writer_reused and IDLE.child is None
    second = tracker.start(experiment="reuse")
    tracker.log_metrics(_metrics("two", range(5, 9)))
    tracker.log_bytes(b"two", "two.txt")
    tracker.finish("FINISHED")
    assert IDLE.child is kept and kept.run == 2
    client = mlflow.MlflowClient(tracking_uri)
    assert client.get_run(first).info.status == "FAILED" and client.get_run(second).info.status == "FINISHED"
    assert _steps(client, first, "one") == [0, 1, 2, 3, 4] and _steps(client, first, "two") == []
    assert _steps(client, second, "two") == [5, 6, 7, 8] and _steps(client, second, "one") == []
    assert _artifacts(tracking_uri, first, "") == {"one.txt"}
    assert _artifacts(tracking_uri, second, "") == {"two.txt"}


def test_a_run_that_releases_its_writer_stays_open_while_a_nested_run_uses_it_then_takes_it_back(
    tracking_uri: str,
) -> None:
    """A sweep's shape: the parent run opens in the background and a nested run starts before it is open, taking no
    writer process of its own; once open, the parent hands its writer over (``release_writer``) and stays RUNNING
    while the nested run, tagged ``mlflow.parentRunId``, logs and ends through it; the parent's next records take it
    back. One writer process (one pid) served all three runs, each with only its own records."""
    close_idle_writer()
    parent = MlflowTracker(tracking_uri)
    parent.prepare()
    assert parent._writers.child is not None
    writer = parent._writers.child.pid
    parent.start(experiment="nested", wait=False)

    def parent_id() -> str:
        run_id = parent.opened()
        parent.release_writer()
        return run_id

    child = MlflowTracker(tracking_uri, nest_under=parent_id)
    child.prepare()
    assert child._writers.child is None  # it takes the parent's once that run is open
    child.start(experiment="nested", wait=False)
    child.log_metrics(_metrics("child", range(3)))
    child.log_bytes(b"child", "child.txt")
    child.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    parent_run_id = parent.opened()
    assert child.run_id is not None and client.get_run(parent_run_id).info.status == "RUNNING"
    assert IDLE.child is not None and IDLE.child.pid == writer and IDLE.child.run == 2
    parent.log_metrics(_metrics("parent", range(2)))
    parent.log_bytes(b"parent", "parent.txt")
    parent.finish("FINISHED")
    assert IDLE.child is not None and IDLE.child.pid == writer and IDLE.child.run == 3
    nested = client.get_run(child.run_id)
    assert nested.data.tags["mlflow.parentRunId"] == parent_run_id and nested.info.status == "FINISHED"
    assert client.get_run(parent_run_id).info.status == "FINISHED"
    assert _steps(client, child.run_id, "child") == [0, 1, 2] and _steps(client, child.run_id, "parent") == []
    assert _steps(client, parent_run_id, "parent") == [0, 1] and _steps(client, parent_run_id, "child") == []
    assert _artifacts(tracking_uri, child.run_id, "") == {"child.txt"}
    assert _artifacts(tracking_uri, parent_run_id, "") == {"parent.txt"}
    close_idle_writer()


def test_a_run_that_released_its_writer_and_logs_nothing_more_still_ends_through_one(tracking_uri: str) -> None:
    """``finish`` right after ``release_writer`` takes a writer process back to end the run: FINISHED, the same
    process kept idle again, and the metric writer it started for that closed."""
    close_idle_writer()
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    run_id = tracker.start(experiment="released")
    assert tracker._writers.child is not None
    writer = tracker._writers.child.pid
    assert tracker.release_writer() and tracker._writers.child is None
    assert IDLE.child is not None and IDLE.child.pid == writer and IDLE.child.idle
    tracker.finish("FINISHED")
    assert mlflow.MlflowClient(tracking_uri).get_run(run_id).info.status == "FINISHED"
    assert IDLE.child is not None and IDLE.child.pid == writer and IDLE.child.run == 2
    assert tracker.writer is not None and tracker.writer.closed
    close_idle_writer()


def test_a_kept_child_serves_through_a_changed_test_name_but_not_a_changed_mlflow_setting(
    tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer process serves a later tracker whose environment differs only in variables it never reads (pytest's
    test name, the terminal's size); a changed variable MLflow may read makes a new one."""
    child = ChildLogBatch(tracking_uri)
    try:
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")
        monkeypatch.setenv("COLUMNS", "61")
        assert child.serves(tracking_uri)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "7")
        assert not child.serves(tracking_uri)
        monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT")
        assert not child.serves(f"{tracking_uri}-other")
    finally:
        child.close()


def test_trackers_given_their_own_holder_share_only_with_each_other(tracking_uri: str) -> None:
    """idle_writers: a tracker's idle child goes to the holder it was given, not to the process's, and the next
    tracker given that holder takes it over."""
    close_idle_writer()
    own = IdleChild()
    try:
        first = MlflowTracker(tracking_uri, idle_writers=own)
        first.prepare()
        first.start(experiment="own-holder")
        first.finish("FINISHED")
        kept = own.child
        assert kept is not None and kept.idle and IDLE.child is None
        second = MlflowTracker(tracking_uri, idle_writers=own)
        second.prepare()
        assert second._writers.child is kept and second.writer_reused and own.child is None
        second.start(experiment="own-holder")
        second.finish("FINISHED")
        assert own.child is kept and IDLE.child is None
    finally:
        own.clear()
    assert not kept.alive


def test_a_late_batch_of_an_ended_run_never_reaches_the_next_one(tracking_uri: str) -> None:
    """A batch or job sent for a run the child has left is refused as ConnectionError, never written elsewhere."""
    client = mlflow.MlflowClient(tracking_uri)
    experiment_id = client.create_experiment("late-batch")
    first, second = (client.create_run(experiment_id).info.run_id for _ in range(2))
    child = ChildLogBatch(tracking_uri, first)
    try:
        child(_metrics("a", range(2)), run=1)
        child.job({"op": "end", "status": "FINISHED", "end_time": 1_000}, 60, run=1)
        assert child.idle
        child.bind(second)
        with pytest.raises(ConnectionError, match="left run 1"):
            child(_metrics("a", range(2, 4)), run=1)
        with pytest.raises(ConnectionError, match="left run 1"):
            child.job({"op": "tags", "tags": {"x": "y"}}, 60, run=1)
        child(_metrics("b", range(3)), run=2)
    finally:
        child.close()
    assert _steps(client, first, "a") == [0, 1] and _steps(client, second, "a") == []
    assert _steps(client, second, "b") == [0, 1, 2] and "x" not in client.get_run(second).data.tags


def test_a_dead_idle_child_is_replaced(tracking_uri: str) -> None:
    """An idle child that died (crashed or killed) is not handed out: the next tracker starts a new one."""
    close_idle_writer()
    _tracked_run(tracking_uri, "dead-idle", "one")
    kept = IDLE.child
    assert kept is not None
    kept._process.kill()
    kept._process.wait(10)
    tracker = MlflowTracker(tracking_uri)
    tracker.prepare()
    assert tracker._writers.child is not None and tracker._writers.child is not kept and not tracker.writer_reused
    run_id = tracker.start(experiment="dead-idle")
    tracker.log_metrics(_metrics("two", range(3)))
    tracker.finish("FINISHED")
    assert _steps(mlflow.MlflowClient(tracking_uri), run_id, "two") == [0, 1, 2]


def test_another_store_gets_its_own_child(tracking_uri: str, tmp_path: Path) -> None:
    """A tracker on another store does not take the idle child: that one is stopped, a new one writes there."""
    close_idle_writer()
    _tracked_run(tracking_uri, "store-a", "one")
    kept = IDLE.child
    assert kept is not None
    other = f"sqlite:///{tmp_path}/other.db"
    run_id = _tracked_run(other, "store-b", "two")
    assert not kept.alive
    assert IDLE.child is not None and IDLE.child is not kept
    assert _steps(mlflow.MlflowClient(other), run_id, "two") == [0, 1, 2, 3, 4]


def test_concurrent_runs_do_not_share_a_child(tracking_uri: str) -> None:
    """Two runs at once each have their own writer process (only an idle one is handed out); each run gets only its
    own metrics, and one child is kept once both ended."""
    close_idle_writer()
    first, second = MlflowTracker(tracking_uri), MlflowTracker(tracking_uri)
    first.prepare()
    second.prepare()
    assert (
        first._writers.child is not None
        and second._writers.child is not None
        and first._writers.child is not second._writers.child
    )
    ids = [first.start(experiment="concurrent"), second.start(experiment="concurrent")]
    first.log_metrics(_metrics("one", range(4)))
    second.log_metrics(_metrics("two", range(4)))
    children = [first._writers.child, second._writers.child]
    first.finish("FINISHED")
    second.finish("FINISHED")
    assert IDLE.child is children[1] and not children[0].alive
    client = mlflow.MlflowClient(tracking_uri)
    assert _steps(client, ids[0], "one") == [0, 1, 2, 3] and _steps(client, ids[0], "two") == []
    assert _steps(client, ids[1], "two") == [0, 1, 2, 3] and _steps(client, ids[1], "one") == []


def test_the_system_monitor_stops_with_its_run(tracking_uri: str) -> None:
    """A reused child samples the system for the run it serves: the ended run gets no samples after its end."""
    close_idle_writer()
    client = mlflow.MlflowClient(tracking_uri)
    runs = []
    for _ in range(2):
        tracker = MlflowTracker(tracking_uri, system_metrics=True, system_metrics_interval_s=0.4)
        tracker.prepare()
        runs.append(tracker.start(experiment="monitor-reuse"))
        time.sleep(1.0)  # a sample every 0.4 s
        tracker.finish("FINISHED")
        if len(runs) == 1:
            first_samples = client.get_run(runs[0]).data.metrics
    assert tracker.writer_reused
    assert client.get_run(runs[0]).data.metrics == first_samples
    assert any(key.startswith("system/") for key in client.get_run(runs[1]).data.metrics)
    history = client.get_metric_history(runs[0], "system/cpu_utilization_percentage")
    assert history and all(m.timestamp <= client.get_run(runs[0]).info.end_time for m in history)


def test_the_idle_child_is_stopped_at_exit(tmp_path: Path) -> None:
    """The exit functions of the process stop the writer process it kept idle."""
    code = (
        "import atexit, sys\n"
        "from flasync.tracking import MlflowTracker\n"
        "from flasync.tracking._child import IDLE\n"
        f"tracker = MlflowTracker('sqlite:///{tmp_path}/exit.db')\n"
        "tracker.start(experiment='exit')\n"
        "tracker.finish('FINISHED')\n"
        "child = IDLE.child\n"
        "assert child is not None and child.alive\n"
        "atexit._run_exitfuncs()\n"
        "assert not child.alive and IDLE.child is None\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)


def test_consecutive_federations_share_the_child_and_log_their_own_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tracked flasync.run calls in one process: the second takes the first's writer process, which exports its
    model (no one-shot process), each into its own run with its plots."""
    close_idle_writer()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    summaries, pids = [], []
    for seed in (0, 1):
        config = small_config("tracking.enabled=true", f"tracking.uri={uri}", "tracking.log_model=true", f"seed={seed}")
        summaries.append(flasync.run(config))
        assert IDLE.child is not None
        pids.append(IDLE.child.pid)

        def not_here(*args: object, **kwargs: object) -> None:
            raise AssertionError("the model was saved by a one-shot process, not the kept writer process")

        monkeypatch.setattr(_files, "write_elsewhere", not_here)
    assert pids[0] == pids[1]
    client = mlflow.MlflowClient(uri)
    ids = [s.run_id for s in summaries]
    assert ids[0] != ids[1]
    for run_id, summary in zip(ids, summaries, strict=True):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert _artifacts(uri, run_id, "plots") == PLOTS
        [logged] = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
        assert str(logged.status) == "READY"
        assert run.data.params["seed"] == str(ids.index(run_id))
        assert summary.updates_accepted > 0


def test_a_kept_child_whose_store_was_replaced_gives_way_to_a_new_one(tmp_path: Path) -> None:
    """A store deleted and made again between two runs is written by a new child, not by the kept one (whose open
    connections would write to the deleted file)."""
    close_idle_writer()
    uri = f"sqlite:///{tmp_path}/replaced/mlflow.db"
    _tracked_run(uri, "replaced", "one")
    kept = IDLE.child
    assert kept is not None
    shutil.rmtree(tmp_path / "replaced")
    run_id = _tracked_run(uri, "replaced", "two")
    assert not kept.alive and IDLE.child is not None and IDLE.child is not kept
    client = mlflow.MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert _steps(client, run_id, "two") == [0, 1, 2, 3, 4]


def _loads_torch(pid: int) -> bool:
    """Tell whether process ``pid`` has torch's library mapped."""
    return any("libtorch" in Path(m.path).name for m in psutil.Process(pid).memory_maps())


def _model_kwargs(tmp_path: Path) -> tuple[dict[str, object], torch.nn.Module]:
    weights = tmp_path / "w.npy"
    model = models.MLP(8, [4], 3)
    np.save(weights, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy())
    return {"model": "MLP", "weights": str(weights), "in_features": 8, "hidden": [4], "num_classes": 3}, model


@pytest.mark.skipif(not FORKS_HELPER, reason="the writer forks its helpers on Linux only")
def test_a_writer_with_preloads_leaves_the_model_to_a_helper_of_its_own(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new writer process told what to preload forks one helper, at its priority: the model's export is made
    there (the writer process never loads torch), logged by the writer process; the helper ends with it."""
    monkeypatch.setattr(_files, "write_elsewhere", lambda *a, **k: pytest.fail("saved by a one-shot process"))
    tracker = MlflowTracker(tracking_uri, preload=("flasync.tracking._model:warm_up",))
    tracker.prepare()
    assert tracker._writers.child is not None
    writer = psutil.Process(tracker._writers.child.pid)
    run_id = tracker.start(experiment="child-helpers")
    helpers = writer.children()
    assert len(helpers) == 1
    assert [helper.nice() for helper in helpers] == [writer.nice()]
    kwargs, model = _model_kwargs(tmp_path)
    example = np.zeros((2, 8), dtype=np.float32)
    tracker.log_model_from("flasync.training.models:build", kwargs, name="mlp", input_example=example)
    assert not _loads_torch(writer.pid)
    assert _loads_torch(helpers[0].pid)
    tracker.finish("FINISHED")
    client = mlflow.MlflowClient(tracking_uri)
    [logged] = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert str(logged.status) == "READY" and logged.source_run_id == run_id
    x = torch.randn(5, 8)
    assert torch.allclose(mlflow.pytorch.load_model(logged.artifact_location)(x), model(x), atol=1e-6)
    close_idle_writer()
    _, alive = psutil.wait_procs([writer, *helpers], timeout=_EXIT_TIMEOUT_S)
    assert not alive


def test_the_writer_links_the_evaluation_to_the_model_it_logged(tracking_uri: str, tmp_path: Path) -> None:
    """The writer process links a step's evaluation points to the model it logged to the run under that name, read
    from the store in one query: a later model of the same name from elsewhere (READY) gets none."""
    tracker = MlflowTracker(tracking_uri, idle_writers=IdleChild())
    run_id = tracker.start(experiment="child-links")
    assert tracker._writers.child is not None
    kwargs, _ = _model_kwargs(tmp_path)
    tracker.log_model_from(
        "flasync.training.models:build", kwargs, name="mlp", input_example=np.zeros((2, 8), np.float32)
    )
    client = mlflow.MlflowClient(tracking_uri)
    experiment = client.get_run(run_id).info.experiment_id
    [ours] = client.search_logged_models([experiment])
    other = client.create_logged_model(experiment, name="mlp", source_run_id=run_id)
    client.finalize_logged_model(other.model_id, "READY")
    tracker.log_metrics(
        [
            MetricRow("server/eval/accuracy", 0.5, 1_000, 3),
            MetricRow("server/eval/accuracy", 0.75, 2_000, 4),
            MetricRow("server/eval/loss", float("inf"), 2_000, 4),
            MetricRow("server/eval/loss", float("nan"), 2_001, 4),
            MetricRow("clientxeval/accuracy", 1.0, 2_000, 4),  # "_" of "client_eval/" is no wildcard
            MetricRow("client_eval/accuracy/mean", 0.25, 2_000, 4),
        ]
    )
    assert tracker.flush()
    try:
        with structlog.testing.capture_logs() as logs:
            assert tracker.link_models({"mlp": 4}) == 3
    finally:
        tracker.finish("FINISHED")
    assert not [e for e in logs if e["event"] == "tracking.writer_process_job_failed"], logs  # no fallback here
    linked = sorted((m.key, m.step, m.value, m.timestamp) for m in client.get_logged_model(ours.model_id).metrics)
    assert linked == [
        ("client_eval/accuracy/mean", 4, 0.25, 2_000),
        ("server/eval/accuracy", 4, 0.75, 2_000),
        ("server/eval/loss", 4, sys.float_info.max, 2_000),  # as MLflow stores an infinity
    ]
    assert not client.get_logged_model(other.model_id).metrics


@pytest.mark.skipif(not FORKS_HELPER, reason="the writer forks its helpers on Linux only")
def test_a_dead_helper_leaves_its_jobs_to_the_writer(tracking_uri: str, tmp_path: Path) -> None:
    """When the model's helper is gone, the writer process exports and logs the model itself."""
    holder = IdleChild()
    tracker = MlflowTracker(tracking_uri, preload=("flasync.tracking._model:warm_up",), idle_writers=holder)
    run_id = tracker.start(experiment="child-helper-dies")
    assert tracker._writers.child is not None
    [helper] = psutil.Process(tracker._writers.child.pid).children()
    helper.kill()
    deadline = time.monotonic() + 10
    while helper.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:  # the writer reaps it later
        time.sleep(0.05)
    assert helper.status() == psutil.STATUS_ZOMBIE
    kwargs, _ = _model_kwargs(tmp_path)
    tracker.log_model_from(
        "flasync.training.models:build", kwargs, name="mlp", input_example=np.zeros((2, 8), np.float32)
    )
    assert tracker._writers.child is not None and tracker._writers.child.alive  # the writer process did it
    tracker.finish("FINISHED")
    holder.clear()
    client = mlflow.MlflowClient(tracking_uri)
    [logged] = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert str(logged.status) == "READY"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel ends helpers with their parent on Linux")
def test_helpers_die_with_a_killed_writer(tracking_uri: str) -> None:
    """A writer process killed outright takes its helper with it, even while it still preloads."""
    child = ChildLogBatch(tracking_uri, preload=("flasync.tracking._model:warm_up",))
    writer = psutil.Process(child.pid)
    helpers = _helpers_of(writer, 60)
    assert len(helpers) == 1
    writer.kill()
    child.close()
    _, alive = psutil.wait_procs(helpers, timeout=10)
    assert not [p for p in alive if _running(p)]


def _helpers_of(writer: psutil.Process, timeout_s: float) -> list[psutil.Process]:
    """The helpers ``writer`` forked, once there are any (or none after ``timeout_s``): children with the writer's
    command line that keep it from one look to the next. A program the writer runs for a moment (``uname -p``, while
    MLflow loads) has the writer's command line only between its fork and its exec, and is gone soon after."""
    deadline = time.monotonic() + timeout_s
    before: set[int] = set()
    while time.monotonic() < deadline:
        forks = []
        for process in writer.children():
            try:
                if process.cmdline() == writer.cmdline():
                    forks.append(process)
            except psutil.NoSuchProcess:
                continue
        kept = [process for process in forks if process.pid in before]
        if kept:
            return kept
        before = {process.pid for process in forks}
        time.sleep(0.1)
    return []


def _running(process: psutil.Process) -> bool:
    """Whether ``process`` still runs: a zombie (dead, its exit status not yet read by whoever inherited it: PID 1,
    when its parent died first) does not."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


_WAITING_BUILDER = """
import os
import time

from flasync.training.models import build as build_model


def build(flag, **kwargs):
    deadline = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)
    return build_model(**kwargs)
"""


def _builder_tracker(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: tuple[str, str], experiment: str
) -> tuple[MlflowTracker, IdleChild, str]:
    """Write ``module`` (its name and source) into ``tmp_path``, importable by the writer process, then start a
    tracker whose writer process preloads the model's export and is kept only by the holder returned; return the
    tracker, the holder and the run's id."""
    name, source = module
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    holder = IdleChild()
    tracker = MlflowTracker(tracking_uri, preload=("flasync.tracking._model:warm_up",), idle_writers=holder)
    return tracker, holder, tracker.start(experiment=experiment)


def test_a_started_model_is_exported_while_the_writer_answers_the_rest(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start_model_from returns at once; the writer process answers files and metrics while the model's job runs
    (its builder here waits for a file this test writes only after those answers); the function it returns waits
    for the model."""
    tracker, holder, run_id = _builder_tracker(
        tracking_uri, tmp_path, monkeypatch, ("waiting_builder", _WAITING_BUILDER), "child-deferred"
    )
    kwargs, model = _model_kwargs(tmp_path)
    flag = tmp_path / "go"
    settle = tracker.start_model_from(
        "waiting_builder:build", {**kwargs, "flag": str(flag)}, name="mlp", input_example=np.zeros((2, 8), np.float32)
    )
    tracker.log_bytes(b"<svg/>", "plots/a.svg")
    tracker.log_metrics(_metrics("m", range(3)))
    assert tracker.flush()
    client = mlflow.MlflowClient(tracking_uri)
    assert _artifacts(tracking_uri, run_id, "plots") == {"a.svg"}
    assert [m.step for m in client.get_metric_history(run_id, "m")] == [0, 1, 2]
    assert client.search_logged_models([client.get_run(run_id).info.experiment_id]) == [] or all(
        str(m.status) != "READY" for m in client.search_logged_models([client.get_run(run_id).info.experiment_id])
    )
    flag.touch()
    assert settle() > 0
    tracker.finish("FINISHED")
    holder.clear()
    [logged] = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert str(logged.status) == "READY" and logged.name == "mlp"
    x = torch.randn(5, 8)
    assert torch.allclose(mlflow.pytorch.load_model(logged.artifact_location)(x), model(x), atol=1e-6)


def test_a_started_model_that_fails_raises_when_settled_and_one_never_settled_ends_with_its_run(
    tracking_uri: str, tmp_path: Path
) -> None:
    """A started model whose builder fails raises its error from the function start_model_from returned (as
    log_model_from would); one never waited for is still logged before the run ends."""
    holder = IdleChild()
    tracker = MlflowTracker(tracking_uri, preload=("flasync.tracking._model:warm_up",), idle_writers=holder)
    run_id = tracker.start(experiment="child-deferred-fails")
    example = np.zeros((2, 8), dtype=np.float32)
    failing = tracker.start_model_from("no_such_module:build", {}, name="nope", input_example=example)
    with pytest.raises(ModuleNotFoundError):
        failing()
    kwargs, _ = _model_kwargs(tmp_path)
    tracker.start_model_from("flasync.training.models:build", kwargs, name="mlp", input_example=example)
    tracker.finish("FINISHED")
    holder.clear()
    client = mlflow.MlflowClient(tracking_uri)
    found = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert {(m.name, str(m.status)) for m in found} == {("mlp", "READY"), ("nope", "FAILED")}


def test_a_model_logged_while_a_started_one_exports_waits_its_turn(tracking_uri: str, tmp_path: Path) -> None:
    """The model's helper does one job at a time: a model logged while a started one is exported (two threads of
    the writer process) is done after it, and both are logged whole."""
    holder = IdleChild()
    tracker = MlflowTracker(tracking_uri, preload=("flasync.tracking._model:warm_up",), idle_writers=holder)
    run_id = tracker.start(experiment="child-two-models")
    kwargs, model = _model_kwargs(tmp_path)
    example = np.zeros((2, 8), dtype=np.float32)
    settle = tracker.start_model_from("flasync.training.models:build", kwargs, name="first", input_example=example)
    tracker.log_model_from("flasync.training.models:build", kwargs, name="second", input_example=example)
    settle()
    tracker.finish("FINISHED")
    holder.clear()
    client = mlflow.MlflowClient(tracking_uri)
    found = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert sorted((m.name, str(m.status)) for m in found) == [("first", "READY"), ("second", "READY")]
    x = torch.randn(5, 8)
    for logged in found:
        assert torch.allclose(mlflow.pytorch.load_model(logged.artifact_location)(x), model(x), atol=1e-6)


_EXPORT_ONCE_BUILDER = """
import torch

from flasync.training.models import build as build_model


def build(**kwargs):
    if kwargs["weights"] is not None:  # the trained model: a second trace would fail
        def refuse(*args, **kwargs):
            raise RuntimeError("torch.export ran again")

        torch.export.export = refuse
    return build_model(**kwargs)
"""


def test_a_model_prepared_while_training_is_saved_without_a_second_trace(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prepare_model_from has the writer's helper export the model's structure during the run; the trained model
    is then saved from that export: its builder breaks torch.export (so a model traced again would be pickled), and
    it is still logged in the pt2 format, with its own weights."""
    tracker, holder, run_id = _builder_tracker(
        tracking_uri, tmp_path, monkeypatch, ("export_once_builder", _EXPORT_ONCE_BUILDER), "child-prepared-model"
    )
    kwargs, model = _model_kwargs(tmp_path)
    example = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
    tracker.prepare_model_from("export_once_builder:build", {**kwargs, "weights": None}, input_example=example)
    tracker.log_model_from("export_once_builder:build", kwargs, name="mlp", input_example=example)
    tracker.finish("FINISHED")
    holder.clear()  # its helper's torch.export is broken
    client = mlflow.MlflowClient(tracking_uri)
    [logged] = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert str(logged.status) == "READY"
    assert {Path(a.path).name for a in client.list_logged_model_artifacts(logged.model_id, "data")} == {"model.pt2"}
    x = torch.randn(5, 8)
    assert torch.equal(mlflow.pytorch.load_model(logged.artifact_location)(x), model(x))


def test_a_model_whose_export_a_writer_kept_is_saved_from_it_by_the_next_tracker(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export a writer's helper made ahead is kept across processes: the next tracker neither sends it again nor
    traces the trained model (its builder breaks torch.export wherever it builds it, this process included, so a
    traced model would be pickled); it saves the model from the kept export, which its writer logs in the pt2
    format with the trained model's own weights."""
    monkeypatch.setattr(torch.export, "export", torch.export.export)  # put back once the builder broke it here
    first, holder, _ = _builder_tracker(
        tracking_uri, tmp_path, monkeypatch, ("export_once_builder", _EXPORT_ONCE_BUILDER), "child-kept-first"
    )
    kwargs, _ = _model_kwargs(tmp_path)
    example = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
    first.prepare_model_from("export_once_builder:build", {**kwargs, "weights": None}, input_example=example)
    first.log_model_from("export_once_builder:build", kwargs, name="mlp", input_example=example)  # after the export
    first.finish("FINISHED")
    holder.clear()
    cache = ExportCache(default_export_cache())
    assert cache.get(cache.key("export_once_builder:build", kwargs, example.tolist(), "float32")) is not None

    monkeypatch.syspath_prepend(str(tmp_path))  # the tracker's process builds the trained model too
    trained = models.MLP(8, [4], 3)
    np.save(tmp_path / "trained.npy", torch.cat([p.detach().reshape(-1) for p in trained.parameters()]).numpy())
    second_holder = IdleChild()
    second = MlflowTracker(tracking_uri, preload=("flasync.tracking._model",), idle_writers=second_holder)
    run_id = second.start(experiment="child-kept-second")
    sent: list[dict[str, object]] = []
    job = second._writers.child_job
    monkeypatch.setattr(second._writers, "child_job", lambda request: sent.append(dict(request)) or job(request))
    second.prepare_model_from("export_once_builder:build", {**kwargs, "weights": None}, input_example=example)
    trained_kwargs = {**kwargs, "weights": str(tmp_path / "trained.npy")}
    settle = second.start_model_from("export_once_builder:build", trained_kwargs, name="mlp", input_example=example)
    settle()
    second.finish("FINISHED")
    second_holder.clear()
    assert [r["op"] for r in sent if r["op"] in ("prepare", "model")] == ["model"]
    client = mlflow.MlflowClient(tracking_uri)
    [logged] = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert str(logged.status) == "READY" and logged.source_run_id == run_id
    assert {Path(a.path).name for a in client.list_logged_model_artifacts(logged.model_id, "data")} == {"model.pt2"}
    x = torch.randn(2, 8)
    assert torch.equal(mlflow.pytorch.load_model(logged.artifact_location)(x), trained(x))


_BLOCKING_BUILDER = """
import os
import time
from pathlib import Path

from flasync.training.models import build as build_model


def build(flag, marker, **kwargs):
    deadline = time.monotonic() + 20
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.02)
    Path(marker).write_text("flag" if os.path.exists(flag) else "timed out")
    return build_model(**kwargs)
"""


def test_a_run_stopped_while_its_model_is_exported_ahead_does_not_wait_for_it(
    tracking_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export made ahead is never waited for by a run that ends without its model (here killed): its builder
    waits for a file this test writes only once the run has ended, and sees it."""
    tracker, holder, run_id = _builder_tracker(
        tracking_uri, tmp_path, monkeypatch, ("blocking_builder", _BLOCKING_BUILDER), "child-detached"
    )
    kwargs, _ = _model_kwargs(tmp_path)
    flag, marker = tmp_path / "go", tmp_path / "marker"
    arguments = {**kwargs, "weights": None, "flag": str(flag), "marker": str(marker)}
    tracker.prepare_model_from("blocking_builder:build", arguments, input_example=np.zeros((2, 8), np.float32))
    tracker.finish("KILLED")
    flag.touch()
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    holder.clear()
    assert marker.read_text() == "flag"
    assert mlflow.MlflowClient(tracking_uri).get_run(run_id).info.status == "KILLED"
