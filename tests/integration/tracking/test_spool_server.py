"""A tracker and a real ``mlflow server`` that is down, comes up, and goes away: nothing is lost or repeated.

Starting ``mlflow server`` takes 15-45 s on a small shared machine (imports and creating its database), twice here,
so this module runs only with ``FLASYNC_SERVER_TESTS=1``; the same paths are covered with an injected failing client
in ``test_spool.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import mlflow
import pytest
from mlflow.entities import Metric

from flasync.tracking import MlflowTracker
from flasync.tracking.spool import replay
from tests.conftest import free_port

_START_TIMEOUT_S = 90.0

pytestmark = [
    pytest.mark.skipif(os.environ.get("FLASYNC_SERVER_TESTS") != "1", reason="set FLASYNC_SERVER_TESTS=1 (slow)"),
    pytest.mark.skipif(shutil.which("mlflow") is None, reason="the mlflow command is not installed"),
]


class _Server:
    """An ``mlflow server`` subprocess on a fixed port with a SQLite store in a folder."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.folder = folder
        self.url = f"http://127.0.0.1:{self.port}"
        self.store = f"sqlite:///{folder}/server.db"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it answers /health."""
        command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.store]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        self._process = subprocess.Popen(
            command,
            cwd=self.folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self._process.poll() is None, "mlflow server exited"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"mlflow server did not answer within {_START_TIMEOUT_S} s")

    def kill(self) -> None:
        """Kill the server's process group (it was started in a session of its own), as a crash would."""
        if self._process is not None and self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(20)
        self._process = None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[_Server]:
    """A server, not yet started, stopped after the test."""
    folder = tmp_path / "server"
    folder.mkdir()
    made = _Server(folder)
    yield made
    made.kill()


def _metrics(first: int, count: int) -> list[Metric]:
    return [Metric("m", float(step), 1_700_000_000_000 + step, step) for step in range(first, first + count)]


@pytest.mark.slow
def test_a_server_that_comes_up_and_goes_away(server: _Server, tmp_path: Path) -> None:
    """Down at start: spooled, replayed when it comes up. Dies mid-run: spooled, left for `tracking replay`."""
    first = MlflowTracker(server.url, spool_path=tmp_path / "first.jsonl", retry_interval_s=0.2)
    assert first.start(experiment="served", run_name="late", params={"a": 1}) == ""
    first.log_metrics(_metrics(0, 10))
    first.flush()
    assert first.offline

    server.start()
    time.sleep(0.3)
    first.log_metrics(_metrics(10, 10))
    first.flush()
    assert not first.offline
    first.log_bytes(b"done", "notes/done.txt")
    first.finish("FINISHED")
    assert first.replay_command() is None
    client = mlflow.MlflowClient(server.url)
    assert first.run_id is not None
    run = client.get_run(first.run_id)
    assert (run.info.run_name, run.info.status, run.data.params) == ("late", "FINISHED", {"a": "1"})
    assert [m.step for m in client.get_metric_history(first.run_id, "m")] == list(range(20))

    # Up at start (metrics through the writer child process), then the server goes away.
    second = MlflowTracker(server.url, spool_path=tmp_path / "second.jsonl", retry_interval_s=0.2, system_metrics=True)
    run_id = second.start(experiment="served", params={"b": 2})
    second.log_metrics(_metrics(0, 5))
    second.flush()
    server.kill()
    second.log_metrics(_metrics(5, 5))
    second.flush()
    second.set_tags({"after": "outage"})
    second.finish("FINISHED")
    assert second.replay_command() == f"flasync tracking replay {tmp_path / 'second.jsonl'}"

    server.start()
    result = replay(tmp_path / "second.jsonl")
    assert result.run_id == run_id
    assert (result.metrics, result.status) == (5, "FINISHED")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["after"] == "outage"
    assert [m.step for m in client.get_metric_history(run_id, "m")] == list(range(10))
