"""The store as a location: SQLite stores shared by several processes, and half-built stores repaired."""

from __future__ import annotations

import http.server
import socket
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest

from flasync.testing import NullLog
from flasync.tracking.store import check_answers, prepare_sqlite_store
from tests.conftest import free_port


def _half_built(db: Path, *, with_run: bool = False) -> None:
    """A database as concurrent first runs left it: migration tables left over, no schema version."""
    with sqlite3.connect(db) as connection:
        connection.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        connection.execute("CREATE TABLE _alembic_tmp_tags (key VARCHAR(250))")
        connection.execute("CREATE TABLE runs (run_uuid VARCHAR(32))")
        if with_run:
            connection.execute("INSERT INTO runs VALUES ('abc')")


def test_a_half_built_store_without_runs_is_moved_aside_and_built_afresh(tmp_path: Path) -> None:
    """The broken file is kept beside (nothing deleted), the store works, and the repair is reported."""
    db = tmp_path / "mlflow.db"
    _half_built(db)
    log = NullLog()
    prepare_sqlite_store(f"sqlite:///{db}", log)
    (repaired,) = log.events("tracking.store_repaired")
    assert Path(repaired["moved_to"]).exists() and repaired["path"] == str(db)
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    assert client.create_experiment("works")
    with sqlite3.connect(db) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.slow
def test_a_schema_build_that_dies_leaves_no_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The schema is built in a file of its own and moved into place: a build that stops half-way leaves no
    database (and no half-built one), and the next build succeeds and removes the leftovers."""
    db = tmp_path / "mlflow.db"
    leftover = tmp_path / "mlflow.db.building-1"
    leftover.write_bytes(b"a build a killed process left")

    def dies(self: object, *args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # what a kill mid-migration amounts to, for this process

    monkeypatch.setattr(mlflow.MlflowClient, "search_experiments", dies)
    with pytest.raises(KeyboardInterrupt):
        prepare_sqlite_store(f"sqlite:///{db}", schema_cache=False, seeds=False)
    assert not db.exists()
    monkeypatch.undo()
    prepare_sqlite_store(f"sqlite:///{db}", schema_cache=False, seeds=False)
    assert mlflow.MlflowClient(f"sqlite:///{db}").create_experiment("works")
    assert sorted(p.name for p in tmp_path.iterdir() if "building" in p.name) == []


def _schema_version(db: Path) -> str:
    with sqlite3.connect(db) as connection:
        return str(connection.execute("SELECT version_num FROM alembic_version").fetchone()[0])


def test_a_new_store_is_a_copy_of_the_schema_kept_from_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first new store's schema is kept, empty; the next new store is a copy of it (no migration runs), which
    MLflow opens as its own: same schema version, its Default experiment in the opening directory, runs work."""
    cache = tmp_path / "cache"
    first = tmp_path / "first" / "mlflow.db"
    monkeypatch.chdir(tmp_path)
    prepare_sqlite_store(f"sqlite:///{first}", schema_cache=cache)
    (kept,) = cache.iterdir()
    with sqlite3.connect(kept) as connection:
        assert connection.execute("SELECT COUNT(*) FROM experiments").fetchone()[0] == 0

    def migrates(self: object, *args: object, **kwargs: object) -> None:
        raise AssertionError("the schema was built, not copied")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    second = tmp_path / "second" / "mlflow.db"
    with monkeypatch.context() as patch:
        patch.setattr(mlflow.MlflowClient, "search_experiments", migrates)
        prepare_sqlite_store(f"sqlite:///{second}", schema_cache=cache)
    assert _schema_version(second) == _schema_version(first)
    client = mlflow.MlflowClient(f"sqlite:///{second}")
    (default,) = client.search_experiments()
    assert default.name == "Default" and default.artifact_location == str(elsewhere / "mlruns" / "0")
    run_id = client.create_run(client.create_experiment("works")).info.run_id
    client.log_metric(run_id, "m", 1.0)
    client.set_terminated(run_id)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_broken_kept_schema_is_not_copied_but_replaced(tmp_path: Path) -> None:
    """A kept schema that is not a whole, empty schema is ignored: the store is built by MLflow and kept anew."""
    cache = tmp_path / "cache"
    prepare_sqlite_store(f"sqlite:///{tmp_path / 'first.db'}", schema_cache=cache)
    (kept,) = cache.iterdir()
    kept.write_bytes(b"not a database")
    db = tmp_path / "second.db"
    prepare_sqlite_store(f"sqlite:///{db}", schema_cache=cache)
    assert mlflow.MlflowClient(f"sqlite:///{db}").create_experiment("works")
    assert _schema_version(kept) == _schema_version(db)
    assert [p.name for p in cache.iterdir()] == [kept.name]


def test_a_half_built_store_with_runs_is_an_error_naming_the_repair(tmp_path: Path) -> None:
    """Runs are never moved aside: the error says how to repair the store in place."""
    db = tmp_path / "mlflow.db"
    _half_built(db, with_run=True)
    with pytest.raises(RuntimeError, match=r"half-built .* holds runs; repair it with: mlflow db upgrade sqlite:///"):
        prepare_sqlite_store(f"sqlite:///{db}")
    assert db.exists()


def _metric_counts(uri: str, run_id: str) -> Counter[str]:
    client = mlflow.MlflowClient(uri)
    run = client.get_run(run_id)
    return Counter({key: len(client.get_metric_history(run_id, key)) for key in run.data.metrics})


@pytest.mark.slow
def test_four_runs_started_together_on_a_fresh_store_are_all_tracked_live(tmp_path: Path) -> None:
    """Four CLI runs at once on one new SQLite store: each FINISHED, live (no spool), with a solo run's metrics."""
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    argv = [sys.executable, "-m", "flasync", "run", "--tracking-uri", uri, "--log-level", "warning"]
    argv += ["--set", "stop.max_versions=6", "--set", "population.num_clients=20", "--no-system-metrics"]
    # What is shared is the store and its creation; the model export (5 CPU seconds a run, on 2 cores) is not.
    argv += ["--set", "tracking.log_model=false"]
    runs = [
        subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0, 0, 0], [err[-2000:] for _, err in outputs]
    assert not any("spool" in out + err for out, err in outputs)
    client = mlflow.MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "flasync"]
    together = client.search_runs([experiment.experiment_id])
    assert len(together) == 4 and {r.info.status for r in together} == {"FINISHED"}
    solo_uri = f"sqlite:///{tmp_path / 'solo' / 'mlflow.db'}"
    solo = subprocess.run([*argv[:5], solo_uri, *argv[6:]], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert solo.returncode == 0, solo.stderr[-2000:]
    solo_client = mlflow.MlflowClient(solo_uri)
    (solo_run,) = solo_client.search_runs([solo_client.get_experiment_by_name("flasync").experiment_id])
    expected = _metric_counts(solo_uri, solo_run.info.run_id)
    for run in together:
        assert _metric_counts(uri, run.info.run_id) == expected


def test_redact_uri_hides_only_the_password() -> None:
    """The user stays visible (which account), the password never; URIs without one are unchanged."""
    from flasync.tracking.store import redact_uri

    assert redact_uri("https://me:s3cr3t@mlflow.example:5000/x") == "https://me:***@mlflow.example:5000/x"
    assert redact_uri("http://token@host") == "http://token@host"
    assert redact_uri("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


@pytest.mark.slow
def test_a_password_in_the_tracking_uri_is_written_nowhere(tmp_path: Path) -> None:
    """With user:password in the URI of a store that does not answer: not in the writer child's command line, the
    console, the spool (owner-only files), its params or config.yaml."""
    import os
    import stat

    from flasync.tracking._child import ChildLogBatch

    uri = f"http://alice:secret-pw@127.0.0.1:{free_port()}"
    child = ChildLogBatch(uri)
    try:
        assert not any("secret-pw" in str(arg) for arg in child._process.args)
    finally:
        child.close()
    done = subprocess.run(
        [sys.executable, "-m", "flasync", "run", "--tracking-uri", uri, "--set", "stop.max_versions=3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "secret-pw" not in done.stdout + done.stderr
    spools = list((tmp_path / "mlruns" / "spool").glob("*.jsonl"))
    assert spools and "alice:***@" in spools[0].read_text()
    assert stat.S_IMODE(os.stat(spools[0]).st_mode) == 0o600
    for path in (tmp_path / "mlruns").rglob("*"):
        if path.is_file():
            assert b"secret-pw" not in path.read_bytes(), path


@pytest.fixture
def answering_server() -> Iterator[str]:
    """Yield the address of an HTTP server that answers every request 401."""

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_server_that_answers_anything_answers(answering_server: str) -> None:
    """Any HTTP answer (here 401) counts, and credentials in the URI are not sent as the host name."""
    check_answers(f"http://{answering_server}", 2.0)
    check_answers(f"http://user:secret@{answering_server}/prefix/", 2.0)


@pytest.mark.slow
def test_a_silent_or_closed_server_does_not_answer() -> None:
    """A server that accepts and never answers, or a port where nothing listens, is a one-line ConnectionError
    naming the store without its credentials; other stores pass."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with pytest.raises(ConnectionError, match=rf"MLflow at http://user:\*\*\*@127\.0\.0\.1:{port} does not answer"):
            check_answers(f"http://user:secret@127.0.0.1:{port}", 0.5)
    with pytest.raises(ConnectionError, match="does not answer"):
        check_answers(f"http://127.0.0.1:{port}", 0.5)
    check_answers("sqlite:///nowhere/mlflow.db", 0.5)
