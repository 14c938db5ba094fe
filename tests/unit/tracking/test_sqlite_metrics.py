"""Metric rows written straight into a SQLite store: the store ends as MLflow's own ``log_batch`` leaves it."""

from __future__ import annotations

import io
import json
import math
import sqlite3
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Metric

from flasync.tracking._child import ChildLogBatch, _answer, _Aside, _Monitor
from flasync.tracking.sqlite_metrics import SqliteMetrics
from flasync.tracking.store import prepare_sqlite_store

Row = tuple[str, float, int, int]

# What MLflow's log_batch treats specially: NaN and infinities, a row repeated in its batch and in a later batch,
# a NaN and a 0.0 at the same step and time (equal as stored values, told apart by is_nan), steps out of order,
# an equal (step, timestamp, value) that must not replace the latest value, and integer values.
BATCHES: list[list[Row]] = [
    [
        ("loss", 0.5, 1_000, 0),
        ("loss", 0.4, 1_001, 1),
        ("loss", 0.4, 1_001, 1),
        ("loss", math.nan, 1_002, 2),
        ("loss", math.nan, 1_002, 2),
        ("grad", math.inf, 1_000, 0),
        ("grad", -math.inf, 1_000, 1),
        ("zero", math.nan, 5, 3),
        ("zero", 0.0, 5, 3),
        ("late", 3.0, 2_000, 9),
        ("late", 1.0, 1_000, 4),
    ],
    [
        ("loss", 0.4, 1_001, 1),
        ("loss", 0.3, 999, 2),
        ("late", 7.0, 2_000, 9),
        ("late", 2.0, 5_000, 8),
        ("count", 3, 1_000, 0),  # an int value, as a caller may send
        ("zero", 0.0, 5, 3),
    ],
]


@pytest.fixture
def client(tracking_uri: str) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri)


def _run(client: mlflow.MlflowClient, name: str) -> str:
    experiment = client.get_experiment_by_name(name) or client.get_experiment(client.create_experiment(name))
    return str(client.create_run(experiment.experiment_id).info.run_id)


def _stored(tracking_uri: str, run_id: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """Return the run's rows of ``metrics`` and ``latest_metrics`` as the store holds them (run id left out)."""
    path = tracking_uri.removeprefix("sqlite:///")
    with sqlite3.connect(path) as connection:
        metrics = connection.execute(
            "SELECT key, value, timestamp, step, is_nan FROM metrics WHERE run_uuid = ? ORDER BY 1, 2, 3, 4, 5",
            (run_id,),
        ).fetchall()
        latest = connection.execute(
            "SELECT key, value, timestamp, step, is_nan FROM latest_metrics WHERE run_uuid = ? ORDER BY 1",
            (run_id,),
        ).fetchall()
    return metrics, latest


def test_rows_are_stored_as_log_batch_stores_them(tracking_uri: str, client: mlflow.MlflowClient) -> None:
    """Both tables and MLflow's own reads of them are the same for a run written directly and one written by
    log_batch from the same batches."""
    by_mlflow, direct_run = _run(client, "direct"), _run(client, "direct")
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        for batch in BATCHES:
            client.log_batch(by_mlflow, metrics=[Metric(*row) for row in batch], synchronous=True)
            writer.write(direct_run, batch)
    finally:
        writer.close()
    expected = _stored(tracking_uri, by_mlflow)
    assert expected[0] and expected[1]
    assert _stored(tracking_uri, direct_run) == expected

    def latest(run_id: str) -> dict[str, str]:  # as strings: NaN equals NaN
        return {key: str(value) for key, value in client.get_run(run_id).data.metrics.items()}

    assert latest(direct_run) == latest(by_mlflow)
    for key in ("loss", "late", "zero"):

        def history(run_id: str, key: str = key) -> list[tuple[object, ...]]:
            return sorted((m.step, m.timestamp, str(m.value)) for m in client.get_metric_history(run_id, key))

        assert history(direct_run) == history(by_mlflow)


def test_a_refused_row_writes_nothing_of_its_batch(tracking_uri: str, client: mlflow.MlflowClient) -> None:
    """A key MLflow refuses, or a negative timestamp, raises with MLflow's message; the batch is not stored."""
    run_id = _run(client, "direct")
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        with pytest.raises(ValueError, match="Invalid value"):
            writer.write(run_id, [("fine", 1.0, 1, 0), ("bad\nkey", 1.0, 1, 0)])
        with pytest.raises(ValueError, match="imestamp"):
            writer.write(run_id, [("fine", 1.0, -1, 0)])
        with pytest.raises(ValueError, match="Invalid value"):
            writer.write(run_id, [("fine", "1.0", 1, 0)])  # type: ignore[list-item]
    finally:
        writer.close()
    assert _stored(tracking_uri, run_id) == ([], [])


def test_only_active_runs_that_exist_are_written(tracking_uri: str, client: mlflow.MlflowClient) -> None:
    """A deleted run refuses metrics as log_batch refuses them, and an unknown run id is named."""
    run_id = _run(client, "direct")
    client.delete_run(run_id)
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        with pytest.raises(ValueError, match="must be in the 'active' state"):
            writer.write(run_id, [("a", 1.0, 1, 0)])
        with pytest.raises(LookupError, match="not found"):
            writer.write("0" * 32, [("a", 1.0, 1, 0)])
        writer.write(run_id, [])  # nothing to write: no check, no transaction
    finally:
        writer.close()
    assert _stored(tracking_uri, run_id) == ([], [])


def test_a_locked_store_fails_the_batch_and_the_next_one_is_written(
    tracking_uri: str, client: mlflow.MlflowClient
) -> None:
    """A store held locked past the timeout raises sqlite3's error; the writer is usable again once it is free."""
    run_id = _run(client, "direct")
    writer = SqliteMetrics.open(tracking_uri, timeout_s=0.05)
    assert writer is not None
    blocker = sqlite3.connect(tracking_uri.removeprefix("sqlite:///"), isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            writer.write(run_id, [("a", 1.0, 1, 0)])
        blocker.execute("ROLLBACK")
        writer.write(run_id, [("a", 2.0, 2, 1)])
    finally:
        blocker.close()
        writer.close()
    assert _stored(tracking_uri, run_id) == ([("a", 2.0, 2, 1, 0)], [("a", 2.0, 2, 1, 0)])


def test_only_stores_whose_tables_fit_are_opened(tmp_path: Path) -> None:
    """A server URI, a missing file, a file without MLflow's tables and tables of another shape all give None."""
    assert SqliteMetrics.open("http://localhost:5000") is None
    assert SqliteMetrics.open(f"sqlite:///{tmp_path}/missing.db") is None
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    assert SqliteMetrics.open(f"sqlite:///{empty}") is None
    uri = f"sqlite:///{tmp_path}/other.db"
    prepare_sqlite_store(uri)
    fits = SqliteMetrics.open(uri)
    assert fits is not None
    fits.close()
    with sqlite3.connect(tmp_path / "other.db") as connection:
        connection.execute("ALTER TABLE metrics ADD COLUMN dataset_uuid VARCHAR(36)")
    assert SqliteMetrics.open(uri) is None


def _named(tracking_uri: str, table: str, run_id: str) -> list[tuple[object, ...]]:
    """Return the run's rows of ``params`` or ``tags`` as the store holds them (run id left out)."""
    with sqlite3.connect(tracking_uri.removeprefix("sqlite:///")) as connection:
        query = f"SELECT key, value FROM {table} WHERE run_uuid = ? ORDER BY 1"
        return connection.execute(query, (run_id,)).fetchall()


def test_params_and_tags_are_stored_as_log_batch_stores_them(tracking_uri: str, client: mlflow.MlflowClient) -> None:
    """A run's parameters (a value past MLflow's length cut as MLflow cuts it, one logged again with its value) and
    tags (one set again with a new value) end as log_batch leaves them, for MLflow's reads too."""
    from mlflow.entities import Param, RunTag

    long = "x" * 9_000  # past both limits: 6,000 characters for a parameter's value, 8,000 for a tag's
    params = {f"p{k}": str(k) for k in range(150)} | {"long": long, "dotted.key/x": "a b"}
    tags = {"aggregator": "fedbuff", "constant/client/samples": "200", "long": long}
    by_mlflow, direct_run = _run(client, "direct"), _run(client, "direct")
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        for chunk in range(0, len(params), 100):
            batch = [Param(k, v) for k, v in list(params.items())[chunk : chunk + 100]]
            client.log_batch(by_mlflow, params=batch)
        client.log_batch(by_mlflow, params=[Param("p3", "3")])
        client.log_batch(by_mlflow, tags=[RunTag(k, v) for k, v in tags.items()])
        client.log_batch(by_mlflow, tags=[RunTag("aggregator", "fedavg")])
        assert writer.write_params(direct_run, params)
        assert writer.write_params(direct_run, {"p3": "3"})
        assert writer.write_tags(direct_run, tags)
        assert writer.write_tags(direct_run, {"aggregator": "fedavg"})
    finally:
        writer.close()
    for table in ("params", "tags"):
        mine = [row for row in _named(tracking_uri, table, direct_run) if not str(row[0]).startswith("mlflow.")]
        theirs = [row for row in _named(tracking_uri, table, by_mlflow) if not str(row[0]).startswith("mlflow.")]
        assert mine == theirs, table
    assert len(_named(tracking_uri, "params", direct_run)) == 152
    read = client.get_run(direct_run).data
    assert read.params == client.get_run(by_mlflow).data.params
    assert read.tags["aggregator"] == "fedavg" and len(read.tags["long"]) == 8_000 and len(read.params["long"]) == 6_000


def test_a_run_ended_directly_reads_as_set_terminated_leaves_it(tracking_uri: str, client: mlflow.MlflowClient) -> None:
    """end_run sets the status and end time MLflow's set_terminated sets; a status that is no end is left to MLflow,
    and a deleted run is refused."""
    by_mlflow, direct_run, other = _run(client, "ended"), _run(client, "ended"), _run(client, "ended")
    client.set_terminated(by_mlflow, "KILLED", end_time=123_456)
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        assert writer.end_run(direct_run, "KILLED", 123_456)
        assert not writer.end_run(other, "RUNNING", 1)
        client.delete_run(other)
        with pytest.raises(ValueError, match="must be in the 'active' state"):
            writer.end_run(other, "FINISHED", 1)
    finally:
        writer.close()
    mine, theirs = client.get_run(direct_run).info, client.get_run(by_mlflow).info
    assert (mine.status, mine.end_time) == (theirs.status, theirs.end_time) == ("KILLED", 123_456)
    assert client.get_run(other).info.status == "RUNNING"


def _model_metrics(tracking_uri: str, model_id: str) -> list[tuple[object, ...]]:
    """Return the logged model's rows of ``logged_model_metrics`` (its id and run's left out)."""
    path = tracking_uri.removeprefix("sqlite:///")
    query = (
        "SELECT metric_name, metric_timestamp_ms, metric_step, metric_value, experiment_id, dataset_uuid, "
        "dataset_name, dataset_digest FROM logged_model_metrics WHERE model_id = ? ORDER BY 1, 2, 3, 4"
    )
    with sqlite3.connect(path) as connection:
        return connection.execute(query, (model_id,)).fetchall()


def test_points_linked_directly_are_stored_as_log_batch_stores_them(
    tracking_uri: str, client: mlflow.MlflowClient
) -> None:
    """A run's stored points linked to its logged model (twice) leave the model's metrics and the run's series as
    log_batch of the same points with the model's id leaves them; a model of another experiment, or none, is left
    to MLflow (nothing written), and a deleted run is refused."""
    by_mlflow, direct_run = _run(client, "linked"), _run(client, "linked")
    experiment = client.get_run(by_mlflow).info.experiment_id
    theirs = client.create_logged_model(experiment, name="model", source_run_id=by_mlflow).model_id
    mine = client.create_logged_model(experiment, name="model", source_run_id=direct_run).model_id
    elsewhere = client.create_logged_model(client.create_experiment("other"), name="model").model_id
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        for run_id in (by_mlflow, direct_run):
            for batch in BATCHES:
                writer.write(run_id, [row for row in batch if isinstance(row[1], float)])
        prefixes = ("loss", "grad")  # "late" holds two points of one time and step, which log_batch refuses
        points = writer.points(by_mlflow, prefixes)
        assert points == writer.points(direct_run, prefixes) and len(points) == 5  # the NaN points left out
        before = _stored(tracking_uri, direct_run)
        for _ in range(2):
            client.log_batch(by_mlflow, metrics=[Metric(*row, model_id=theirs) for row in points], synchronous=True)
            assert writer.link(direct_run, mine, writer.points(direct_run, prefixes))
        assert not writer.link(direct_run, elsewhere, points)
        assert not writer.link(direct_run, "m-none", points)
        client.delete_run(by_mlflow)
        with pytest.raises(ValueError, match="must be in the 'active' state"):
            writer.link(by_mlflow, theirs, points)
    finally:
        writer.close()
    assert _model_metrics(tracking_uri, mine) == _model_metrics(tracking_uri, theirs)
    assert len(_model_metrics(tracking_uri, mine)) == 5 and not _model_metrics(tracking_uri, elsewhere)
    assert _stored(tracking_uri, direct_run) == before
    got = sorted((m.key, m.step, m.value) for m in client.get_logged_model(mine).metrics)
    assert got == sorted((m.key, m.step, m.value) for m in client.get_logged_model(theirs).metrics)


def test_points_of_one_time_and_step_link_the_first(tracking_uri: str, client: mlflow.MlflowClient) -> None:
    """Of two stored points of one key, time and step with different values (log_batch refuses them together), the
    first in the reader's order (the smaller value) is linked; the rest of the points are."""
    run_id = _run(client, "linked-twice")
    model = client.create_logged_model(client.get_run(run_id).info.experiment_id, name="model", source_run_id=run_id)
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        writer.write(run_id, [("late", 7.0, 2_000, 9), ("late", 3.0, 2_000, 9), ("late", 1.0, 1_000, 4)])
        points = writer.points(run_id, ("late",))
        assert points == [("late", 1.0, 1_000, 4), ("late", 3.0, 2_000, 9), ("late", 7.0, 2_000, 9)]
        assert writer.link(run_id, model.model_id, points)
    finally:
        writer.close()
    assert [(row[0], row[2], row[3]) for row in _model_metrics(tracking_uri, model.model_id)] == [
        ("late", 4, 1.0),
        ("late", 9, 3.0),
    ]


def test_params_and_tags_mlflow_treats_otherwise_are_left_to_it(
    tracking_uri: str, client: mlflow.MlflowClient, tmp_path: Path
) -> None:
    """A parameter given a new value, an invalid key and the run-name tag are left to log_batch (False, nothing
    written); a deleted or unknown run is refused as metrics are; tables of another shape write no params or tags."""
    run_id = _run(client, "direct")
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        assert writer.write_params(run_id, {"a": "1"})
        assert not writer.write_params(run_id, {"b": "2", "a": "changed"})
        assert not writer.write_params(run_id, {"bad key!?": "1"})
        assert not writer.write_tags(run_id, {"x": "1", "mlflow.runName": "renamed"})
        assert writer.write_params(run_id, {}) and writer.write_tags(run_id, {})
        client.delete_run(run_id)
        with pytest.raises(ValueError, match="must be in the 'active' state"):
            writer.write_tags(run_id, {"x": "1"})
        with pytest.raises(LookupError, match="not found"):
            writer.write_params("0" * 32, {"x": "1"})
    finally:
        writer.close()
    assert _named(tracking_uri, "params", run_id) == [("a", "1")]
    assert not [row for row in _named(tracking_uri, "tags", run_id) if row[0] == "x"]
    uri = f"sqlite:///{tmp_path}/other.db"
    prepare_sqlite_store(uri)
    with sqlite3.connect(tmp_path / "other.db") as connection:
        connection.execute("ALTER TABLE tags ADD COLUMN note TEXT")
    other = SqliteMetrics.open(uri)
    assert other is not None  # its metrics still fit
    try:
        other_run = _run(mlflow.MlflowClient(uri), "direct")
        assert not other.write_params(other_run, {"a": "1"}) and not other.write_tags(other_run, {"a": "1"})
    finally:
        other.close()


def test_an_mlflow_whose_metric_check_differs_keeps_log_batch(
    tracking_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If MLflow's metric check is missing or takes other arguments, the store is left to log_batch."""
    import mlflow.utils.validation

    def other(key: str, value: float) -> None:  # another signature
        raise AssertionError("not reached")

    monkeypatch.setattr(mlflow.utils.validation, "_validate_metric", other)
    assert SqliteMetrics.open(tracking_uri) is None
    monkeypatch.delattr(mlflow.utils.validation, "_validate_metric")
    assert SqliteMetrics.open(tracking_uri) is None


@pytest.mark.slow
def test_the_writer_process_stores_batches_as_log_batch_does(tracking_uri: str, client: mlflow.MlflowClient) -> None:
    """Batches sent through the writer process (which writes them directly) end as log_batch's do."""
    by_mlflow, by_child = _run(client, "direct-child"), _run(client, "direct-child")
    child = ChildLogBatch(tracking_uri, by_child)
    try:
        child.wait_ready(60)
        for batch in BATCHES:
            client.log_batch(by_mlflow, metrics=[Metric(*row) for row in batch], synchronous=True)
            child([Metric(*row) for row in batch])  # type: ignore[misc]
    finally:
        child.close()
    assert _stored(tracking_uri, by_child) == _stored(tracking_uri, by_mlflow)


def test_the_writer_process_sends_batches_past_log_batch_where_the_store_fits(
    tracking_uri: str, client: mlflow.MlflowClient
) -> None:
    """The writer process's answer loop writes a batch, a job's tags and the run's end with the direct writer it
    is given (log_batch and set_terminated are never called), answers a refused batch with the error and goes
    on."""

    class NoLogBatch:
        def log_batch(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("log_batch was called")

    run_id = _run(client, "direct-child")
    tags = json.dumps({"op": "tags", "tags": {"constant/client/samples": "200"}})
    end = json.dumps({"op": "end", "status": "FINISHED", "end_time": 5_000})
    lines = [json.dumps(BATCHES[0]), json.dumps([["bad\nkey", 1.0, 1, 0]]), json.dumps(BATCHES[1]), tags, end]
    replies: list[str] = []
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        ended = _answer(
            NoLogBatch(),
            run_id,
            io.StringIO("\n".join(lines) + "\n"),
            replies.append,
            _Monitor(),
            tracking_uri,
            _Aside({}),
            writer,
        )
    finally:
        writer.close()
    assert ended
    assert replies[0] == "ok" and replies[1].startswith("error: ValueError: ") and replies[2] == "ok"
    assert replies[3].startswith("ok") and replies[4].startswith("ok")
    by_mlflow = _run(client, "direct-child")
    for batch in BATCHES:
        client.log_batch(by_mlflow, metrics=[Metric(*row) for row in batch], synchronous=True)
    assert _stored(tracking_uri, run_id) == _stored(tracking_uri, by_mlflow)
    assert client.get_run(run_id).data.tags["constant/client/samples"] == "200"
    assert (client.get_run(run_id).info.status, client.get_run(run_id).info.end_time) == ("FINISHED", 5_000)


def test_a_run_opened_by_the_writer_process_gets_its_params_past_log_batch(tracking_uri: str) -> None:
    """open_run with a store's direct writer creates the run through MLflow and writes its params in one
    transaction (log_batch is never called); without one, it calls log_batch, and both runs read the same."""
    from flasync.tracking._runs import open_run

    class NoLogBatch:
        def __init__(self, inner: mlflow.MlflowClient) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            if name == "log_batch":
                raise AssertionError("log_batch was called")
            return getattr(self.inner, name)

    real = mlflow.MlflowClient(tracking_uri)
    params = {f"server.p{k}": str(k) for k in range(121)}
    opened = {
        "experiment": "opened",
        "artifact_location": None,
        "runs_view": None,
        "run_name": "r",
        "tags": {"aggregator": "fedavg"},
        "params": params,
        "start_time": 1_000,
    }
    writer = SqliteMetrics.open(tracking_uri)
    assert writer is not None
    try:
        direct_run, _ = open_run(NoLogBatch(real), **opened, direct=writer)  # type: ignore[arg-type]
    finally:
        writer.close()
    by_mlflow, _ = open_run(real, **opened)
    assert real.get_run(direct_run).data.params == real.get_run(by_mlflow).data.params == params
    assert real.get_run(direct_run).data.tags["aggregator"] == "fedavg"


class _CountingClient:
    """An MLflow client that counts its ``log_batch`` calls and passes every call on."""

    def __init__(self, inner: mlflow.MlflowClient) -> None:
        self.inner = inner
        self.log_batches = 0

    def log_batch(self, *args: object, **kwargs: object) -> None:
        self.log_batches += 1
        self.inner.log_batch(*args, **kwargs)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def _through_the_seam(tracking_uri: str, client: mlflow.MlflowClient, run_id: str) -> int:
    """Send BATCHES for ``run_id`` through the writer process's answer loop, with the direct writer the seam gives
    (None where the schema does not fit); return how many log_batch calls it made."""
    counting = _CountingClient(client)
    replies: list[str] = []
    writer = SqliteMetrics.open(tracking_uri)
    lines = "".join(json.dumps(batch) + "\n" for batch in BATCHES)
    try:
        requests = io.StringIO(lines)
        ended = _answer(counting, run_id, requests, replies.append, _Monitor(), tracking_uri, _Aside({}), writer)
    finally:
        if writer is not None:
            writer.close()
    assert not ended and replies == ["ok"] * len(BATCHES)
    return counting.log_batches


def _rows(tracking_uri: str, run_id: str) -> list[tuple[object, ...]]:
    """Return the run's metric rows as ``(key, value, step, timestamp)``, NaN as MLflow reads it back."""
    with sqlite3.connect(tracking_uri.removeprefix("sqlite:///")) as connection:
        value = "CASE WHEN is_nan THEN 'nan' ELSE value END"
        query = f"SELECT key, {value}, step, timestamp FROM metrics WHERE run_uuid = ?"
        return sorted(connection.execute(query, (run_id,)).fetchall(), key=repr)


def test_a_store_at_another_schema_revision_falls_back_to_log_batch(
    tracking_uri: str, client: mlflow.MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose Alembic revision is not the one the direct writes were written for gets no direct writer: the
    writer process's batches go through MlflowClient.log_batch, and the mismatch names both revisions."""
    from flasync.tracking import sqlite_metrics

    assert sqlite_metrics.schema_mismatch(tracking_uri) is None
    run_id = _run(client, "schema-seam")
    monkeypatch.setattr(sqlite_metrics, "SCHEMA_REVISIONS", frozenset({"0123456789ab"}))
    mismatch = sqlite_metrics.schema_mismatch(tracking_uri)
    assert mismatch is not None
    assert mismatch.expected == ("0123456789ab",)
    assert mismatch.store == mismatch.head == sqlite_metrics.mlflow_head_revision()
    assert mismatch.store is not None
    assert SqliteMetrics.open(tracking_uri) is None
    assert _through_the_seam(tracking_uri, client, run_id) == len(BATCHES)
    assert _rows(tracking_uri, run_id)


def test_both_sides_of_the_schema_seam_store_the_same_metric_rows(
    tracking_uri: str, client: mlflow.MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same batches, written directly (the schema fits) and through log_batch (it does not), leave the same
    (key, value, step, timestamp) rows in the store."""
    from flasync.tracking import sqlite_metrics

    direct_run, fallback_run = _run(client, "schema-seam"), _run(client, "schema-seam")
    assert _through_the_seam(tracking_uri, client, direct_run) == 0
    monkeypatch.setattr(sqlite_metrics, "SCHEMA_REVISIONS", frozenset({"0123456789ab"}))
    assert _through_the_seam(tracking_uri, client, fallback_run) == len(BATCHES)
    assert _rows(tracking_uri, direct_run) == _rows(tracking_uri, fallback_run)
    assert len(_rows(tracking_uri, direct_run)) >= 10


def test_a_schema_mismatch_is_one_warning_of_the_tracker(
    tracking_uri: str, client: mlflow.MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracker that meets a store of another schema revision warns once (tracking.sqlite_schema_mismatch) and
    reads and writes through MLflow's client."""
    import structlog

    from flasync.tracking import MlflowTracker, sqlite_metrics

    first = MlflowTracker(tracking_uri, writer_process=False, flush_interval_s=0.05)
    run_id = first.start(experiment="schema-seam")
    first.log_metrics([Metric("m", 1.0, 0, step) for step in range(3)])
    first.finish("KILLED")
    monkeypatch.setattr(sqlite_metrics, "SCHEMA_REVISIONS", frozenset({"0123456789ab"}))
    resumed = MlflowTracker(tracking_uri, writer_process=False, flush_interval_s=0.05)
    with structlog.testing.capture_logs() as logs:
        resumed.resume(run_id)
        resumed._writers.tell_schema_mismatch()  # told once per tracker, however often asked
        resumed.log_metrics([Metric("m", 2.0, 0, step) for step in range(5)])
        resumed.finish("FINISHED")
    warnings = [log for log in logs if log["event"] == "tracking.sqlite_schema_mismatch"]
    assert len(warnings) == 1
    assert warnings[0]["log_level"] == "warning" and warnings[0]["expected_revisions"] == "0123456789ab"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "m")) == [
        (0, 1.0),
        (1, 1.0),
        (2, 1.0),
        (3, 2.0),
        (4, 2.0),
    ]
