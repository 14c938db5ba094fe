"""Tests of tracking.mlflow_run on a real, temporary MLflow store."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
import pytest
import torch
import yaml
from mlflow.entities import LoggedModelStatus, Metric

from flasync.tracking import (
    DEFAULT_TRACKING_URI,
    ExperimentDeletedError,
    MetricsProcessor,
    MlflowTracker,
    NullTracker,
    RunStatus,
    Tracker,
    close_idle_writer,
    make_logger,
    yaml_text,
)
from flasync.tracking.sqlite_metrics import SqliteMetrics


@pytest.fixture(autouse=True)
def _no_idle_writer() -> None:
    """Leave the writer process a test's tracker left idle to the next test's tracker, as consecutive runs of one
    process share it (a new one costs an MLflow import, 2 s); it is stopped after the module."""


@pytest.fixture(autouse=True, scope="module")
def _idle_writer_stopped_after_the_module() -> Iterator[None]:
    yield
    close_idle_writer()


@pytest.fixture(autouse=True, scope="module")
def _no_user_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Point MLflow's environment default at a temporary store, one for the module (an idle writer process serves
    only trackers whose environment is its own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path_factory.mktemp('stray')}/mlflow.db")
        yield


@pytest.fixture(scope="module")
def client(tracking_uri: str) -> mlflow.MlflowClient:
    """Return a client of the module's store (created once, here)."""
    client = mlflow.MlflowClient(tracking_uri)
    client.search_experiments()
    return client


@pytest.fixture
def tracker(tracking_uri: str, client: mlflow.MlflowClient) -> MlflowTracker:
    """Return a tracker on the module's store, not started."""
    return MlflowTracker(tracking_uri, flush_interval_s=0.05)


@pytest.mark.slow
def test_start_records_params_in_chunks_and_tags(tracker: MlflowTracker, client: mlflow.MlflowClient) -> None:
    """More than 100 params (stringified) and the tags are all recorded."""
    params = {f"server.p{i}": i for i in range(250)} | {"long": "x" * 7000}
    run_id = tracker.start(experiment="params", run_name="r", params=params, tags={"mode": "sim"})
    run = client.get_run(run_id)
    assert len(run.data.params) == 251
    assert run.data.params["server.p249"] == "249"
    assert len(run.data.params["long"]) == 6000
    assert run.data.tags["mode"] == "sim"
    assert run.info.run_name == "r"
    tracker.finish("FINISHED")


@pytest.mark.slow
def test_logged_events_become_metrics_with_their_steps(tracker: MlflowTracker, client: mlflow.MlflowClient) -> None:
    """Events logged through a MetricsProcessor logger are stored at their steps."""
    run_id = tracker.start(experiment="metrics")
    log = make_logger(processors_before=[MetricsProcessor(tracker.log_metrics)])
    for version in range(3):
        log.debug("server.aggregated", step=version, staleness_mean=version / 2, client_id=9)
    tracker.flush()
    history = client.get_metric_history(run_id, "server/aggregated/staleness_mean")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert "server.aggregated.client_id" not in client.get_run(run_id).data.metrics
    tracker.finish("FINISHED")


@pytest.mark.slow
def test_finish_writes_queued_metrics(tracker: MlflowTracker, client: mlflow.MlflowClient) -> None:
    """Metrics queued before finish are stored, in batches of at most 1000."""
    run_id = tracker.start(experiment="metrics")
    tracker.log_metrics([Metric("m", float(i), 0, i) for i in range(1500)])
    tracker.finish("FINISHED")
    assert len(client.get_metric_history(run_id, "m")) == 1500
    assert tracker.writer is not None
    assert tracker.writer.batches == 2


@pytest.mark.parametrize("direct", [True, False], ids=["sqlite-query", "metric-histories"])
@pytest.mark.slow
def test_a_resumed_run_writes_each_step_once_including_steps_below_the_latest(
    tracker: MlflowTracker,
    client: mlflow.MlflowClient,
    tracking_uri: str,
    direct: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a resume, a replayed step the store holds is dropped, and one it misses is written, even below the
    key's latest step (per-update series finish out of order, so a task in flight at the checkpoint has a step
    below the latest stored one)."""
    run_id = tracker.start(experiment="resume")
    tracker.log_metrics([Metric("update", 1.0, 0, step) for step in (0, 1, 2, 5, 6)])
    tracker.log_metrics([Metric("eval", 1.0, 0, step) for step in (0, 2, 4)])
    tracker.finish("KILLED")
    if not direct:  # a store other than SQLite: the steps come from the metric histories
        monkeypatch.setattr(SqliteMetrics, "open", classmethod(lambda cls, uri, **kw: None))

    resumed = MlflowTracker(tracking_uri, flush_interval_s=0.05)
    resumed.resume(run_id)
    resumed.log_metrics([Metric("update", 2.0, 0, step) for step in (3, 4, 5, 7)])
    resumed.log_metrics([Metric("eval", 2.0, 0, step) for step in (2, 4, 6)])
    resumed.log_metrics([Metric("new", 2.0, 0, 0)])
    resumed.finish("FINISHED")

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

    assert history("update") == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 1.0), (6, 1.0), (7, 2.0)]
    assert history("eval") == [(0, 1.0), (2, 1.0), (4, 1.0), (6, 2.0)]
    assert history("new") == [(0, 2.0)]


def test_dict_and_bytes_artifacts_are_stored(
    tracker: MlflowTracker, client: mlflow.MlflowClient, tmp_path: Path
) -> None:
    """log_dict, log_bytes and log_file put their files in the run's artifacts."""
    run_id = tracker.start(experiment="artifacts")
    tracker.log_dict({"lr": 0.1, "path": tmp_path}, "config/run.json")
    tracker.log_bytes(b"client,bytes\n1,10\n", "clients/table.csv")
    (tmp_path / "notes.txt").write_text("hi")
    tracker.log_file(tmp_path / "notes.txt", "extra")
    tracker.finish("FINISHED")
    listed = {a.path for folder in ("config", "clients", "extra") for a in client.list_artifacts(run_id, folder)}
    assert listed == {"config/run.json", "clients/table.csv", "extra/notes.txt"}
    local = Path(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, tracking_uri=tracker.tracking_uri, dst_path=str(tmp_path / "dl")
        )
    )
    assert json.loads((local / "config" / "run.json").read_text()) == {"lr": 0.1, "path": str(tmp_path)}
    assert (local / "clients" / "table.csv").read_bytes() == b"client,bytes\n1,10\n"


@pytest.mark.parametrize("writer", [True, False], ids=["writer process", "writer process gone"])
def test_several_artifacts_are_stored_in_one_go(
    tracker: MlflowTracker, client: mlflow.MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: bool
) -> None:
    """log_artifacts stores each file at its path (two of one name in two folders too): in one job of the writer
    process, or from this process when it is gone; a path that names no file stores nothing."""
    run_id = tracker.start(experiment="many-artifacts")
    assert tracker._writers.child is not None
    jobs: list[object] = []
    job = tracker._writers.child_reply
    monkeypatch.setattr(tracker._writers, "child_reply", lambda request: jobs.append(request.get("op")) or job(request))
    if not writer:
        tracker._writers.child._process.kill()
        tracker._writers.child._process.wait(10)
    files = {"summary.json": b"{}", "plots/a.svg": b"<svg/>", "other/a.svg": b"<svg>2</svg>", "deep/er/w.pt": b"\x00"}
    tracker.log_artifacts(files)
    with pytest.raises(ValueError, match="names no file"):
        tracker.log_artifacts({"ok.txt": b"1", "/": b"2"})
    tracker.finish("FINISHED")
    local = Path(
        mlflow.artifacts.download_artifacts(
            run_id=run_id, tracking_uri=tracker.tracking_uri, dst_path=str(tmp_path / "dl")
        )
    )
    stored = {str(path.relative_to(local)): path.read_bytes() for path in local.rglob("*") if path.is_file()}
    assert stored == files
    if writer:
        assert jobs[:2] == ["files", "end"]


@pytest.mark.slow
@pytest.mark.parametrize("status", ["FINISHED", "FAILED", "KILLED"])
def test_finish_sets_the_run_status(tracker: MlflowTracker, client: mlflow.MlflowClient, status: RunStatus) -> None:
    """finish ends the run with the given status."""
    run_id = tracker.start(experiment="status")
    tracker.finish(status)
    run = client.get_run(run_id)
    assert run.info.status == status
    assert run.info.end_time is not None


@pytest.mark.slow
def test_a_run_on_a_local_store_holds_room_for_its_status_until_it_ends(
    tracker: MlflowTracker, tracking_uri: str
) -> None:
    """From the moment its run is open, a tracker holds room beside a SQLite store for the run's end status (a full
    disk then still takes it), and gives it back when the run ends; a resumed run holds it again."""
    folder = Path(tracking_uri.removeprefix("sqlite:///")).parent

    def held() -> list[Path]:
        return sorted(folder.glob(".flasync-status-room-*"))

    run_id = tracker.start(experiment="room")
    (room,) = held()
    assert room.stat().st_blocks * 512 >= room.stat().st_size > 0
    tracker.finish("KILLED")
    assert held() == []
    resumed = MlflowTracker(tracking_uri, flush_interval_s=0.05)
    resumed.resume(run_id)
    assert len(held()) == 1
    resumed.finish("FINISHED")
    assert held() == []


@pytest.mark.slow
def test_finish_is_idempotent(tracker: MlflowTracker, client: mlflow.MlflowClient) -> None:
    """A second finish changes nothing."""
    run_id = tracker.start(experiment="status")
    tracker.finish("FAILED")
    tracker.finish("FINISHED")
    assert client.get_run(run_id).info.status == "FAILED"


@pytest.mark.slow
def test_finish_refuses_an_unknown_status(tracker: MlflowTracker) -> None:
    """A status other than FINISHED, FAILED or KILLED raises ValueError."""
    tracker.start(experiment="status")
    with pytest.raises(ValueError, match="RUNNING"):
        tracker.finish("RUNNING")  # type: ignore[arg-type]
    tracker.finish("FINISHED")


@pytest.mark.slow
def test_environment_variable_names_the_store(
    tracking_uri: str, client: mlflow.MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an argument the tracker uses MLFLOW_TRACKING_URI."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
    tracker = MlflowTracker()
    assert tracker.tracking_uri == tracking_uri
    run_id = tracker.start(experiment="env")
    tracker.finish("FINISHED")
    assert client.get_run(run_id).info.status == "FINISHED"


def test_default_store_is_sqlite_under_mlruns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no argument and no environment variable the store is ./mlruns/mlflow.db, made absolute."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    tracker = MlflowTracker()
    assert DEFAULT_TRACKING_URI == "sqlite:///mlruns/mlflow.db"
    assert tracker.tracking_uri == f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.slow
def test_artifacts_default_to_a_folder_next_to_the_database(tracker: MlflowTracker, store_dir: Path) -> None:
    """Without artifact_root, a new experiment keeps its artifacts in <db folder>/artifacts/<name>."""
    run_id = tracker.start(experiment="fresh one")
    tracker.log_bytes(b"x", "x.txt")
    tracker.finish("FINISHED")
    assert (store_dir / "artifacts" / "fresh_one" / run_id / "artifacts" / "x.txt").read_bytes() == b"x"


@pytest.mark.slow
def test_new_experiment_keeps_artifacts_under_artifact_root(
    tracking_uri: str, client: mlflow.MlflowClient, tmp_path: Path
) -> None:
    """A new experiment's artifact location is file://<artifact_root>/<sanitized name>."""
    tracker = MlflowTracker(tracking_uri, artifact_root=str(tmp_path / "art"))
    tracker.start(experiment="digits / fedbuff")
    tracker.finish("FINISHED")
    experiment = client.get_experiment_by_name("digits / fedbuff")
    assert experiment is not None
    assert experiment.artifact_location == (tmp_path / "art" / "digits___fedbuff").as_uri()


def test_ui_command_opens_the_store(tracker: MlflowTracker) -> None:
    """ui_command names the tracker's store."""
    assert tracker.ui_command() == f"mlflow ui --backend-store-uri {tracker.tracking_uri}"


def test_start_twice_is_refused(tracker: MlflowTracker) -> None:
    """A tracker records one run only."""
    tracker.start(experiment="twice")
    with pytest.raises(RuntimeError, match="already started"):
        tracker.start(experiment="twice")
    tracker.finish("FINISHED")


def test_a_run_opened_in_the_background_gets_what_was_logged_before_it_existed(
    tracker: MlflowTracker, client: mlflow.MlflowClient
) -> None:
    """start(wait=False) returns before the run exists; metrics, tags and artifacts logged meanwhile all reach it,
    and opened() returns its id."""
    called = int(time.time() * 1000)
    assert tracker.start(experiment="background", run_name="bg", params={"lr": 0.1}, wait=False) == ""
    tracker.log_metrics([Metric("m", float(i), 0, i) for i in range(1500)])
    tracker.set_tags({"mode": "sim"})
    tracker.log_dict({"a": 1}, "early.json")
    run_id = tracker.opened(timeout=120)
    assert run_id and tracker.run_id == run_id
    tracker.finish("FINISHED")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.start_time <= int(time.time() * 1000) and run.info.start_time >= called - 1
    assert (run.info.run_name, run.data.params["lr"], run.data.tags["mode"]) == ("bg", "0.1", "sim")
    assert sorted(m.step for m in client.get_metric_history(run_id, "m")) == list(range(1500))
    assert [a.path for a in client.list_artifacts(run_id)] == ["early.json"]


def test_a_deleted_experiment_fails_a_background_opening(tracker: MlflowTracker, client: mlflow.MlflowClient) -> None:
    """opened() raises what opening the run raised; metrics queued meanwhile are dropped, and finish returns."""
    client.delete_experiment(client.create_experiment("gone-background"))
    tracker.start(experiment="gone-background", wait=False)
    tracker.log_metrics([Metric("m", 1.0, 0, 0)])
    with pytest.raises(ExperimentDeletedError, match="deleted"):
        tracker.opened(timeout=120)
    tracker.finish("FAILED")
    assert tracker.run_id is None


def test_artifacts_before_start_are_refused(tracker: MlflowTracker) -> None:
    """Logging an artifact before start raises RuntimeError."""
    with pytest.raises(RuntimeError, match="start"):
        tracker.log_dict({}, "x.json")


@pytest.mark.slow
def test_log_model_stores_a_logged_model_of_the_run(tracker: MlflowTracker, client: mlflow.MlflowClient) -> None:
    """log_model records a READY logged model whose source is the run, and returns its duration."""
    run_id = tracker.start(experiment="models")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    seconds = tracker.log_model(model, name="mlp")
    tracker.finish("FINISHED")
    assert seconds > 0
    assert tracker.experiment_id is not None
    (logged,) = client.search_logged_models([tracker.experiment_id])
    assert (logged.name, logged.source_run_id, logged.status) == ("mlp", run_id, LoggedModelStatus.READY)
    outputs = client.get_run(run_id).outputs
    assert outputs is not None
    assert [o.model_id for o in outputs.model_outputs] == [logged.model_id]


@pytest.mark.slow
@pytest.mark.parametrize("writer_process", [True, False], ids=["in-the-writer", "in-process"])
def test_system_metrics_are_recorded(tracker: MlflowTracker, client: mlflow.MlflowClient, writer_process: bool) -> None:
    """With system_metrics, MLflow's monitor writes system/ metrics until finish (in the writer process, or in this
    one without it); the interval must be positive."""
    for bad in (0, 0.01, math.nan):
        with pytest.raises(ValueError, match=f"system_metrics_interval_s must be a finite number >= 0.1, got {bad}"):
            MlflowTracker(tracker.tracking_uri, system_metrics=True, system_metrics_interval_s=bad)
    tracker = MlflowTracker(
        tracker.tracking_uri, system_metrics=True, system_metrics_interval_s=0.1, writer_process=writer_process
    )
    run_id = tracker.start(experiment="system")
    deadline = time.monotonic() + 10
    while not any(k.startswith("system/") for k in client.get_run(run_id).data.metrics):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    tracker.finish("FINISHED")


def test_null_tracker_does_nothing() -> None:
    """NullTracker accepts every call and records nothing."""
    tracker: Tracker = NullTracker()
    tracker.start(experiment="x", run_name=None, params={"a": 1}, tags={})
    tracker.log_metrics([Metric("m", 1.0, 0, 0)])
    tracker.log_dict({"a": 1}, "a.json")
    tracker.log_bytes(b"", "b.bin")
    tracker.log_file("missing.txt")
    tracker.set_tags({"a": "b"})
    tracker.flush()
    tracker.finish("FINISHED")
    assert tracker.run_id is None
    assert tracker.ui_command() is None


@pytest.mark.slow
def test_runs_look_as_mlflow_users_expect(tracker: MlflowTracker, client: mlflow.MlflowClient) -> None:
    """The experiment is a training experiment (not MLflow's GenAI page), the run carries MLflow's standard source
    and user tags, and a data set is a dataset input with its digest and profile."""
    run_id = tracker.start(experiment="looks", run_name="fedbuff-digits-seed0-abc123")
    tracker.log_dataset("digits", "0123456789abcdef", "sklearn.datasets.load_digits", {"rows": 1437, "clients": 20})
    tracker.finish("FINISHED")
    experiment = client.get_experiment_by_name("looks")
    assert experiment is not None
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    run = client.get_run(run_id)
    assert run.info.run_name == "fedbuff-digits-seed0-abc123"
    assert {"mlflow.user", "mlflow.source.name", "mlflow.source.type"} <= set(run.data.tags)
    (entry,) = run.inputs.dataset_inputs
    assert (entry.dataset.name, entry.dataset.digest) == ("digits", "0123456789abcdef")
    assert json.loads(entry.dataset.profile) == {"rows": 1437, "clients": 20}
    assert [(tag.key, tag.value) for tag in entry.tags] == [("mlflow.data.context", "training")]


@pytest.mark.slow
def test_an_existing_experiment_without_a_kind_gets_one(client: mlflow.MlflowClient, tracking_uri: str) -> None:
    """An experiment made elsewhere without a kind is tagged; one that names its kind keeps it."""
    bare = client.create_experiment("made-elsewhere")
    genai = client.create_experiment("genai", tags={"mlflow.experimentKind": "genai_development"})
    for name in ("made-elsewhere", "genai"):
        tracker = MlflowTracker(tracking_uri)
        tracker.start(experiment=name)
        tracker.finish("FINISHED")
    assert client.get_experiment(bare).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment(genai).tags["mlflow.experimentKind"] == "genai_development"


@pytest.mark.slow
def test_a_model_with_an_input_example_is_saved_without_pickle(
    tracker: MlflowTracker, client: mlflow.MlflowClient, tmp_path: Path
) -> None:
    """With an input example the model is stored in MLflow's pt2 format (torch.export; no pickle to load), with a
    signature, and it loads and predicts batches of any size; a model torch.export cannot trace falls back to
    pickle."""
    import numpy as np

    run_id = tracker.start(experiment="safe-models")
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    tracker.log_model(model, name="mlp", input_example=np.zeros((2, 8), dtype=np.float32))

    class Branchy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 if float(x.sum()) > 0 else x  # data-dependent control flow: not exportable

    tracker.log_model(Branchy(), name="branchy", input_example=np.ones((2, 8), dtype=np.float32))
    tracker.finish("FINISHED")
    assert tracker.experiment_id is not None
    models = {m.name: m for m in client.search_logged_models([tracker.experiment_id])}
    files = {}
    for name, logged in models.items():
        folder = mlflow.artifacts.download_artifacts(f"{logged.artifact_location}/data", dst_path=str(tmp_path / name))
        files[name] = sorted(p.name for p in Path(folder).iterdir())
    assert files == {"mlp": ["model.pt2"], "branchy": ["model.pth", "pickle_module_info.txt"]}
    loaded = mlflow.pyfunc.load_model(models["mlp"].artifact_location)
    assert loaded.predict(np.ones((5, 8), dtype=np.float32)).shape == (5, 2)
    assert run_id


@pytest.mark.slow
def test_a_runs_view_is_saved_on_the_experiment_and_opened_by_the_ui_address(
    tracking_uri: str, client: mlflow.MlflowClient
) -> None:
    """The runs view is the experiment's shared-view tag, and the UI address opens the training runs with it."""
    view = {"selectedColumns": ["metrics.`server/eval/accuracy`"]}
    tracker = MlflowTracker(tracking_uri, runs_view=view)
    assert tracker.ui_url() is None  # no experiment yet
    tracker.start(experiment="viewed")
    tracker.finish("FINISHED")
    experiment = client.get_experiment_by_name("viewed")
    assert experiment is not None
    assert json.loads(experiment.tags["mlflow.sharedViewState.flasync"]) == view
    assert tracker.ui_url("http://host:5000/") == (
        f"http://host:5000/#/experiments/{experiment.experiment_id}/runs"
        "?workflowType=machine_learning&viewStateShareKey=flasync"
    )


@pytest.mark.parametrize("indent", [None, 2])
def test_yaml_text_writes_what_safe_dump_writes(indent: int | None) -> None:
    """A run's config, as libyaml's emitter writes it, is byte for byte the text of PyYAML's own safe_dump."""
    from flasync.config import load_config

    data = {
        **load_config().model_dump(mode="json"),
        "odd": ["a: b", "- c", "", "x" * 200, 1e-12, float("inf"), None, True, "\u00e9t\u00e9"],
    }
    assert yaml_text(data, indent=indent) == yaml.safe_dump(data, indent=indent, sort_keys=False)


def test_metrics_the_store_cannot_take_in_time_reach_the_run_through_its_journal(
    tracking_uri: str, client: mlflow.MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store slower than the run: the writer's backlog overflows into the run's journal instead of dropping rows
    (before: 200,512 rows of a soak were dropped with one warning), and the journal is replayed into the run before
    it ends: every row is in the store, and no row is counted lost."""
    from flasync.tracking import _writers, writer

    monkeypatch.setattr(_writers, "MetricWriter", functools.partial(writer.MetricWriter, max_backlog=50))
    send = _writers.RunWriters._send_metrics

    def slow(self: _writers.RunWriters, metrics: list[Metric]) -> None:
        time.sleep(0.05)
        send(self, metrics)

    monkeypatch.setattr(_writers.RunWriters, "_send_metrics", slow)
    tracker = MlflowTracker(tracking_uri, flush_interval_s=0.01, spool_root=tmp_path / "spool")
    run_id = tracker.start(experiment="slow-store")
    for step in range(40):
        tracker.log_metrics([Metric(f"m{k}", float(step), 0, step) for k in range(10)])
        time.sleep(0.002)
    tracker.finish("FINISHED")
    assert all(len(client.get_metric_history(run_id, f"m{k}")) == 40 for k in range(10))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "flasync.metric_rows_lost" not in run.data.tags
    assert list((tmp_path / "spool").rglob("*.jsonl"))  # the overflow went through the journal


def test_rows_with_nowhere_to_go_are_counted_in_the_summary_the_profile_and_a_tag(
    tracking_uri: str, client: mlflow.MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog that overflows while the journal cannot take the overflow: the rows dropped are counted, never
    silently: in the run's summary, its profile (those dropped by then), the tag flasync.metric_rows_lost and one
    warning."""
    import flasync
    from flasync.testing import small_config
    from flasync.tracking import _writers, failover, writer

    monkeypatch.setattr(_writers, "MetricWriter", functools.partial(writer.MetricWriter, max_backlog=5))
    monkeypatch.setattr(failover.Failover, "spill", lambda self, metrics: False)
    send = _writers.RunWriters._send_metrics

    def slow(self: _writers.RunWriters, metrics: list[Metric]) -> None:
        time.sleep(0.02)
        send(self, metrics)

    monkeypatch.setattr(_writers.RunWriters, "_send_metrics", slow)
    tracker = MlflowTracker(tracking_uri, flush_interval_s=0.01, spool_root=tmp_path / "spool")
    config = small_config("tracking.enabled=true", "stop.max_versions=6", "diagnostics.profile=true")
    federation = flasync.Federation(config, tracker=tracker)
    summary = asyncio.run(federation.run())
    assert summary.metric_rows_lost > 0 and summary.metric_rows_lost == tracker.metric_rows_lost
    run = client.get_run(summary.run_id or "")
    assert run.data.tags["flasync.metric_rows_lost"] == str(summary.metric_rows_lost)
    assert federation.profile is not None
    assert 0 < federation.profile["tracking"]["metric_rows_lost"] <= summary.metric_rows_lost


def test_system_rows_the_writer_process_lost_are_counted_with_the_runs(
    tracking_uri: str, client: mlflow.MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer process's monitor says at the run's end how many system rows the store never took: they count in
    the run's lost rows (and its tag), with one warning."""
    from flasync.tracking import _writers

    reply = _writers.RunWriters.child_reply

    def lossy_end(self: _writers.RunWriters, request: Mapping[str, Any]) -> str | None:
        answer = reply(self, request)
        return "7" if request.get("op") == "end" and answer is not None else answer

    monkeypatch.setattr(_writers.RunWriters, "child_reply", lossy_end)
    tracker = MlflowTracker(tracking_uri, flush_interval_s=0.05)
    run_id = tracker.start(experiment="system-lost")
    tracker.finish("FINISHED")
    assert tracker.metric_rows_lost == 7
    assert client.get_run(run_id).data.tags["flasync.metric_rows_lost"] == "7"
