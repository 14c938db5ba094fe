"""A remote run end to end in one process: the ASGI app driven by flasync.clients.remote.client clients over httpx's
ASGI transport."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
import pytest

from flasync.clients.remote.client import Client
from flasync.core.errors import RunInterrupted
from flasync.core.events import ClientId, TaskAssigned
from flasync.runtime.federation import Federation
from flasync.runtime.serve import asgi_app
from tests.conftest import remote_config

pytestmark = pytest.mark.timeout(120)


@pytest.mark.slow
async def test_remote_clients_train_the_model(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Five remote clients reach the accuracy a simulated run reaches, through the same intake and aggregator."""
    federation = Federation(remote_config(tmp_path / "tokens.txt"))
    app = asgi_app(federation)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        clients = [Client("http://fl", token, http=http, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
        results = await asyncio.gather(*(client.run() for client in clients))
        summary = await run
    assert summary.versions == 20
    assert summary.accuracy >= 0.85
    assert sum(r.uploads for r in results) >= summary.updates_accepted
    assert all(r.finished == "finished" for r in results)


@pytest.mark.slow
async def test_a_client_that_leaves_is_timed_out(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A device that takes a task and disappears has it timed out by the registry and is given no more; the run
    finishes with the others."""
    config = remote_config(tmp_path / "tokens.txt", resilience={"task_timeout_s": 1.0}, stop={"max_versions": 30})
    federation = Federation(config)
    app = asgi_app(federation)
    leaver = tokens[4]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        headers = {"Authorization": f"Bearer {leaver}"}
        offer = None
        while offer is None:  # ask for a task the way a device does, then never answer it
            answer = await http.get("http://fl/v1/task", params={"wait_s": 2.0}, headers=headers)
            offer = answer.json() if answer.status_code == 200 else None
        clients = [
            Client("http://fl", token, http=http, poll_s=2.0, backoff_s=0.05) for token in list(tokens.values())[:4]
        ]
        results = await asyncio.gather(*(client.run() for client in clients))
        summary = await run
    assert summary.stop_reason == "max_versions"
    assert summary.tasks_timed_out == 1  # the leaver's task; gone, it is sampled no more
    assert all(r.finished == "finished" for r in results)


@pytest.mark.slow
async def test_tasks_go_to_connected_devices_only(tmp_path: Path, tokens: dict[int, str]) -> None:
    """With two of five devices connected, every task goes to those two: none waits for a device that never came."""
    config = remote_config(tmp_path / "tokens.txt", resilience={"task_timeout_s": 5.0}, stop={"max_versions": 6})
    config["server"] = {"kind": "fedbuff", "buffer_size": 2, "concurrency": 5}
    federation = Federation(config)
    app = asgi_app(federation)
    assigned: list[ClientId] = []

    async def record() -> None:
        async for task in subscription:
            assigned.append(task.client_id)

    subscription = federation.bus.subscribe(TaskAssigned, capacity=10_000)
    recorder = asyncio.create_task(record())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        present = list(tokens)[:2]
        clients = [Client("http://fl", tokens[i], http=http, poll_s=2.0, backoff_s=0.05) for i in present]
        results = await asyncio.gather(*(client.run() for client in clients))
        summary = await run
    await recorder
    assert summary.stop_reason == "max_versions"
    assert summary.tasks_timed_out == 0
    assert len(assigned) == summary.tasks_dispatched
    assert set(assigned) <= set(present)
    # A task dispatched as the run ends may never be fetched (its device asks after the stop): one per device at most.
    offered = sum(r.tasks for r in results)
    assert summary.tasks_dispatched - len(present) <= offered <= summary.tasks_dispatched


@pytest.mark.slow
async def test_two_devices_sharing_a_token_never_train_the_same_task(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Two client processes with client 0's token (and one with client 1's): each task goes to one of them, the
    other is told the token is in use and waits; no task is trained twice and no upload is a replay."""
    config = remote_config(tmp_path / "tokens.txt", stop={"max_versions": 6})
    config["server"] = {"kind": "fedbuff", "buffer_size": 2, "concurrency": 5}
    federation = Federation(config)
    app = asgi_app(federation)
    lines: list[str] = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        twins = [
            Client("http://fl", tokens[0], http=http, poll_s=2.0, backoff_s=0.05, on_status=lines.append)
            for _ in range(2)
        ]
        clients = [*twins, Client("http://fl", tokens[1], http=http, poll_s=2.0, backoff_s=0.05)]
        results = await asyncio.gather(*(client.run() for client in clients))
        summary = await run
    transport = federation.transport
    assert transport is not None
    assert summary.stop_reason == "max_versions"
    # Each task is offered to one device only. A task dispatched to client 0 as the run ends may never be offered
    # (its device polls after the stop), so the offers can fall short of the dispatches, never exceed them.
    offered = sum(r.tasks for r in results)
    assert summary.tasks_dispatched - config["server"]["concurrency"] <= offered <= summary.tasks_dispatched
    assert transport.refusals["replay"] == 0 and transport.refusals["other_connection"] == 0
    assert transport.refusals["token_in_use"] >= 1
    assert any("its token is in use by another connection" in line for line in lines)


@pytest.mark.slow
@pytest.mark.parametrize("late_s", [0.6, None], ids=["all-come", "two-never-come"])
async def test_served_rounds_wait_for_min_clients(tmp_path: Path, tokens: dict[int, str], late_s: float | None) -> None:
    """FedAvg over remote devices with server.min_clients = 5: while only three are connected, the first round waits
    (before: it opened with whoever had connected, one of five); once all five are, it opens with the five. When
    two never come, the round opens with the three after min_clients_wait_s."""
    server = {"kind": "fedavg", "clients_per_round": 5, "min_clients": 5, "min_clients_wait_s": 1.5}
    config = remote_config(tmp_path / "tokens.txt", stop={"max_versions": 2})
    config["server"] = server
    federation = Federation(config)
    first_round: list[ClientId] = []

    async def record() -> None:
        async for task in subscription:
            if task.base_version == 0:
                first_round.append(task.client_id)

    subscription = federation.bus.subscribe(TaskAssigned, capacity=10_000)
    recorder = asyncio.create_task(record())
    app = asgi_app(federation)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())

        async def device(token: str, after_s: float) -> None:
            await asyncio.sleep(after_s)
            await Client("http://fl", token, http=http, poll_s=0.5, backoff_s=0.05).run()

        ids = list(tokens)
        devices = [device(tokens[i], 0.0) for i in ids[:3]]
        if late_s is not None:
            devices += [device(tokens[i], late_s) for i in ids[3:]]
        await asyncio.gather(*devices)
        summary = await run
    await recorder
    assert summary.stop_reason == "max_versions"
    assert sorted(first_round) == (sorted(ids) if late_s is not None else sorted(ids[:3]))


@pytest.mark.slow
async def test_clients_of_a_run_that_fails_stop_at_once_with_its_error(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A served run that fails (every client's training diverges) tells its clients why with its end (410): each
    stops with that error at once instead of retrying until it gives up."""
    from flasync.clients.remote.client import RemoteError
    from flasync.core.errors import TrainingError

    config = remote_config(tmp_path / "tokens.txt", client={"lr": 1e30})
    federation = Federation(config)
    app = asgi_app(federation)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        clients = [
            Client("http://fl", token, http=http, poll_s=2.0, backoff_s=0.05, give_up_s=60.0)
            for token in tokens.values()
        ]
        results = await asyncio.gather(*(client.run() for client in clients), return_exceptions=True)
        with pytest.raises(TrainingError, match="client tasks all failed"):
            await run
    assert all(isinstance(r, RemoteError) for r in results), results
    said = "the server's run failed: TrainingError: the last 30 client tasks all failed"
    assert all(said in str(r) for r in results), results


async def test_a_device_connecting_while_the_others_hold_tasks_gets_one(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A device that says hello while every connected device holds a task unanswered is given a task at once (its
    connection is a message to the server), not only when the next answer arrives."""
    federation = Federation(remote_config(tmp_path / "tokens.txt", stop={"max_versions": 1000}))
    app = asgi_app(federation)
    first, second = (({"Authorization": f"Bearer {tokens[i]}"}) for i in (0, 1))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        offer = None
        while offer is None:  # the first device takes a task and never answers it
            answer = await http.get("http://fl/v1/task", params={"wait_s": 2.0}, headers=first)
            offer = answer.json() if answer.status_code == 200 else None
        assert (await http.get("http://fl/v1/hello", headers=second)).status_code == 200
        answer = await http.get("http://fl/v1/task", params={"wait_s": 30.0}, headers=second)
        federation.request_stop("test over")
        with contextlib.suppress(RunInterrupted):
            await run
    assert answer.status_code == 200
    assert answer.json()["task_id"] != offer["task_id"]
