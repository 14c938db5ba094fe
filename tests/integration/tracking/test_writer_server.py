"""The writer server: MLflow writer processes forked from one that imported MLflow once, for real runs in a real
store (see :mod:`flasync.tracking._server`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlflow
import psutil
import pytest

import flasync
from flasync.testing import small_config
from flasync.tracking import MetricRow, _server
from flasync.tracking._child import IDLE, ChildLogBatch, close_idle_writer, start_writer_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="writer servers run on Linux only"),
]


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s} s")
        time.sleep(0.05)


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private folder for the sockets (a short path: a Unix socket's is at most 107 bytes), and writer servers on
    (the tests' own setup turns them off)."""
    folder = Path(tempfile.mkdtemp(prefix="flasync-test-"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    monkeypatch.setenv(_server.VARIABLE, "1")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def server(runtime: Path) -> Iterator[psutil.Process]:
    """A writer server of this install, listening; killed (and gone) after the test."""
    pid = _server.start()
    assert pid is not None
    process = psutil.Process(pid)
    path = _server.address()
    assert path is not None and path.parent == runtime
    try:
        _wait(lambda: _server.listens(path), 120, "the server listens")
        yield process
    finally:
        close_idle_writer()
        if process.is_running():
            process.terminate()
            process.wait(30)


def _parent_of(pid: int) -> int:
    return psutil.Process(pid).ppid()


def _rows(key: str, count: int) -> list[MetricRow]:
    return [MetricRow(key, float(step), 1_000 + step, step) for step in range(count)]


def _forked(uri: str, experiment: str, server: psutil.Process) -> tuple[mlflow.MlflowClient, str, ChildLogBatch]:
    """Return a client of ``uri``, a new run in ``experiment`` and a writer process for it, ready: the server's."""
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    child = ChildLogBatch(uri, run_id)
    child.wait_ready(60)
    assert _parent_of(child.pid) == server.pid
    return client, run_id, child


def test_a_tracked_run_gets_a_writer_forked_by_the_server(server: psutil.Process, tmp_path: Path) -> None:
    """A tracked federation's writer process is the server's child, and the run it writes is whole: finished, its
    metrics, plots and logged model, as a writer of its own start writes them."""
    close_idle_writer()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = small_config("tracking.enabled=true", f"tracking.uri={uri}", "tracking.log_model=true")
    summary = flasync.run(config)
    assert IDLE.child is not None
    writer = IDLE.child.pid
    assert _parent_of(writer) == server.pid
    client = mlflow.MlflowClient(uri)
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED"
    assert "server/eval/accuracy" in run.data.metrics
    assert {Path(a.path).name for a in client.list_artifacts(summary.run_id)} >= {"summary.json", "weights.pt"}
    [logged] = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{summary.run_id}'"
    )
    assert str(logged.status) == "READY"
    close_idle_writer()
    _wait(lambda: not psutil.pid_exists(writer) or psutil.Process(writer).status() == "zombie", 30, "the writer ends")


def test_the_fork_takes_its_parents_folder_and_environment(
    server: psutil.Process, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative SQLite URI is resolved in the asking process's working folder (not the server's, ``/``); the URI
    itself reaches the writer in that process's environment (the server's names none)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlruns").mkdir()
    client, run_id, child = _forked("sqlite:///mlruns/mlflow.db", "forked", server)
    try:
        assert psutil.Process(child.pid).cwd() == str(tmp_path)
        child(_rows("relative", 3))
    finally:
        child.close()
    assert sorted(m.step for m in client.get_metric_history(run_id, "relative")) == [0, 1, 2]
    assert not child.alive


def test_a_killed_forked_writer_is_seen_gone(server: psutil.Process, tracking_uri: str) -> None:
    """A forked writer that dies is seen dead by its parent (through the pidfd the server sent), and a batch to it
    fails as one to a dead writer of its own start does."""
    _, _, child = _forked(tracking_uri, "killed", server)
    try:
        os.kill(child.pid, signal.SIGKILL)
        _wait(lambda: not child.alive, 30, "the parent sees its writer gone")
        with pytest.raises(ConnectionError):
            child(_rows("late", 1))
    finally:
        child.close()


def test_the_server_refuses_a_malformed_request_and_serves_the_next(server: psutil.Process, tracking_uri: str) -> None:
    """Bytes that are no request (no pipes, not JSON, a wrong shape) get no writer, and the server goes on."""
    path = _server.address()
    assert path is not None
    read, write = os.pipe()
    try:
        for message, fds in ((b"not json", [read, write]), (b'{"env": 1}', [read, write]), (b"{}", [])):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
                connection.settimeout(10)
                connection.connect(str(path))
                socket.send_fds(connection, [message], fds)
                assert connection.recv(64) == b""  # closed without an answer
    finally:
        os.close(read)
        os.close(write)
    assert server.children() == []
    _, _, child = _forked(tracking_uri, "after-refusals", server)
    child.close()


def test_a_second_server_is_not_started_and_a_removed_socket_ends_it(server: psutil.Process) -> None:
    """start() leaves a listening server alone; removing its socket ends it within seconds."""
    assert _server.start() is None
    path = _server.address()
    assert path is not None
    path.unlink()
    server.wait(30)


def test_an_idle_server_ends_and_removes_its_socket(runtime: Path) -> None:
    """A server with no writer alive for its idle time ends, its socket removed; a dead server's socket left behind
    is removed by the next server."""
    stale = runtime / "flasync-writer-0000000000000000.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as dead:
        dead.bind(str(stale))
    path = _server.address()
    assert path is not None
    command = [sys.executable, "-m", "flasync.tracking._child", "--server", str(path), "1"]
    process = subprocess.Popen(command, env={**os.environ}, stdin=subprocess.DEVNULL)
    try:
        _wait(lambda: _server.listens(path), 120, "the server listens")
        assert not stale.exists()
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert not path.exists()


def test_servers_off_are_neither_started_nor_asked(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLASYNC_WRITER_SERVER=0 keeps the command line's start from starting one, and writers start as processes of
    their own."""
    monkeypatch.setenv(_server.VARIABLE, "0")
    assert _server.start() is None
    assert start_writer_server() is None
    assert list(runtime.iterdir()) == []
