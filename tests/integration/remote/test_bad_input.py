"""Bad input over HTTP: each refusal has its status, is counted (a metric), and the server goes on serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from flasync import codecs
from flasync.clients.remote.limits import AddressLimits
from flasync.core.errors import RunInterrupted
from flasync.runtime import serve
from flasync.runtime.federation import Federation
from flasync.runtime.serve import INCARNATION_HEADER, REPORT_HEADER, SESSION_HEADER, asgi_app
from flasync.testing import MemoryTracker
from tests.conftest import remote_config

pytestmark = pytest.mark.timeout(60)

_REPORT = {REPORT_HEADER: json.dumps({"num_samples": 10, "train_loss": 1.0})}


@dataclass
class Served:
    """A running remote federation (no client trains) and an HTTP client over its application."""

    federation: Federation
    http: httpx.AsyncClient
    tracker: MemoryTracker
    tokens: dict[int, str]

    def auth(self, client_id: int) -> dict[str, str]:
        return {"authorization": f"Bearer {self.tokens[client_id]}"}

    async def offer(self, client_id: int) -> dict[str, int]:
        response = await self.http.get("/v1/task", params={"wait_s": 0}, headers=self.auth(client_id))
        assert response.status_code == 200, response.text
        data: dict[str, int] = response.json()
        return data

    async def upload(
        self, client_id: int, task_id: int, body: bytes, extra: dict[str, str] | None = None
    ) -> httpx.Response:
        headers = {**self.auth(client_id), **_REPORT, "content-type": "application/octet-stream", **(extra or {})}
        return await self.http.post(f"/v1/tasks/{task_id}/update", content=body, headers=headers)

    def metric(self, key: str) -> float:
        values = [row.value for row in self.tracker.metrics if row.key == key]
        return values[-1] if values else math.nan

    async def settle(self) -> None:
        """Let the server handle what was published."""
        for _ in range(20):
            await asyncio.sleep(0.01)


@pytest.fixture
async def served(tmp_path: Path, tokens: dict[int, str]) -> AsyncIterator[Served]:
    config = remote_config(
        tmp_path / "tokens.txt",
        server={"concurrency": 4},
        stop={"max_versions": 1000},
        resilience={"task_timeout_s": 60.0},
        remote={"max_waiting": 1},
    )
    tracker = MemoryTracker()
    federation = Federation(config, tracker=tracker)
    transport = httpx.ASGITransport(app=asgi_app(federation))
    async with httpx.AsyncClient(transport=transport, base_url="http://fl", timeout=30.0) as http:
        run = asyncio.create_task(federation.run())
        assert federation.transport is not None
        for _ in range(2000):  # every device says hello (tasks go to connected devices) until the first wave is out
            for token in tokens.values():
                await http.get("/v1/hello", headers={"authorization": f"Bearer {token}"})
            if federation.transport.statistics()["posted"] >= 4:
                break
            await asyncio.sleep(0.01)
        yield Served(federation, http, tracker, tokens)
        federation.request_stop("test over")
        with contextlib.suppress(RunInterrupted):
            await run


def _num_params(served: Served) -> int:
    transport = served.federation.transport
    assert transport is not None
    return transport.num_params


async def _busy_client(served: Served) -> tuple[int, dict[str, int]]:
    for client_id in served.tokens:
        response = await served.http.get("/v1/task", params={"wait_s": 0}, headers=served.auth(client_id))
        if response.status_code == 200:
            return client_id, response.json()
    raise AssertionError("no client has a task")


async def test_requests_before_the_run_starts_get_503(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A server whose run has not started answers 503 with Retry-After."""
    federation = Federation(remote_config(tmp_path / "tokens.txt"))
    transport = httpx.ASGITransport(app=asgi_app(federation))
    async with httpx.AsyncClient(transport=transport, base_url="http://fl") as http:
        response = await http.get("/v1/hello", headers={"authorization": f"Bearer {tokens[0]}"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"


async def test_wrong_token_is_401_and_counted(served: Served) -> None:
    """An unknown token gets 401; the refusal is a metric; the server still serves."""
    response = await served.http.get("/v1/hello", headers={"authorization": "Bearer " + "x" * 32})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert (await served.http.get("/v1/task", params={"wait_s": 0})).status_code == 401
    assert served.metric("remote/refused/unauthorized") == 2
    assert (await served.http.get("/v1/hello", headers=served.auth(0))).status_code == 200


async def test_a_token_cannot_upload_for_another_clients_task(served: Served) -> None:
    """Client B uploading for A's task gets 403 and A's own upload is still accepted."""
    owner, offer = await _busy_client(served)
    other = next(c for c in served.tokens if c != owner)
    body = codecs.encode(torch.zeros(_num_params(served)))
    response = await served.upload(other, offer["task_id"], body)
    assert response.status_code == 403
    assert served.metric("remote/refused/not_your_task") == 1
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 202
    await served.settle()
    server = served.federation.server
    assert server is not None and server.stats.updates_accepted == 1


async def test_a_replayed_task_is_refused(served: Served) -> None:
    """A task id is accepted once; the replay gets 409 and is counted."""
    owner, offer = await _busy_client(served)
    body = codecs.encode(torch.full((_num_params(served),), 1e-3))
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 202
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 409
    await served.settle()
    assert (await served.upload(owner, offer["task_id"], body)).status_code in (403, 409)
    server = served.federation.server
    assert server is not None and server.stats.updates_accepted == 1
    assert served.metric("remote/refused/replay") >= 1


async def test_an_answer_to_a_dead_server_process_task_is_refused_as_stale(served: Served) -> None:
    """An answer naming another incarnation than the one that dispatched the task gets 409 stale_task, counted; the
    same answer naming the offer's incarnation is accepted."""
    client_id, offer = await _busy_client(served)
    transport = served.federation.transport
    assert transport is not None and offer["incarnation"] == transport.incarnations.name
    body = codecs.encode(torch.zeros(_num_params(served)))
    stale = await served.upload(client_id, offer["task_id"], body, {INCARNATION_HEADER: "0123456789abcdef"})
    assert (stale.status_code, stale.json()["error"]) == (409, "stale_task")
    assert served.metric("remote/refused/stale_task") == 1
    failed = await served.http.post(
        f"/v1/tasks/{offer['task_id']}/failed", headers={**served.auth(client_id), INCARNATION_HEADER: "dead"}
    )
    assert failed.status_code == 409
    answer = await served.upload(client_id, offer["task_id"], body, {INCARNATION_HEADER: str(offer["incarnation"])})
    assert answer.status_code == 202


async def test_an_oversize_body_is_refused_before_it_is_read(served: Served) -> None:
    """A declared or streamed body over the model's encoded size gets 413; the task stays answerable."""
    owner, offer = await _busy_client(served)
    transport = served.federation.transport
    assert transport is not None
    huge = b"\0" * (transport.max_upload_bytes + 1)
    assert (await served.upload(owner, offer["task_id"], huge)).status_code == 413
    read: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        for _ in range(1000):
            read.append(1)
            yield b"\0" * 65536

    headers = {**served.auth(owner), **_REPORT}
    response = await served.http.post(f"/v1/tasks/{offer['task_id']}/update", content=endless(), headers=headers)
    assert response.status_code == 413
    assert served.metric("remote/refused/too_large") == 2
    body = codecs.encode(torch.zeros(_num_params(served)))
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 202


@pytest.mark.parametrize(
    ("make_body", "reason"),
    [
        (lambda n: b"not a flasync payload", "decode"),
        (lambda n: codecs.encode(torch.zeros(n + 7)), "decode"),
        (lambda n: codecs.encode(torch.full((n,), float("nan"))), "non_finite"),
    ],
    ids=["garbage", "wrong_shape", "nan"],
)
async def test_bad_updates_go_through_the_intake(served: Served, make_body: object, reason: str) -> None:
    """Garbage bytes, a wrong length and NaN reach the intake and are counted as its rejections."""
    owner, offer = await _busy_client(served)
    body = make_body(_num_params(served))  # type: ignore[operator]
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 202
    await served.settle()
    server = served.federation.server
    assert server is not None
    assert server.stats.drop_reasons[reason] == 1
    assert (await served.http.get("/v1/status")).json()["state"] == "running"


async def test_a_malformed_report_is_400(served: Served) -> None:
    """A report that is not JSON, claims an absurd sample count, or holds an evaluation out of range or with
    metrics the run does not have, is refused with 400."""
    owner, offer = await _busy_client(served)
    body = codecs.encode(torch.zeros(_num_params(served)))
    url = f"/v1/tasks/{offer['task_id']}/update"
    evaluation = {"num_samples": 5, "accuracy": 0.5, "loss": 1.0}
    bad = [
        "{",
        json.dumps({"num_samples": 10**12, "train_loss": 0.0}),
        json.dumps({"num_samples": 10, "train_loss": 0.0, "evaluation": {**evaluation, "accuracy": 1.5}}),
        json.dumps({"num_samples": 10, "train_loss": 0.0, "evaluation": {**evaluation, "metrics": {"f1": 0.5}}}),
    ]
    for report in bad:
        response = await served.http.post(url, content=body, headers={**served.auth(owner), REPORT_HEADER: report})
        assert response.status_code == 400, report
    assert served.metric("remote/refused/bad_report") == len(bad)  # logged at the 1st, 2nd, 4th, ... refusal


@pytest.mark.slow
async def test_too_many_waiting_clients_get_429(served: Served) -> None:
    """Past remote.max_waiting held requests, a request for a task gets 429 with Retry-After."""
    idle = []
    for client_id in served.tokens:
        response = await served.http.get("/v1/task", params={"wait_s": 0}, headers=served.auth(client_id))
        if response.status_code == 204:
            idle.append(client_id)
    assert idle
    held = asyncio.create_task(served.http.get("/v1/task", params={"wait_s": 2}, headers=served.auth(idle[0])))
    await served.settle()
    response = await served.http.get("/v1/task", params={"wait_s": 2}, headers=served.auth(idle[0]))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert (await held).status_code in (200, 204)
    assert served.metric("remote/refused/busy") == 1


async def test_a_task_goes_to_one_connection_of_a_shared_token(served: Served) -> None:
    """Two connections with one token: the first to ask gets the task (again, if it asks again); the other gets
    409 token_in_use with Retry-After while the task is in flight, and 403 if it uploads for it; both counted."""
    owner, offer = await _busy_client(served)  # asked without a session header: the empty session holds it
    other = {**served.auth(owner), SESSION_HEADER: "second-device"}
    refused = await served.http.get("/v1/task", params={"wait_s": 0}, headers=other)
    assert refused.status_code == 409
    assert refused.json()["error"] == "token_in_use" and refused.headers["retry-after"] == "1"
    again = await served.http.get("/v1/task", params={"wait_s": 0}, headers=served.auth(owner))
    assert again.status_code == 200 and again.json()["task_id"] == offer["task_id"]
    body = codecs.encode(torch.zeros(_num_params(served)))
    headers = {**other, **_REPORT, "content-type": "application/octet-stream"}
    stolen = await served.http.post(f"/v1/tasks/{offer['task_id']}/update", content=body, headers=headers)
    assert stolen.status_code == 403 and stolen.json()["error"] == "other_connection"
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 202
    await served.settle()
    assert served.metric("remote/refused/token_in_use") == 1
    assert served.metric("remote/refused/other_connection") == 1
    server = served.federation.server
    assert server is not None and server.stats.updates_accepted == 1


async def test_a_malformed_session_header_is_400(served: Served) -> None:
    """A session header that is not 1-64 letters, digits, '-' or '_' is refused with one line."""
    headers = {**served.auth(0), SESSION_HEADER: "no spaces allowed"}
    response = await served.http.get("/v1/task", params={"wait_s": 0}, headers=headers)
    assert response.status_code == 400 and SESSION_HEADER in response.json()["detail"]


async def test_a_huge_id_is_a_400_after_the_token_check(served: Served) -> None:
    """A 5000-digit task id or model version (before: a 500 and a traceback, before authentication) is 400 for an
    authenticated client and 401 for anyone else."""
    huge = "9" * 5000
    assert (await served.http.post(f"/v1/tasks/{huge}/failed")).status_code == 401
    response = await served.http.post(f"/v1/tasks/{huge}/failed", headers=served.auth(0))
    assert response.status_code == 400 and "at most 18 digits" in response.json()["detail"]
    response = await served.http.get(f"/v1/models/{huge}", headers=served.auth(0))
    assert response.status_code == 400
    assert (await served.http.get("/v1/models/-1", headers=served.auth(0))).status_code == 400


@pytest.fixture
def frozen_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the application built next keep its address limits on a clock that never moves (no token comes back)."""
    monkeypatch.setattr(serve, "AddressLimits", lambda: AddressLimits(clock=lambda: 0.0))


async def test_a_flood_of_refused_requests_is_rate_limited_and_adds_few_rows(
    frozen_limits: None, served: Served
) -> None:
    """An address that keeps sending requests the server refuses gets 429 with Retry-After once it spent its budget;
    every refusal is counted, and their metric lines come at the 1st, 2nd, 4th, ... of a reason, not per request.
    The status endpoint still answers."""
    transport = served.federation.transport
    assert transport is not None
    codes = [(await served.http.get("/v1/task", params={"wait_s": 0})).status_code for _ in range(100)]
    assert codes == [401] * 30 + [429] * 70  # the bucket's 30 tokens, then none (its clock does not move)
    limited = await served.http.get("/v1/hello", headers=served.auth(0))  # the address waits, token or not
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    refused = transport.statistics()["refused"]
    assert refused["unauthorized"] == codes.count(401) and refused["rate_limited"] == codes.count(429) + 1
    rows = [row for row in served.tracker.metrics if row.key.startswith("remote/refused/")]
    lines = sum(math.floor(math.log2(count)) + 1 for count in refused.values())  # 1st, 2nd, 4th, ... of each
    assert len(rows) == 2 * lines < 30  # the reason's count and the total, per line: not rows per request
    assert (await served.http.get("/v1/status")).status_code == 200
    transport.finish("KILLED")  # as the run's end does: each metric's last value is the whole count
    for reason, count in refused.items():
        assert served.metric(f"remote/refused/{reason}") == count
    assert served.metric("remote/refused/total") == sum(refused.values())


async def test_a_body_that_stops_coming_is_408(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload whose body pauses longer than the server waits for a chunk is refused (408), counted, and the
    task stays answerable."""
    from flasync.runtime import serve

    monkeypatch.setattr(serve, "BODY_IDLE_S", 0.2)
    owner, offer = await _busy_client(served)

    async def stalled() -> AsyncIterator[bytes]:
        yield b"\0" * 16
        await asyncio.sleep(5)
        yield b"\0" * 16

    headers = {**served.auth(owner), **_REPORT}
    response = await served.http.post(f"/v1/tasks/{offer['task_id']}/update", content=stalled(), headers=headers)
    assert response.status_code == 408
    assert served.metric("remote/refused/slow_body") == 1
    body = codecs.encode(torch.zeros(_num_params(served)))
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 202


async def test_an_accepted_update_logs_the_devices_figures_as_a_simulated_client_does(served: Served) -> None:
    """A remote upload's report becomes the ``client/*`` metric rows a simulated client's update gives, at the
    task's step."""
    owner, offer = await _busy_client(served)
    body = codecs.encode(torch.full((_num_params(served),), 1e-3))
    assert (await served.upload(owner, offer["task_id"], body)).status_code == 202
    await served.settle()
    rows = [row for row in served.tracker.metrics if row.key == "client/loss"]
    assert [(row.step, row.value) for row in rows] == [(offer["task_id"], 1.0)]
