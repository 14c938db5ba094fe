"""The tracking spool: its file format, the replay into a real store, and a tracker that falls back to it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import mlflow
import pytest
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from flasync import cli
from flasync.tracking import MlflowTracker
from flasync.tracking.spool import (
    SpoolError,
    SpoolWriter,
    artifact_file,
    iter_records,
    load_progress,
    read_header,
    replay,
)
from flasync.tracking.store import bounded_http, prepare_sqlite_store
from tests.conftest import free_port


def _writer(path: Path, **header: Any) -> SpoolWriter:
    fields: dict[str, Any] = {
        "tracking_uri": "http://127.0.0.1:9",
        "experiment": "spooled",
        "run_name": "r1",
        "run_id": None,
        "start_time": 1_700_000_000_000,
    }
    fields.update(header)
    return SpoolWriter(path, **fields)


def _full_spool(path: Path, source: Path) -> None:
    """Write a spool with every record type."""
    spool = _writer(path)
    spool.tags({"mode": "async"})
    spool.params({"seed": 0, "lr": 0.1})
    spool.metrics([Metric("loss", 0.5, 1_700_000_000_100, 0), Metric("loss", 0.25, 1_700_000_000_200, 1)])
    spool.metrics([Metric("acc", math.nan, 1_700_000_000_300, 1), Metric("acc", 0.9, 1_700_000_000_400, 2)])
    spool.artifact_bytes(b'{"a": 1}', "summary.json")
    (source / "model").mkdir()
    (source / "model" / "MLmodel").write_text("flavors: {}\n")
    spool.artifact_path(source / "model", None)
    spool.dataset("digits", "0123456789abcdef", "sklearn", '{"rows": 10}', "training")
    spool.status("FINISHED", 1_700_000_001_000)
    spool.close()


# ----------------------------------------------------------------------------------------------------- format
def test_records_round_trip(tmp_path: Path) -> None:
    """Every record written is read back, in order, with NaN values, and the header names store and run."""
    spool = tmp_path / "run.jsonl"
    (tmp_path / "src").mkdir()
    _full_spool(spool, tmp_path / "src")
    header, first = read_header(spool)
    assert header["tracking_uri"] == "http://127.0.0.1:9"
    assert (header["experiment"], header["run_name"], header["run_id"]) == ("spooled", "r1", None)
    records = [record for record, _ in iter_records(spool, first)]
    kinds = ["tags", "params", "metrics", "metrics", "artifact", "artifact", "dataset", "status"]
    assert [r["type"] for r in records] == kinds
    assert records[1]["params"] == {"seed": "0", "lr": "0.1"}
    assert records[2]["metrics"] == [["loss", 0.5, 1_700_000_000_100, 0], ["loss", 0.25, 1_700_000_000_200, 1]]
    assert math.isnan(records[3]["metrics"][0][1])
    assert (tmp_path / records[4]["file"]).read_bytes() == b'{"a": 1}'
    assert (tmp_path / records[5]["file"] / "MLmodel").exists()
    assert records[6]["name"] == "digits" and records[6]["profile"] == '{"rows": 10}'
    assert records[7] == {"type": "status", "status": "FINISHED", "end_time": 1_700_000_001_000}


def test_offsets_resume_reading(tmp_path: Path) -> None:
    """Reading from a record's end offset yields exactly the records after it."""
    spool = tmp_path / "run.jsonl"
    (tmp_path / "src").mkdir()
    _full_spool(spool, tmp_path / "src")
    _, first = read_header(spool)
    all_records = list(iter_records(spool, first))
    rest = [record for record, _ in iter_records(spool, all_records[2][1])]
    assert rest == [record for record, _ in all_records[3:]]


def test_a_torn_last_line_is_not_read(tmp_path: Path) -> None:
    """A record cut short by a crash (no newline) is skipped; the complete ones are read."""
    spool = tmp_path / "run.jsonl"
    writer = _writer(spool)
    writer.params({"a": 1})
    writer.close()
    with spool.open("a") as file:
        file.write('{"type": "metr')
    _, first = read_header(spool)
    assert [r["type"] for r, _ in iter_records(spool, first)] == ["params"]


def test_an_existing_spool_is_not_overwritten(tmp_path: Path) -> None:
    """SpoolWriter refuses a path that exists."""
    (tmp_path / "run.jsonl").write_text("keep")
    with pytest.raises(FileExistsError):
        _writer(tmp_path / "run.jsonl")
    assert (tmp_path / "run.jsonl").read_text() == "keep"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "line 1 is not JSON"),
        ("not json\n", "line 1 is not JSON"),
        ('{"type": "header"}\n', "not a flasync tracking spool header"),
        (
            '{"type": "header", "format": "flasync-tracking-spool", "version": 99}\n',
            "spool version 99 is not supported",
        ),
        (
            '{"type": "header", "format": "flasync-tracking-spool", "version": 1, "experiment": "e",'
            ' "start_time": 1}\n',
            "header has no 'tracking_uri'",
        ),
    ],
)
def test_bad_headers_are_refused(tmp_path: Path, content: str, message: str) -> None:
    """A file that is not a version-1 spool is refused with a message naming the problem."""
    spool = tmp_path / "bad.jsonl"
    spool.write_text(content)
    with pytest.raises(SpoolError, match=message):
        read_header(spool)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "line 2: not a spool record"),
        ('{"type": "secret"}', "not a spool record"),
        ('{"type": "metrics", "metrics": [["loss", "high", 1, 0]]}', "malformed 'metrics' record"),
        ('{"type": "status", "status": "RUNNING", "end_time": 1}', "malformed 'status' record"),
        ('{"type": "params", "params": [1]}', "malformed 'params' record"),
        ("{oops", "line 2 is not JSON"),
    ],
)
def test_bad_records_are_refused(tmp_path: Path, line: str, message: str) -> None:
    """A malformed record raises SpoolError naming the line."""
    spool = tmp_path / "bad.jsonl"
    _writer(spool).close()
    with spool.open("a") as file:
        file.write(line + "\n")
    _, first = read_header(spool)
    with pytest.raises(SpoolError, match=message):
        list(iter_records(spool, first, first_line=2))


def test_missing_spool_is_refused(tmp_path: Path) -> None:
    """A missing file raises SpoolError."""
    with pytest.raises(SpoolError, match="cannot read spool"):
        read_header(tmp_path / "absent.jsonl")


# ------------------------------------------------------------------------------------------------ bounded_http
def test_bounded_http_sets_bounds_only_inside_and_only_for_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The HTTP bounds exist inside the block for an http URI; a user's own setting is kept; SQLite is untouched."""
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_TIMEOUT", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    with bounded_http("sqlite:///x.db"):
        assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    with bounded_http("http://127.0.0.1:9", timeout_s=4, retries=0), bounded_http("http://127.0.0.1:9"):
        assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "4"
        assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "3"


# ------------------------------------------------------------------------------------------------------ replay
@pytest.mark.slow
def test_replay_sends_every_record_once(tmp_path: Path) -> None:
    """Replay creates the run with the header's name and start, logs everything, and a rerun adds nothing."""
    spool = tmp_path / "run.jsonl"
    (tmp_path / "src").mkdir()
    _full_spool(spool, tmp_path / "src")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    result = replay(spool, uri)
    assert (result.records, result.params, result.tags, result.metrics, result.artifacts) == (8, 2, 1, 4, 2)
    assert result.status == "FINISHED"
    client = mlflow.MlflowClient(uri)
    run = client.get_run(str(result.run_id))
    assert run.info.run_name == "r1"
    assert run.info.start_time == 1_700_000_000_000
    assert run.info.end_time == 1_700_000_001_000
    assert run.info.status == "FINISHED"
    assert run.data.params == {"seed": "0", "lr": "0.1"}
    assert run.data.tags["mode"] == "async"
    loss = [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(loss) == [(0, 0.5, 1_700_000_000_100), (1, 0.25, 1_700_000_000_200)]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.json", "model"}
    (entry,) = run.inputs.dataset_inputs
    assert (entry.dataset.name, entry.dataset.digest, entry.dataset.profile) == (
        "digits",
        "0123456789abcdef",
        '{"rows": 10}',
    )

    again = replay(spool, uri)
    assert (again.records, again.already, again.run_id) == (0, 8, result.run_id)
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 2


def test_replay_continues_after_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay that fails half-way keeps its progress; the rerun finishes it without duplicates."""
    spool = tmp_path / "run.jsonl"
    (tmp_path / "src").mkdir()
    _full_spool(spool, tmp_path / "src")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    prepare_sqlite_store(uri)  # the store's schema from flasync's seed, not MLflow's migrations (seconds of CPU)
    real = mlflow.MlflowClient.log_artifact
    monkeypatch.setattr(
        mlflow.MlflowClient, "log_artifact", lambda *a, **k: (_ for _ in ()).throw(MlflowException("store down"))
    )
    with pytest.raises(MlflowException, match="store down"):
        replay(spool, uri)
    assert next(iter(load_progress(spool).values()))["records"] == 4
    monkeypatch.setattr(mlflow.MlflowClient, "log_artifact", real)
    result = replay(spool, uri)
    assert (result.records, result.already) == (4, 4)
    client = mlflow.MlflowClient(uri)
    assert len(client.get_metric_history(str(result.run_id), "acc")) == 2
    assert client.get_run(str(result.run_id)).info.status == "FINISHED"


def test_replay_continues_the_run_named_in_the_header(tmp_path: Path) -> None:
    """A spool whose run was created before the store failed is replayed into that same run."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    prepare_sqlite_store(uri)  # the store's schema from flasync's seed, not MLflow's migrations (seconds of CPU)
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("spooled"))
    spool = _writer(tmp_path / "run.jsonl", tracking_uri=uri, run_id=run.info.run_id)
    spool.metrics([Metric("loss", 1.0, 1, 5)])
    spool.status("KILLED", 2)
    spool.close()
    result = replay(tmp_path / "run.jsonl")
    assert result.run_id == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5]


# ------------------------------------------------------------------------------------------- tracker fallback
class _FlakyClient:
    """An MlflowClient proxy whose calls fail while ``down`` is set."""

    def __init__(self, uri: str) -> None:
        self.real = mlflow.MlflowClient(uri)
        self.down = False
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.real, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                self.failed += 1
                raise MlflowException(f"{name}: connection refused")
            return attribute(*args, **kwargs)

        return call


def _metrics(first: int, count: int) -> list[Metric]:
    return [Metric("m", float(step), 1_700_000_000_000 + step, step) for step in range(first, first + count)]


@pytest.mark.slow
def test_tracker_spools_while_the_store_fails_and_replays_when_it_answers(tmp_path: Path) -> None:
    """Metrics, tags and artifacts logged during an outage reach the run, in order, exactly once."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    flaky = _FlakyClient(uri)
    tracker = MlflowTracker(uri, writer_process=False, spool_path=tmp_path / "run.jsonl", retry_interval_s=0.0)
    tracker._run.client = flaky  # type: ignore[assignment]
    run_id = tracker.start(experiment="flaky", params={"a": 1})
    tracker.log_metrics(_metrics(0, 10))
    tracker.flush()
    flaky.down = True
    tracker.log_metrics(_metrics(10, 10))
    tracker.flush()
    tracker.set_tags({"phase": "outage"})
    tracker.log_bytes(b"x", "during/outage.txt")
    assert tracker.offline
    assert tracker.spool_path == tmp_path / "run.jsonl"
    flaky.down = False
    tracker.log_metrics(_metrics(20, 10))
    tracker.flush()
    assert not tracker.offline
    tracker.finish("FINISHED")
    assert tracker.replay_command() is None
    assert flaky.failed > 0
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["phase"] == "outage"
    assert [m.step for m in client.get_metric_history(run_id, "m")] == list(range(30))
    assert [a.path for a in client.list_artifacts(run_id, "during")] == ["during/outage.txt"]
    assert replay(tmp_path / "run.jsonl", uri).records == 0  # the live run replayed everything already


@pytest.mark.slow
def test_tracker_starts_when_the_store_is_down_and_creates_the_run_when_it_answers(tmp_path: Path) -> None:
    """With the store down at start, the run is created (with its params and tags) on recovery."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    flaky = _FlakyClient(uri)
    flaky.down = True
    tracker = MlflowTracker(uri, writer_process=False, spool_path=tmp_path / "run.jsonl", retry_interval_s=0.0)
    tracker._run.client = flaky  # type: ignore[assignment]
    assert tracker.start(experiment="late", run_name="late-run", params={"a": 1}, tags={"t": "v"}) == ""
    tracker.log_metrics(_metrics(0, 5))
    tracker.flush()
    flaky.down = False
    tracker.finish("KILLED")
    assert tracker.run_id
    run = mlflow.MlflowClient(uri).get_run(tracker.run_id)
    assert (run.info.run_name, run.info.status) == ("late-run", "KILLED")
    assert run.data.params == {"a": "1"}
    assert run.data.tags["t"] == "v"
    assert [m.step for m in mlflow.MlflowClient(uri).get_metric_history(tracker.run_id, "m")] == list(range(5))


def test_unreachable_server_leaves_the_spool_and_says_how_to_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Against a port where nothing listens, start returns promptly, and the tracker's warnings say where the
    records went and the replay command (through its logger: library code prints nothing)."""
    tracker = MlflowTracker(f"http://127.0.0.1:{free_port()}", writer_process=False, spool_path=tmp_path / "run.jsonl")
    assert tracker.start(experiment="nowhere", params={"a": 1}, tags={"t": "v"}) == ""
    tracker.log_metrics(_metrics(0, 3))
    tracker.flush()
    tracker.log_dict({"accuracy": 0.5}, "summary.json")
    tracker.finish("FINISHED")
    said = capsys.readouterr()
    err = said.out + said.err
    assert f"tracking records go to {tmp_path / 'run.jsonl'}" in err
    assert f"flasync tracking replay {tmp_path / 'run.jsonl'}" in err
    assert tracker.replay_command() == f"flasync tracking replay {tmp_path / 'run.jsonl'}"
    _, first = read_header(tmp_path / "run.jsonl")
    kinds = [r["type"] for r, _ in iter_records(tmp_path / "run.jsonl", first)]
    assert kinds == ["tags", "params", "metrics", "artifact", "status"]


# ---------------------------------------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_cli_replay_reports_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`flasync tracking replay` prints the counts and exits 0; a second time, nothing is sent again."""
    spool = tmp_path / "run.jsonl"
    (tmp_path / "src").mkdir()
    _full_spool(spool, tmp_path / "src")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "replayed 8 record(s)" in out and "1 dataset inputs" in out
    assert "4 metric values, 2 artifacts, 1 dataset inputs, status FINISHED" in out
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", uri]) == 0
    assert "replayed 0 record(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read spool"),
        ("hello\n", "line 1 is not JSON"),
        ('{"type": "header", "format": "flasync-tracking-spool", "version": 2}\n', "spool version 2"),
    ],
)
def test_cli_replay_refuses_a_bad_spool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    """A bad spool gets a one-line error and exit 2; nothing is written anywhere."""
    spool = tmp_path / "bad.jsonl"
    if content is not None:
        spool.write_text(content)
    store = tmp_path / "store"
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", f"sqlite:///{store}/mlflow.db"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flasync: error: ")
    assert message in err
    assert err.count("\n") == 1
    assert not store.exists()


def test_cli_replay_refuses_a_malformed_record_before_sending_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A malformed record anywhere in the file stops the replay before the first record is sent."""
    spool = tmp_path / "run.jsonl"
    writer = _writer(spool)
    writer.params({"a": 1})
    writer.close()
    with spool.open("a") as file:
        file.write(json.dumps({"type": "metrics", "metrics": [["m", 1.0]]}) + "\n")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", uri]) == 2
    assert "line 3: malformed 'metrics' record" in capsys.readouterr().err
    assert load_progress(spool) == {}


def test_cli_tracking_needs_an_action(capsys: pytest.CaptureFixture[str]) -> None:
    """`flasync tracking` alone is a usage error (exit 2)."""
    assert cli.main(["tracking"]) == 2
    assert "replay" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"type": "artifact", "file": "/etc/passwd", "artifact_path": None}, "malformed 'artifact' record"),
        ({"type": "artifact", "file": "../../etc/passwd", "artifact_path": None}, "malformed 'artifact' record"),
        ({"type": "artifact", "file": "other.artifacts/x", "artifact_path": None}, "outside the spool's own folder"),
        ({"type": "metrics", "metrics": [["m", 1.0, 10**30, 0]]}, "malformed 'metrics' record"),
        ({"type": "metrics", "metrics": [["m", 1.0, 0, -(2**64)]]}, "malformed 'metrics' record"),
        ({"type": "status", "status": "FINISHED", "end_time": 2**70}, "malformed 'status' record"),
        ({"type": "params", "params": {"a": ["not", "a", "string"]}}, "malformed 'params' record"),
    ],
    ids=["absolute-file", "dotdot-file", "another-folder", "huge-timestamp", "huge-step", "huge-end", "param-list"],
)
def test_a_crafted_spool_is_refused_before_anything_is_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: dict[str, Any], message: str
) -> None:
    """Replay uploads files only from the spool's own folder and refuses integers no store keeps: one line, exit 2,
    nothing sent (before: /etc/passwd was uploaded; a huge integer blocked the replay for ever)."""
    spool = tmp_path / "run.jsonl"
    writer = _writer(spool)
    writer.params({"a": 1})
    writer.close()
    (tmp_path / "other.artifacts").mkdir()
    (tmp_path / "other.artifacts" / "x").write_text("not this spool's")
    with spool.open("a") as file:
        file.write(json.dumps(record) + "\n")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert load_progress(spool) == {}


@pytest.mark.parametrize("how", ["linked-folder", "linked-file", "header-elsewhere"])
def test_a_spool_never_uploads_a_file_reached_through_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """Replay uploads only regular files inside the spool's own artifacts folder, reached without a link: a header
    naming a linked folder, a link planted in the folder, or a header naming a folder elsewhere is refused in one
    line, exit 2, nothing sent (before: a header naming a linked folder uploaded /etc/passwd)."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "1").mkdir()
    (secret / "1" / "passwd").write_text("root:x:0:0")
    spool = tmp_path / "run.jsonl"
    writer = _writer(spool)
    writer.params({"a": 1})
    writer.close()
    lines = spool.read_text().splitlines()
    header = json.loads(lines[0])
    if how == "linked-folder":  # the header names a folder that is a link to another one
        (tmp_path / "evil.artifacts").symlink_to(secret, target_is_directory=True)
        header["artifacts"] = "evil.artifacts"
        file = "evil.artifacts/1/passwd"
    elif how == "linked-file":  # the spool's own folder holds a link to a file elsewhere
        (tmp_path / "run.artifacts" / "1").mkdir(parents=True)
        (tmp_path / "run.artifacts" / "1" / "passwd").symlink_to(secret / "1" / "passwd")
        file = "run.artifacts/1/passwd"
    else:  # the header names a folder that is no plain name beside the spool
        header["artifacts"] = "secret/../secret.artifacts"
        file = "secret/1/passwd"
    lines[0] = json.dumps(header)
    lines.append(json.dumps({"type": "artifact", "file": file, "artifact_path": None}))
    spool.write_text("\n".join(lines) + "\n")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("link" in err[0] or "outside" in err[0] or "folder name" in err[0]), err
    assert load_progress(spool) == {}
    assert not (tmp_path / "store").exists() or "root:x" not in "".join(
        p.read_text(errors="ignore") for p in (tmp_path / "store").rglob("passwd")
    )


def test_artifact_file_takes_a_regular_file_of_the_spools_own_folder(tmp_path: Path) -> None:
    """The check passes the spool's own files and names what is wrong with the others."""
    own = tmp_path / "run.artifacts" / "3"
    own.mkdir(parents=True)
    (own / "summary.json").write_text("{}")
    header = {"artifacts": "run.artifacts"}
    assert artifact_file(tmp_path, header, "run.artifacts/3/summary.json") == own / "summary.json"
    with pytest.raises(SpoolError, match="missing"):
        artifact_file(tmp_path, header, "run.artifacts/4/summary.json")
    assert artifact_file(tmp_path, header, "run.artifacts/4/x", must_exist=False) == tmp_path / "run.artifacts/4/x"
    assert artifact_file(tmp_path, header, "run.artifacts/3") == own  # a folder artifact of regular files
    (own / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SpoolError, match="link in it is a link"):
        artifact_file(tmp_path, header, "run.artifacts/3")
    with pytest.raises(SpoolError, match="outside"):
        artifact_file(tmp_path, header, "run.artifacts/../run.artifacts/3/summary.json")


@pytest.mark.slow
def test_replaying_a_once_live_run_into_another_store_says_it_is_partial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spool whose run was live elsewhere first holds only the later records: the replay says so."""
    spool = tmp_path / "run.jsonl"
    writer = _writer(spool, run_id="abcdef0123456789abcdef0123456789")
    writer.metrics([Metric("loss", 0.5, 1_700_000_000_100, 3)])
    writer.close()
    uri = f"sqlite:///{tmp_path}/other/mlflow.db"
    assert cli.main(["tracking", "replay", str(spool), "--tracking-uri", uri]) == 0
    said = capsys.readouterr()
    assert "holds only the records after the failure" in said.err
    assert replay(spool, uri).partial  # rerunning: nothing more to send, still partial


# --------------------------------------------------------------------------------------------------- full disk
def test_a_write_that_fails_leaves_no_torn_record_and_counts_what_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC in the middle of a record: the file is cut back to its last whole record, the failure is reported
    once, and later records are counted as lost, never raised."""
    import errno

    import flasync.tracking.spool as spool_module

    failures: list[str] = []
    writer = _writer(tmp_path / "run.jsonl", on_failure=lambda path, reason: failures.append(reason))
    writer.params({"a": 1})
    real_write = spool_module.os.write

    def half_then_full(fd: int, data: bytes) -> int:
        if len(data) > 40:
            real_write(fd, data[:20])  # part of the record reaches the disk, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(spool_module.os, "write", half_then_full)
    writer.metrics([Metric("loss", float(i), 1_700_000_000_000 + i, i) for i in range(5)])
    writer.tags({"late": "yes"})
    writer.artifact_bytes(b"x", "late.txt")
    writer.close()
    assert failures == ["No space left on device"]
    assert writer.lost == {"metrics": 5, "tags": 1, "artifact": 1}
    _, first = read_header(tmp_path / "run.jsonl")
    assert [r["type"] for r, _ in iter_records(tmp_path / "run.jsonl", first)] == ["params"]  # whole records only


def test_a_run_whose_spool_fills_the_disk_finishes_and_says_what_was_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The store does not answer and the spool's disk fills: training goes on, the run finishes with its summary,
    and one warning names what could not be written."""
    import errno

    import flasync
    import flasync.tracking.spool as spool_module
    from flasync.testing import small_config

    real_write = spool_module.os.write
    calls = {"n": 0}

    def fills_up(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(spool_module.os, "write", fills_up)
    tracker = MlflowTracker(f"http://127.0.0.1:{free_port()}", writer_process=False, spool_path=tmp_path / "s.jsonl")
    summary = flasync.run(small_config("tracking.enabled=true", "stop.max_versions=4"), tracker=tracker)
    assert summary.versions == 4
    said = capsys.readouterr()
    text = said.out + said.err
    assert "cannot write the tracking spool" in text and "No space left on device" in text
    assert "could not be written (No space left on device):" in text and "lost" in text
    assert "the store holds no run of it" in text and "marked FAILED" not in text  # the store never answered


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_real_full_filesystem(tmp_path: Path) -> None:
    """On a 1 MB tmpfs the spool fills up for real: whole records only, and the loss is counted."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        writer = _writer(mount / "run.jsonl")
        for i in range(2000):
            writer.metrics([Metric(f"m{j}", float(i), 1_700_000_000_000 + i, i) for j in range(50)])
        writer.close()
        assert writer.failure == "No space left on device" and writer.lost["metrics"] > 0
        _, first = read_header(mount / "run.jsonl")
        assert all(r["type"] == "metrics" for r, _ in iter_records(mount / "run.jsonl", first))
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("store_takes_the_status", [True, False])
def test_a_full_disk_under_store_and_spool_ends_the_run_failed_or_says_its_status_was_lost(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    store_takes_the_status: bool,
) -> None:
    """A full disk's shape: the store refuses metric rows and the spool cannot be written. A store that still takes
    the run's end status holds the run FAILED and no status is counted lost (before: the status the store took was
    counted lost too); one that does not leaves the run RUNNING, and the warning says so instead of saying FAILED, with
    the command that marks it FAILED later."""
    import errno
    import sqlite3

    import flasync
    import flasync.tracking.spool as spool_module
    from flasync.testing import small_config
    from flasync.tracking.sqlite_metrics import SqliteMetrics

    refused = {"n": 0}

    def full(*args: Any, **kwargs: Any) -> None:
        refused["n"] += 1
        raise sqlite3.OperationalError("database or disk is full")

    real_log_batch = mlflow.MlflowClient.log_batch

    def refuses_metrics(self: mlflow.MlflowClient, run_id: str, metrics: Any = (), *args: Any, **kwargs: Any) -> Any:
        if metrics:
            full()
        return real_log_batch(self, run_id, metrics, *args, **kwargs)

    real_write = spool_module.os.write
    written_since = {"n": 0}

    def fills_up(fd: int, data: bytes) -> int:
        """Once the store is full, the spool takes two writes more, then its disk is full too."""
        if refused["n"]:
            written_since["n"] += 1
            if written_since["n"] > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(SqliteMetrics, "write", full)
    monkeypatch.setattr(mlflow.MlflowClient, "log_batch", refuses_metrics)
    if not store_takes_the_status:
        monkeypatch.setattr(mlflow.MlflowClient, "set_terminated", full)
    monkeypatch.setattr(spool_module.os, "write", fills_up)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    prepare_sqlite_store(uri)
    tracker = MlflowTracker(uri, writer_process=False, spool_root=tmp_path / "spool")
    summary = flasync.run(small_config("tracking.enabled=true", "stop.max_versions=4"), tracker=tracker)
    assert summary.versions == 4
    said = capsys.readouterr()
    (lost,) = [line for line in (said.out + said.err).splitlines() if "tracking.records_lost" in line]
    (run,) = mlflow.MlflowClient(uri).search_runs(["0", "1"])
    if store_takes_the_status:
        assert run.info.status == "FAILED"
        assert "a run that finished is marked FAILED" in lost and "lost_status" not in lost, lost
    else:
        assert run.info.status == "RUNNING"
        assert "end status could not be written either: the store shows it RUNNING" in lost, lost
        assert "lost_status=1" in lost, lost
        # The command the warning names marks it FAILED once the store takes writes again and the run's process
        # is gone (this one stands for it: the run's owner tag names a process that ended).
        command = f"flasync tracking mark-failed {run.info.run_id} --tracking-uri {uri}"
        assert command in lost, lost
        monkeypatch.undo()
        import subprocess
        import sys

        from flasync.core.owner import PID_TAG

        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        mlflow.MlflowClient(uri).set_tag(run.info.run_id, PID_TAG, gone.stdout.strip())
        assert cli.main(command.split()[1:]) == 0
        assert f"{run.info.run_id}  FAILED" in capsys.readouterr().out
        assert mlflow.MlflowClient(uri).get_run(run.info.run_id).info.status == "FAILED"
