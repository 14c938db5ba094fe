"""Secure aggregation with remote clients over HTTP: a real server on loopback, remote clients running SecAggClient
through the four rounds, the server holding masked vectors only and the model stepping on each group's sum."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import httpx
import pytest

from flasync.clients.remote.client import Client
from flasync.config import validate
from flasync.core.errors import RunInterrupted
from flasync.core.events import ModelPublished, SecureGroupClosed, UpdateUploaded
from flasync.observe.summary import RunSummary
from flasync.runtime.federation import Federation, checkpoint
from flasync.runtime.serve import asgi_app, serve
from flasync.secure import GroupParams, SecAggClient, SecAggServer, SystemRandom
from flasync.secure.messages import decode_message
from flasync.testing import EventRecorder
from tests.conftest import free_port, remote_config

pytestmark = pytest.mark.timeout(120)

_SECURE = {"enabled": True, "round_timeout_s": 10.0, "max_dropouts": 0}


def _config(tokens_file: Path, versions: int = 4) -> dict[str, Any]:
    return remote_config(
        tokens_file,
        resilience={"task_timeout_s": 30.0},
        secure_aggregation=_SECURE,
        stop={"max_versions": versions},
        eval={"every_versions": versions},
    )


@pytest.mark.slow
async def test_remote_clients_on_loopback_run_the_protocol_end_to_end(
    tmp_path: Path, tokens: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five remote clients against a uvicorn server on 127.0.0.1: no update is uploaded, every buffer of 3 goes
    through the four rounds over HTTP, the server's side sees only masked vectors, and the model steps 4 times."""
    masked: list[Any] = []
    original = SecAggServer.collect

    def collect(self: SecAggServer, messages: Any) -> Any:
        masked.extend(messages.values())
        return original(self, messages)

    monkeypatch.setattr(SecAggServer, "collect", collect)
    federation = Federation(_config(tmp_path / "tokens.txt"))
    recorder = EventRecorder(federation.bus)
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    served = asyncio.create_task(serve(federation, port=0, on_ready=port.set_result, linger_s=3.0))
    url = f"http://127.0.0.1:{await port}"
    clients = [Client(url, token, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
    results = await asyncio.gather(*(client.run() for client in clients))
    summary = await served
    groups = recorder.of(SecureGroupClosed)
    assert summary.versions == 4 and summary.stop_reason == "max_versions"
    assert recorder.count(UpdateUploaded) == 0
    revealed = [g for g in groups if not g.abandoned]
    assert len(revealed) == 4 and all(len(g.members) == 3 for g in revealed)
    assert summary.updates_accepted == sum(len(g.survivors) for g in revealed)
    assert sum(r.uploads for r in results) >= summary.updates_accepted  # each client's "in the sum"
    assert all(r.finished == "finished" for r in results)
    assert len(masked) >= 12 and all(len(m.payload) == 4 * (summary_params(federation) + 1) for m in masked)
    assert summary.upload_bytes == sum(sum(g.upload_bytes.values()) for g in groups)
    assert summary.accuracy > 0.3  # the digits model learns from the unmasked sums


def summary_params(federation: Federation) -> int:
    """Return the model's parameter count (the transport's)."""
    assert federation.transport is not None
    return federation.transport.num_params


async def _advertise_share_and_leave(http: httpx.AsyncClient, token: str, client_id: int) -> None:
    """Act as a device that takes a task, holds an update, advertises its keys and sends its shares, then leaves."""
    headers = {"Authorization": f"Bearer {token}"}
    offer = None
    while offer is None:
        answer = await http.get("http://fl/v1/task", params={"wait_s": 2.0}, headers=headers)
        offer = answer.json() if answer.status_code == 200 else None
    held = await http.post(f"http://fl/v1/tasks/{offer['task_id']}/held", json={"num_samples": 50}, headers=headers)
    assert held.status_code == 202
    member: SecAggClient | None = None
    after = ""
    while True:
        answer = await http.get("http://fl/v1/secagg", params={"wait_s": 2.0, "after": after}, headers=headers)
        if answer.status_code != 200:
            continue
        step = answer.json()
        after = f"{step['group']}/{step['round']}"
        if step["round"] == "advertise":
            params = GroupParams(
                group_id=bytes.fromhex(step["group_id"]),
                bits=step["bits"],
                length=step["length"],
                threshold=step["threshold"],
                neighbours={int(c): frozenset(v) for c, v in step["neighbours"].items()},
            )
            member = SecAggClient(client_id, params, SystemRandom())
            message = member.advertise()
        elif step["round"] == "share" and member is not None:
            message = member.share(decode_message(base64.b64decode(step["message"])))
        else:
            return  # shared: it leaves before its masked input
        url = f"http://fl/v1/secagg/{step['group']}/{step['round']}"
        posted = await http.post(url, content=message.to_bytes(), headers=headers)
        assert posted.status_code == 202, posted.text


@pytest.mark.slow
async def test_a_member_that_leaves_after_sharing_is_recovered(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A device that shares its seeds and key and then leaves drops out when the masking round times out; the others'
    shares of its key remove its masks and their sum is unmasked without it (over httpx's ASGI transport)."""
    config = _config(tmp_path / "tokens.txt", versions=2)
    config["secure_aggregation"] = {**_SECURE, "round_timeout_s": 1.0, "max_dropouts": 1}
    config["server"] = {"kind": "fedbuff", "buffer_size": 4, "concurrency": 5}
    federation = Federation(config)
    recorder = EventRecorder(federation.bus)
    app = asgi_app(federation)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        leaver = asyncio.create_task(_advertise_share_and_leave(http, tokens[4], 4))
        others = [Client("http://fl", t, http=http, poll_s=2.0, backoff_s=0.05) for t in list(tokens.values())[:4]]
        await asyncio.gather(*(client.run() for client in others))
        summary = await run
        await leaver
    groups = recorder.of(SecureGroupClosed)
    (with_leaver,) = [g for g in groups if 4 in {int(t.client_id) for t in g.members}]
    assert 4 in with_leaver.dropped and 4 not in with_leaver.survivors and with_leaver.recovered == 1
    assert not with_leaver.abandoned and len(with_leaver.survivors) == 3
    assert summary.versions == 2


@pytest.mark.slow
async def test_a_fedavg_round_of_remote_clients_is_one_group(tmp_path: Path, tokens: dict[int, str]) -> None:
    """FedAvg with remote clients: each round's cohort holds its updates until the last member trained, then runs
    the protocol as one group; the model steps on each round's sum (over httpx's ASGI transport)."""
    config = _config(tmp_path / "tokens.txt", versions=3)
    config["server"] = {"kind": "fedavg", "clients_per_round": 4}
    config["secure_aggregation"] = {**_SECURE, "max_dropouts": 1}
    federation = Federation(config)
    recorder = EventRecorder(federation.bus)
    app = asgi_app(federation)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        clients = [Client("http://fl", token, http=http, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
        await asyncio.gather(*(client.run() for client in clients))
        summary = await run
    groups = recorder.of(SecureGroupClosed)
    assert summary.versions == 3 and [int(g.version) for g in groups] == [0, 1, 2]
    assert all(len(g.members) == 4 and len(g.survivors) == 4 for g in groups)
    assert recorder.count(UpdateUploaded) == 0 and summary.updates_accepted == 12


async def _stop_while_devices_hold(federation: Federation, versions: int, holding: list[int]) -> RunSummary:
    """Run ``federation``; once ``versions`` were published and devices hold updates for a group that has not
    started, ask it to stop (as SIGINT does), noting how many held then in ``holding``."""
    published = federation.bus.subscribe(ModelPublished, policy="drop_oldest")
    run = asyncio.create_task(federation.run())
    for _ in range(versions + 1):  # version 0 is published too
        await published.receive()
    assert federation.transport is not None and federation.transport.secure is not None
    groups, held = federation.transport.secure, asyncio.Event()
    told = groups.held

    def hold(task: Any) -> None:  # a device said it holds its update
        told(task)
        held.set()

    groups.held = hold
    while not groups.waiting:  # devices hold updates for a buffer that has not filled
        held.clear()
        await held.wait()
    holding.append(len(groups.waiting))
    federation.request_stop("SIGINT")
    return await run


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_server_stopped_while_devices_hold_updates_resumes_and_counts_each_update_once(
    tmp_path: Path, tokens: dict[int, str]
) -> None:
    """Stop a loopback server while devices hold updates for a buffer that has not filled, serve its checkpoint on
    the same port: the devices, told to retry while it is down, learn that the resumed server holds nothing of
    theirs (``done``), train their reposted tasks again, and the run finishes with every version stepped by one
    buffer's sum and no task summed twice."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = validate(
        remote_config(
            tmp_path / "tokens.txt",
            resilience={"task_timeout_s": 30.0},
            secure_aggregation=_SECURE,
            stop={"max_versions": 8},
            eval={"every_versions": 8},
            checkpoint={"every_versions": 2},
            tracking={"enabled": True, "uri": store, "experiment": "secure", "log_model": False},
        )
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    clients = [
        Client(url, token, poll_s=1.0, backoff_s=0.05, max_backoff_s=0.2, give_up_s=60.0) for token in tokens.values()
    ]
    running = [asyncio.create_task(client.run()) for client in clients]
    first = Federation(config)
    before = EventRecorder(first.bus)
    holding: list[int] = []
    with pytest.raises(RunInterrupted) as stopped:
        await serve(first, port=port, run=lambda f: _stop_while_devices_hold(f, 3, holding), linger_s=0.2)
    assert stopped.value.checkpoint is not None and stopped.value.run_id is not None
    assert holding and holding[0] > 0 and all(not task.done() for task in running)

    fetched = await asyncio.to_thread(checkpoint.fetch, stopped.value.run_id, store)
    resumed_at = int(fetched[1]["version"])
    second = Federation(config, resume=checkpoint.ResumePoint(stopped.value.run_id, fetched[1], fetched[4]))
    after = EventRecorder(second.bus)
    summary = await serve(second, port=port, linger_s=3.0)
    results = await asyncio.gather(*running)

    assert summary.versions == 8 and all(r.finished == "finished" for r in results)
    revealed = [g for g in after.of(SecureGroupClosed) if not g.abandoned]
    assert sorted(int(g.version) for g in revealed) == list(range(resumed_at, 8))  # each version stepped once
    assert summary.updates_accepted == 3 * 8  # one buffer of 3 a version, before and after the stop
    kept = {t.task_id for g in before.of(SecureGroupClosed) if g.version < resumed_at for t in g.members}
    summed = [t.task_id for g in revealed for t in g.members]
    assert len(summed) == len(set(summed)) and not kept & set(summed)  # no task summed twice
    assert after.count(UpdateUploaded) == 0
