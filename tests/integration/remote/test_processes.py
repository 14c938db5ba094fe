"""The deployment evidence: ``flasync serve`` and five ``flasync client`` processes on 127.0.0.1.

FedBuff on digits reaches 0.85 accuracy with every client holding its own partition; one client killed mid-run is
timed out by the registry and the run still finishes; the MLflow run has the metric keys of a simulated run.
Six processes importing torch take about a minute on two cores, so this runs only with ``FLASYNC_SERVER_TESTS=1``;
``test_inprocess.py`` drives the same application and clients in one process on every run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from mlflow.tracking import MlflowClient

from flasync.runtime.federation import Federation
from tests.conftest import NUM_CLIENTS, client_process, free_port, write_remote_config

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.environ.get("FLASYNC_SERVER_TESTS") != "1", reason="set FLASYNC_SERVER_TESTS=1 (slow)"),
]


def _wait_for(path: Path, text: str, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(
        f"{text!r} not in {path.name} after {deadline_s} s: {path.read_text(errors='replace')[-2000:]}"
    )


def _wait_for_version(port: int, version: int, deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5.0).json()
        if (status["version"] or 0) >= version:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach version {version} in {deadline_s} s")


@pytest.mark.slow
def test_serve_and_five_client_processes(tmp_path: Path, tokens: dict[int, str]) -> None:
    """FedBuff reaches 0.85 over loopback HTTP; a client killed mid-run is timed out and the run finishes."""
    config = tmp_path / "remote.yaml"
    write_remote_config(
        config,
        tmp_path / "tokens.txt",
        # A version takes about 30 ms here (an upload's answer carries the next task): 240 leave several seconds
        # after the kill at version 5, well beyond the killed client's task time limit.
        stop={"max_versions": 240},
        resilience={"task_timeout_s": 1.5},
        tracking={"experiment": "remote-evidence"},
    )
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLFLOW_TRACKING_URI": store}
    server_out, server_err = tmp_path / "serve.out", tmp_path / "serve.err"
    command = [sys.executable, "-m", "flasync", "serve", str(config), "--port", str(port), "--no-system-metrics"]
    with server_out.open("w") as out, server_err.open("w") as err:
        server = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=tmp_path)
    clients: list[subprocess.Popen[bytes]] = []
    try:
        _wait_for(server_err, "serving on", 60)
        for client_id, token in tokens.items():
            log = (tmp_path / f"client{client_id}.out").open("w")
            clients.append(
                client_process(
                    f"http://127.0.0.1:{port}",
                    token,
                    tmp_path / f"token{client_id}",
                    *("--poll-s", "2", "--give-up-s", "20"),
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp_path,
                )
            )
        _wait_for_version(port, 5, 90)  # the clients are training: kill one mid-run
        # Once it is connected it always holds a task (concurrency = clients): one that never came would hold none.
        _wait_for(tmp_path / f"client{NUM_CLIENTS - 1}.out", "connected to", 90)
        clients[-1].send_signal(signal.SIGKILL)
        assert server.wait(timeout=150) == 0, server_err.read_text()[-2000:]
        for client in clients[:-1]:
            assert client.wait(timeout=60) == 0
    finally:
        for process in [server, *clients]:
            if process.poll() is None:
                process.kill()
                process.wait()
    output = server_out.read_text()
    assert "flasync run finished (max_versions)" in output
    for client_id in range(NUM_CLIENTS - 1):
        assert "(the run ended)" in (tmp_path / f"client{client_id}.out").read_text()
    store_client = MlflowClient(store)
    (remote,) = store_client.search_runs([store_client.get_experiment_by_name("remote-evidence").experiment_id])
    metrics, tags = remote.data.metrics, remote.data.tags
    assert float(tags["finished.accuracy"]) >= 0.85
    assert tags["finished.versions"] == "240"
    assert int(tags["finished.tasks_timed_out"]) >= 1  # the killed client's task
    assert remote.info.status == "FINISHED"
    # The same keys a simulated run of this config logs (remote refusals come on top).
    simulated = Federation(
        {**_simulated_of(config), "tracking": {"uri": store, "experiment": "simulated", "log_model": False}}
    )
    import asyncio

    asyncio.run(simulated.run())
    (sim,) = store_client.search_runs([store_client.get_experiment_by_name("simulated").experiment_id])
    missing = {k for k in sim.data.metrics if not k.startswith(("remote/", "profile/"))} - set(metrics)
    assert not missing - {"server/timeout/timed_out"}, sorted(missing)


def _simulated_of(config: Path) -> dict[str, object]:
    data: dict[str, object] = yaml.safe_load(config.read_text())
    data.pop("remote")
    data["clock"] = "virtual"
    data["stop"] = {"max_versions": 10}
    return data
