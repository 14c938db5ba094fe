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
from flasync.core.events import SecureGroupClosed, UpdateUploaded
from flasync.runtime.federation import Federation
from flasync.runtime.serve import asgi_app, serve
from flasync.secure import GroupParams, SecAggClient, SecAggServer, SystemRandom
from flasync.secure.messages import decode_message
from flasync.testing import EventRecorder
from tests.conftest import remote_config

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
