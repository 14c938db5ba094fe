"""A served run stopped (as by SIGINT) and resumed from its checkpoint while the same remote clients reconnect."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import mlflow
import pytest

from flasync.clients.remote.client import Client
from flasync.config import validate
from flasync.core.errors import RunInterrupted
from flasync.core.events import ModelPublished
from flasync.observe.summary import RunSummary
from flasync.runtime.federation import Federation, checkpoint
from flasync.runtime.serve import serve
from tests.conftest import client_process, free_port, remote_config, write_remote_config


def _tracked(tmp_path: Path, **overrides: object) -> dict[str, object]:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    return remote_config(
        tmp_path / "tokens.txt",
        tracking={"enabled": True, "uri": store, "experiment": "resume", "log_model": False, "log_level": "warning"},
        checkpoint={"every_versions": 2},
        stop={"max_versions": 16},
        **overrides,
    )


async def _stop_after(federation: Federation, versions: int) -> RunSummary:
    """Run ``federation`` and ask it to stop (as the CLI's SIGINT handler does) once ``versions`` were published."""
    published = federation.bus.subscribe(ModelPublished, policy="drop_oldest")
    run = asyncio.create_task(federation.run())
    for _ in range(versions + 1):  # version 0 is published too
        await published.receive()
    federation.request_stop("SIGINT")
    return await run


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_served_run_resumes_and_its_clients_reconnect(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Stop the server mid-run, serve the checkpoint on the same port: the clients carry on, one MLflow run FINISHED."""
    config = validate(_tracked(tmp_path))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    clients = [
        Client(url, token, poll_s=1.0, backoff_s=0.05, max_backoff_s=0.2, give_up_s=60.0) for token in tokens.values()
    ]
    running = [asyncio.create_task(client.run()) for client in clients]

    first = Federation(config)
    with pytest.raises(RunInterrupted) as stopped:
        await serve(first, port=port, run=lambda f: _stop_after(f, 6), linger_s=0.2)
    assert stopped.value.checkpoint is not None and stopped.value.run_id is not None
    run_id = stopped.value.run_id
    assert all(not task.done() for task in running)  # told to retry (503), not that the run is over

    fetched = await asyncio.to_thread(checkpoint.fetch, run_id, config.tracking.uri or "")
    resumed_at = int(fetched[1]["version"])
    second = Federation(config, resume=checkpoint.ResumePoint(run_id, fetched[1], fetched[4]))
    summary = await serve(second, port=port, linger_s=3.0)  # clients still training learn that it ended
    results = await asyncio.gather(*running)

    assert 6 <= resumed_at < 16
    assert summary.run_id == run_id and summary.versions == 16
    assert all(r.finished == "finished" for r in results)
    assert sum(r.uploads for r in results) >= summary.updates_accepted
    run = mlflow.MlflowClient(config.tracking.uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(mlflow.MlflowClient(config.tracking.uri).search_runs([run.info.experiment_id])) == 1


def _config_file(tmp_path: Path) -> Path:
    return write_remote_config(
        tmp_path / "served.yaml",
        tmp_path / "tokens.txt",
        stop={"max_versions": 200},
        checkpoint={"every_versions": 2},
        tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "served"},
        remote={"poll_s": 1.0},
    )


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FLASYNC_SERVER_TESTS") != "1", reason="set FLASYNC_SERVER_TESTS=1 (about a minute)")
@pytest.mark.timeout(300)
def test_flasync_serve_sigint_then_resume_with_client_processes(tmp_path: Path, tokens: dict[int, str]) -> None:
    """`flasync serve` is interrupted by SIGINT and `flasync serve --resume` finishes the run; clients carry on."""
    config = _config_file(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    serve_cmd = [sys.executable, "-m", "flasync", "serve", "--port", str(port), "--no-system-metrics"]
    clients = []
    for cid, token in tokens.items():
        clients.append(
            client_process(
                url,
                token,
                tmp_path / f"token{cid}.txt",
                "--poll-s",
                "1",
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    server = subprocess.Popen([*serve_cmd, str(config)], env=env, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert server.stderr is not None
        for line in server.stderr:
            if "serving on" in line:
                break
        store = f"sqlite:///{tmp_path / 'mlflow.db'}"
        for line in server.stderr:  # the console's progress lines: stop once the run is well under way
            found = re.search(r"server\.eval +version=(\d+)", line)
            if found and int(found.group(1)) >= 10:
                break
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=120)
        assert server.returncode == 130, err
        resume = re.search(r"resume with: python -m flasync serve --resume ([0-9a-f]{32})", err)
        assert resume, err
        run_id = resume.group(1)
        resumed = subprocess.run(
            [*serve_cmd, "--resume", run_id, "--tracking-uri", store],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        assert resumed.returncode == 0, resumed.stderr
        outputs = [client.communicate(timeout=120)[0] for client in clients]
    finally:
        for process in [server, *clients]:
            if process.poll() is None:
                process.kill()
    assert all("(the run ended)" in out for out in outputs), outputs
    run = mlflow.MlflowClient(store).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert len(mlflow.MlflowClient(store).search_runs([run.info.experiment_id])) == 1


def _checkpointed_run(log: Path, store: str, port: int, version: int) -> str | None:
    """Return the served run's id once it has reached ``version`` and a checkpoint is in the store (else None)."""
    found = re.search(r"run_id=([0-9a-f]{32})", log.read_text(errors="replace"))
    if found is None:  # the store is touched only once the server has made it and its run
        return None
    try:
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5.0).json()
    except httpx.TransportError:
        return None
    if (status["version"] or 0) < version:
        return None
    artifacts = mlflow.MlflowClient(store).list_artifacts(found.group(1), checkpoint.CHECKPOINT_FOLDER)
    return found.group(1) if any(a.path.endswith(".pt") for a in artifacts) else None


def _figure(pattern: str, text: str) -> str:
    found = re.search(pattern, text)
    assert found, text
    return found.group(1)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FLASYNC_SERVER_TESTS") != "1", reason="set FLASYNC_SERVER_TESTS=1 (minutes)")
@pytest.mark.timeout(600)
def test_flasync_serve_killed_then_resumed_with_client_processes(tmp_path: Path, tokens: dict[int, str]) -> None:
    """`flasync serve` is SIGKILLed mid-run and `serve --resume` on the same port finishes it: the three client
    processes ride it out, no update counts twice, and stale answers to the dead server's tasks are refused, counted."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = write_remote_config(
        tmp_path / "served.yaml",
        tmp_path / "tokens.txt",
        stop={"max_versions": 300},
        client={"epochs": 4},
        checkpoint={"every_versions": 2},
        tracking={"uri": store, "experiment": "killed"},
        remote={"poll_s": 1.0},
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    serve_cmd = [sys.executable, "-m", "flasync", "serve", "--port", str(port), "--no-system-metrics"]
    logs = [tmp_path / f"client{cid}.log" for cid in range(3)]
    clients = [
        client_process(
            url,
            tokens[cid],
            tmp_path / f"token{cid}.txt",
            "--poll-s",
            "1",
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for cid, log in enumerate(logs)
    ]
    with (tmp_path / "serve.log").open("w") as sink:
        server = subprocess.Popen(
            [*serve_cmd, str(config)], env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path
        )
    try:
        run_id = None
        deadline = time.monotonic() + 240
        while run_id is None and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            run_id = _checkpointed_run(tmp_path / "serve.log", store, port, 10)
        assert run_id is not None, (tmp_path / "serve.log").read_text()
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        assert mlflow.MlflowClient(store).get_run(run_id).info.status == "RUNNING"  # nobody ended it
        resumed = subprocess.run(
            [*serve_cmd, "--resume", run_id, "--tracking-uri", store],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert resumed.returncode == 0, resumed.stderr
        codes = [client.wait(timeout=120) for client in clients]
    finally:
        for process in [server, *clients]:
            if process.poll() is None:
                process.kill()
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0, 0], outputs
    assert all("(the run ended)" in out for out in outputs), outputs
    run = mlflow.MlflowClient(store).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert int(_figure(r"versions +(\d+)", resumed.stdout)) == 300
    # FedBuff folds exactly buffer_size updates into each version: one more (an answer taken twice) would show.
    assert int(_figure(r"updates +(\d+) accepted", resumed.stdout)) == 3 * 300
    # Answers to the dead process's tasks: each client's count of them is the resumed server's count of refusals.
    stale = sum(int(_figure(r"(\d+) from before a server restart", out)) for out in outputs)
    refused = re.search(r"stale_task (\d+)", _figure(r"requests refused: (.*)", resumed.stdout))
    assert stale == (int(refused.group(1)) if refused else 0), (resumed.stdout, outputs)
    assert float(_figure(r"accuracy +([0-9.]+)", resumed.stdout)) >= 0.9


@pytest.mark.parametrize(
    "server", [{"kind": "fedbuff", "buffer_size": 3, "concurrency": 5}, {"kind": "fedavg", "clients_per_round": 3}]
)
@pytest.mark.timeout(120)
@pytest.mark.slow
async def test_a_served_run_with_no_device_online_stops_at_the_first_request(
    tmp_path: Path, tokens: dict[int, str], server: dict[str, object]
) -> None:
    """No device ever connects: the policy waits for one to come online, and a stop request (the CLI's first
    SIGINT) ends that wait, so the run stops cleanly instead of only at a second signal (without a checkpoint)."""
    config = remote_config(tmp_path / "tokens.txt", stop={"max_versions": 4})
    config["server"] = server
    federation = Federation(validate(config))

    async def stop_while_waiting(f: Federation) -> RunSummary:
        published = f.bus.subscribe(ModelPublished, policy="drop_oldest")
        run = asyncio.create_task(f.run())
        await published.receive()  # version 0: the server fills its slots next, and no client is online
        await asyncio.sleep(0.3)
        assert f.server is not None and f.server.stats.tasks_dispatched == 0
        f.request_stop("SIGINT")
        return await run

    with pytest.raises(RunInterrupted) as stopped:
        await serve(federation, port=free_port(), run=stop_while_waiting, linger_s=0.1)
    assert stopped.value.reason == "SIGINT" and stopped.value.summary["versions"] == 0
