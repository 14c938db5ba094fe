"""The writer server: forked by a writer process started on its own, MLflow imported, it forks later writer processes
for real runs in a real store (see :mod:`flasync.tracking._server`)."""

from __future__ import annotations

import contextlib
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
from flasync.tracking._child import IDLE, ChildLogBatch, close_idle_writer

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


def _listening(path: Path) -> psutil.Process | None:
    """Return the process that listens at the Unix socket ``path``, if one does (bound to a name of its own, then
    renamed to ``path``: see :func:`flasync.tracking._server.listen`)."""
    for process in psutil.process_iter(["cmdline"]):
        if "flasync.tracking._child" not in (process.info["cmdline"] or []):
            continue
        with contextlib.suppress(psutil.Error):
            if any(c.laddr.startswith(f"{path}.") for c in process.net_connections(kind="unix")):
                return process
    return None


def _write_run(uri: str, experiment: str, key: str, preload: tuple[str, ...] = ()) -> tuple[ChildLogBatch, int]:
    """Write three rows of ``key`` to a new run of ``uri`` through a new writer process (told to ``preload``: it
    forks a helper for that); return it (closed) and its parent's pid, once the store holds the rows."""
    client = mlflow.MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    child = ChildLogBatch(uri, run_id, preload=preload)
    try:
        child.wait_ready(120)
        parent = _parent_of(child.pid)
        child(_rows(key, 3))
    finally:
        child.close()
    assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1, 2]
    return child, parent


@pytest.fixture
def server(runtime: Path, tmp_path: Path) -> Iterator[psutil.Process]:
    """A writer server of this install, listening: forked, as a tracked command's first writer forks it, by a writer
    process started on its own (which wrote its run meanwhile); killed (and gone) after the test."""
    close_idle_writer()
    path = _server.address()
    assert path is not None and path.parent == runtime
    first, parent = _write_run(f"sqlite:///{tmp_path}/first.db", "first", "first", ("flasync.tracking._model",))
    assert parent == os.getpid()  # started on its own: no server listened yet
    _wait(lambda: _server.listens(path), 60, "the server listens")
    process = _listening(path)
    assert process is not None and process.pid != first.pid
    try:
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


def test_the_forked_server_is_detached_from_the_writer_that_forked_it(server: psutil.Process, tmp_path: Path) -> None:
    """The server keeps nothing of the writer it was forked from: a session of its own, ``/`` as its folder, its
    standard streams ``/dev/null`` (not the pipes whose end that writer's parent waits for), no other file but its
    socket (not the pipes to the writer's helpers), and it outlives the writer."""
    assert server.ppid() != os.getpid()
    assert os.getsid(server.pid) != os.getsid(0)
    assert server.cwd() == "/"
    assert {os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in (0, 1, 2)} == {os.devnull}
    others = [os.readlink(f"/proc/{server.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server.pid}/fd")][3:]
    assert [kind.split(":")[0] for kind in others] == ["socket"]  # its own, and none of the writer's pipes
    assert server.children() == []


def test_a_second_server_is_not_started_and_a_removed_socket_ends_it(server: psutil.Process, tmp_path: Path) -> None:
    """A writer started on its own while a server listens forks none (the server keeps its socket); removing the
    socket ends the server within seconds."""
    path = _server.address()
    assert path is not None
    inode = path.stat().st_ino
    command = [sys.executable, "-m", "flasync.tracking._child"]
    env = {**os.environ, "FLASYNC_CHILD_TRACKING_URI": f"sqlite:///{tmp_path}/own.db"}
    writer = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert writer.stdin is not None
    writer.stdin.write(b"stop\n")
    writer.stdin.close()
    assert writer.wait(120) == 0
    assert server.is_running() and path.stat().st_ino == inode
    assert _listening(path) == server
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


@pytest.mark.parametrize("setting", ["0", None])
def test_servers_off_or_unasked_are_not_started(
    runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None
) -> None:
    """``FLASYNC_WRITER_SERVER=0`` keeps writers from forking a server (and from asking one); unset (a library's
    default: only the command line sets it to 1), a writer asks but forks none."""
    if setting is None:
        monkeypatch.delenv(_server.VARIABLE)
    else:
        monkeypatch.setenv(_server.VARIABLE, setting)
    close_idle_writer()
    _, parent = _write_run(f"sqlite:///{tmp_path}/mlflow.db", "off", "off")
    assert parent == os.getpid()
    time.sleep(0.5)
    assert list(runtime.iterdir()) == []


def test_a_tracked_command_leaves_a_server_that_the_next_command_s_writer_is_forked_from(
    runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m flasync run`` asks for a server with the variable unset: its writer forks one, which outlives the
    command, and the next command's writer is that server's child; both runs are whole."""
    monkeypatch.delenv(_server.VARIABLE)
    (tmp_path / "cfg.yaml").write_text(
        "data: {kind: digits}\nmodel: {kind: mlp, hidden: [16]}\npopulation: {num_clients: 10}\n"
        "server: {kind: fedavg, clients_per_round: 5}\nstop: {max_versions: 3}\ntracking: {log_model: false}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    command = [sys.executable, "-m", "flasync", "run", "cfg.yaml", "--no-system-metrics"]
    path = _server.address()
    assert path is not None
    first = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    server = _listening(path)
    assert server is not None
    try:
        second = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        _wait(lambda: bool(server.children()) or second.poll() is not None, 120, "the server forks a writer")
        forked = server.children()
        _, errors = second.communicate(timeout=240)
        assert second.returncode == 0, errors[-3000:]
        assert forked, "the second command's writer was not the server's"
        client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
        runs = client.search_runs([client.get_experiment_by_name("flasync").experiment_id])
        assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
        assert all("server/eval/accuracy" in r.data.metrics for r in runs)
    finally:
        server.terminate()
        server.wait(30)
