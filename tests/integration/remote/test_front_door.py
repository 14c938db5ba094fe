"""The served run's front door on a real uvicorn server: the token-checked endpoints answered straight from the ASGI
callable give the answers, refusals and limits Starlette's router gives with the same endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.types import ASGIApp, Receive, Scope, Send

from flasync import codecs
from flasync.core.events import ClientId
from flasync.runtime import serve
from flasync.runtime.federation import Federation
from flasync.runtime.serve import OFFER_HEADER, REPORT_HEADER, asgi_app
from tests.conftest import free_port, remote_config
from tests.integration.remote.test_downloads import _App, device_headers, offer_of, served

pytestmark = pytest.mark.timeout(120)

_REPORT = json.dumps({"num_samples": 10, "train_loss": 1.0})


class _Through:
    """A middleware that passes every request on, counting them: an application given one is answered by
    Starlette's layers alone."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.calls = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.calls += 1
        await self.app(scope, receive, send)


def _door(kind: str, apps: list[Starlette]) -> Any:
    """Return a ``wrap`` for :func:`served` that keeps the application in ``apps`` and, for ``starlette``, gives it a
    middleware (so that Starlette's router answers every request)."""

    def wrap(app: _App) -> _App:
        assert isinstance(app, Starlette)
        if kind == "starlette":
            app.add_middleware(_Through)
        apps.append(app)
        return app

    return wrap


def _answer(response: httpx.Response) -> tuple[Any, ...]:
    """Return what a refusal says: status, its headers that matter, its JSON body."""
    headers = response.headers
    body = response.json() if headers.get("content-type") == "application/json" else response.content
    return (
        response.status_code,
        headers.get("content-type"),
        headers.get("retry-after"),
        headers.get("www-authenticate"),
        body,
    )


async def _refusals(http: httpx.AsyncClient, tokens: dict[int, str], federation: Federation) -> list[tuple[Any, ...]]:
    """Send a script of refused requests to the hot endpoints; return each answer (:func:`_answer`)."""
    transport = federation.transport
    assert transport is not None
    mine = device_headers(tokens[0])
    offer = (await offer_of(http, mine)).json()
    upload = {**mine, REPORT_HEADER: _REPORT}
    requests: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/task", {"params": {"wait_s": 0}}),
        ("GET", "/v1/task", {"params": {"wait_s": 0}, "headers": {"authorization": f"Basic {tokens[0]}"}}),
        ("GET", "/v1/hello", {"headers": {"authorization": "Bearer " + "x" * 32}}),
        ("GET", "/v1/task", {"params": {"wait_s": "soon"}, "headers": mine}),
        ("GET", "/v1/task", {"params": {"wait_s": ""}, "headers": mine}),  # a blank value is kept (and malformed)
        ("GET", "/v1/task", {"params": {"wait_s": 0, "model": "inline", "have": "v1"}, "headers": mine}),
        ("GET", "/v1/task", {"params": {"wait_s": 0}, "headers": {**mine, "x-flasync-session": "not ok!"}}),
        ("GET", "/v1/models/latest", {"headers": mine}),
        ("GET", "/v1/models/999999", {"headers": mine}),
        ("POST", "/v1/tasks/1234567890123456789/update", {"headers": upload, "content": b"x"}),
        ("POST", "/v1/tasks/999999/update", {"headers": upload, "content": b"x"}),
        ("POST", "/v1/tasks/999999/update?next=inline&have=x", {"headers": upload, "content": b"x"}),
        ("POST", f"/v1/tasks/{offer['task_id']}/update", {"headers": {**mine, REPORT_HEADER: "{"}, "content": b"x"}),
        (
            "POST",
            f"/v1/tasks/{offer['task_id']}/update",
            {"headers": upload, "content": b"\0" * (transport.max_upload_bytes + 1)},
        ),
        ("POST", "/v1/tasks/999999/failed", {"headers": mine, "json": {"error": "boom"}}),
    ]
    return [_answer(await http.request(method, path, **kwargs)) for method, path, kwargs in requests]


@pytest.mark.slow
async def test_refusals_are_the_same_through_either_door(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Each refusal of a hot endpoint (no or a wrong token, a malformed query, header or id, a task that is not the
    client's, a malformed report, an oversized body) has the status, headers and body Starlette's router answers,
    and the front door answered them all without Starlette's layers."""
    answers: dict[str, list[tuple[Any, ...]]] = {}
    for kind in ("front", "starlette"):
        apps: list[Starlette] = []
        async with (
            served(tmp_path, _door(kind, apps)) as (url, federation),
            httpx.AsyncClient(base_url=url, timeout=30.0) as http,
        ):
            answers[kind] = await _refusals(http, tokens, federation)
            built = apps[0].middleware_stack is not None
        assert built == (kind == "starlette")  # the front door never built Starlette's stack
    assert answers["front"] == answers["starlette"]
    statuses = [answer[0] for answer in answers["front"]]
    assert statuses == [401, 401, 401, 400, 400, 400, 400, 400, 404, 400, 403, 400, 400, 413, 403]
    unauthorized = answers["front"][0]
    assert unauthorized[1:4] == ("application/json", None, "Bearer")
    assert unauthorized[4] == {"error": "unauthorized", "detail": "missing or unknown bearer token"}
    reasons = [answer[4]["error"] for answer in answers["front"][3:]]
    assert reasons[-3:] == ["bad_report", "too_large", "not_your_task"]


@pytest.mark.parametrize("kind", ["front", "starlette"])
async def test_each_hot_endpoint_answers_through_either_door(tmp_path: Path, tokens: dict[int, str], kind: str) -> None:
    """An offer (JSON, or inline with its model), the model with its entity tag (304 when named), an accepted update
    carrying the next task or saying it was received, and hello: the same answers through either door."""
    apps: list[Starlette] = []
    async with served(tmp_path, _door(kind, apps)) as (url, federation), httpx.AsyncClient(base_url=url) as http:
        transport = federation.transport
        assert transport is not None
        headers = device_headers(tokens[1])
        plain = await offer_of(http, headers)
        assert plain.headers["content-type"] == "application/json" and OFFER_HEADER not in plain.headers
        offer = plain.json()
        inline = await offer_of(http, headers, model="inline", have=-1)
        assert inline.headers["content-type"] == "application/octet-stream"
        assert json.loads(inline.headers[OFFER_HEADER]) == offer
        model = await http.get(f"/v1/models/{offer['base_version']}", headers=headers)
        assert (model.status_code, model.content) == (200, inline.content)
        assert model.headers["etag"] == inline.headers["etag"] and model.headers["cache-control"] == "private, no-cache"
        held = await http.get(model.url, headers={**headers, "if-none-match": model.headers["etag"]})
        assert (held.status_code, held.content, "content-length" in held.headers) == (304, b"", False)
        body = codecs.encode(torch.zeros(transport.num_params))
        answer = await http.post(
            f"/v1/tasks/{offer['task_id']}/update",
            params={"next": "inline", "have": offer["base_version"]},
            content=body,
            headers={**headers, REPORT_HEADER: _REPORT},
        )
        assert answer.status_code == 202 and transport.uploads == 1
        if OFFER_HEADER in answer.headers:  # the next task came within the answer's turns of the loop
            assert json.loads(answer.headers[OFFER_HEADER])["task_id"] != offer["task_id"]
        else:
            assert answer.json() == {"status": "received", "task_id": offer["task_id"]}
        hello = await http.get("/v1/hello", headers=headers)
        assert hello.headers["content-type"] == "application/json" and hello.json()["client_id"] == 1
        assert apps[0].middleware_stack is None if kind == "front" else apps[0].middleware_stack is not None
        status = await http.get("/v1/status")
        assert status.json()["state"] == "running"
        assert apps[0].middleware_stack is not None  # /v1/status goes through Starlette


@pytest.mark.slow
async def test_an_address_that_spent_its_budget_gets_429_at_the_front_door(
    tmp_path: Path, tokens: dict[int, str]
) -> None:
    """Answers a well-behaved client gets cost nothing; each refused request costs its address a token, and once
    the bucket (30, refilling) is empty the next request is 429 with Retry-After, counted; the status endpoint
    still answers."""
    async with served(tmp_path) as (url, federation), httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        transport = federation.transport
        assert transport is not None
        headers = device_headers(tokens[2])
        await offer_of(http, headers)  # its task is handed: asking again meanwhile gets the same one
        for _ in range(40):
            assert (await http.get("/v1/task", params={"wait_s": 0}, headers=headers)).status_code == 200
        refused = 0
        while (answer := await http.get("/v1/models/x", headers=headers)).status_code == 400:
            refused += 1
            assert refused < 1000
        assert refused >= 30  # a bucket of 30, and more as it refills: the answers above cost nothing
        assert (answer.status_code, answer.json()["error"]) == (429, "rate_limited")
        assert int(answer.headers["retry-after"]) >= 1
        assert (await http.get("/v1/status")).status_code == 200
        counts = transport.statistics()["refused"]
        assert counts["bad_request"] == refused and counts["rate_limited"] == 1


async def test_before_the_run_starts_the_hot_endpoints_answer_503_and_cost_nothing(
    tmp_path: Path, tokens: dict[int, str]
) -> None:
    """A server whose run has not started answers 503 with Retry-After (a long poll: 204, no task yet), as many
    times as it is asked (a client waiting for the run is never rate limited)."""
    federation = Federation(remote_config(tmp_path / "tokens.txt"))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(asgi_app(federation), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done()
            await asyncio.sleep(0.01)
        headers = {**device_headers(tokens[0]), REPORT_HEADER: _REPORT}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", headers=headers) as http:
            polls, answers = [], []
            for _ in range(12):
                polls.append(await http.get("/v1/task", params={"wait_s": 0}))
                answers += [
                    await http.get("/v1/models/0"),
                    await http.post("/v1/tasks/0/update", content=b"x"),
                    await http.get("/v1/hello"),
                ]
        assert {(a.status_code, a.content) for a in polls} == {(204, b"")}  # no task yet: ask again
        assert {(a.status_code, a.headers["retry-after"], a.json()["error"]) for a in answers} == {
            (503, "1", "not_started")
        }
    finally:
        server.should_exit = True
        await serving


@pytest.mark.slow
async def test_bodies_at_the_front_door_are_bounded_and_timed(
    tmp_path: Path, tokens: dict[int, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upload without a length that grows past the limit is 413 (the rest never read); one whose body stops
    coming is 408; a client that goes away mid-body is not answered nor counted; the server goes on serving."""
    monkeypatch.setattr(serve, "BODY_IDLE_S", 0.3)
    async with served(tmp_path) as (url, federation), httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        transport = federation.transport
        assert transport is not None
        headers = {**device_headers(tokens[3]), REPORT_HEADER: _REPORT}
        task_id = (await offer_of(http, headers)).json()["task_id"]
        path = f"/v1/tasks/{task_id}/update"

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(transport.max_upload_bytes // 1024 + 2):
                yield b"\0" * 1024

        oversized = await http.post(path, content=chunks(), headers=headers)
        assert (oversized.status_code, oversized.json()["error"]) == (413, "too_large")
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = f"POST {path} HTTP/1.1\r\nhost: fl\r\n{head}content-length: 1000\r\n\r\n".encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(request + b"\0" * 10)  # and then nothing
        status_line = await reader.readline()
        assert status_line.split()[1] == b"408"
        writer.close()
        before = dict(transport.statistics()["refused"])
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        writer.write(request + b"\0" * 10)
        await writer.drain()
        writer.close()  # gone mid-body
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
        await asyncio.sleep(2 * serve.BODY_IDLE_S)  # had it waited for the rest, it would have refused it by now
        accepted = await http.post(path, content=codecs.encode(torch.zeros(transport.num_params)), headers=headers)
        assert accepted.status_code == 202
        assert dict(transport.statistics()["refused"]) == before
        assert before["too_large"] == 1 and before["slow_body"] == 1 and transport.uploads == 1


async def test_a_mounted_application_is_answered_at_its_front_door(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Mounted under a prefix in another application, the hot endpoints are answered below that prefix by the front
    door; the status, a wrong method and an unknown path by Starlette."""
    apps: list[Starlette] = []

    def mount(app: _App) -> _App:
        assert isinstance(app, Starlette)
        apps.append(app)
        return Starlette(routes=[Mount("/fl", app=app)])

    async with served(tmp_path, mount) as (url, _), httpx.AsyncClient(base_url=url + "/fl", timeout=30.0) as http:
        headers = device_headers(tokens[4])
        offer = (await offer_of(http, headers)).json()
        model = await http.get(f"/v1/models/{offer['base_version']}", headers=headers)
        assert model.status_code == 200 and model.headers["content-type"] == "application/octet-stream"
        assert apps[0].middleware_stack is None
        assert (await http.get("/v1/status")).json()["state"] == "running"
        wrong = await http.post("/v1/task", headers=headers)
        assert (wrong.status_code, set(wrong.headers["allow"].split(", "))) == (405, {"GET", "HEAD"})
        assert (await http.get("/v1/tasks/1/update", headers=headers)).status_code == 405
        assert (await http.get("/v1/nothing", headers=headers)).status_code == 404
        assert (await http.get(url + "/v1/task", headers=headers)).status_code == 404  # not below the prefix


@pytest.mark.slow
async def test_a_timed_out_task_is_not_handed_again(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A task handed to a device that never answers is timed out by the registry; the device asking again is not
    offered that task (its mailbox finds it is no longer in flight), and its upload for it is refused."""
    overrides: dict[str, Any] = {"resilience": {"task_timeout_s": 0.3}, "server": {"concurrency": 1}}
    async with served(tmp_path, **overrides) as (url, federation), httpx.AsyncClient(base_url=url) as http:
        transport = federation.transport
        assert transport is not None
        headers = device_headers(tokens[0])
        task_id = (await offer_of(http, headers)).json()["task_id"]
        for _ in range(2000):  # until the registry times the task out
            if transport.check_upload(ClientId(0), task_id, None, "device-0") is not None:
                break
            await asyncio.sleep(0.01)
        again = await http.get("/v1/task", params={"wait_s": 0}, headers=headers)
        assert again.status_code == 204 or again.json()["task_id"] != task_id
        late = await http.post(f"/v1/tasks/{task_id}/update", content=b"x", headers={**headers, REPORT_HEADER: _REPORT})
        assert (late.status_code, late.json()["error"]) == (403, "not_your_task")
