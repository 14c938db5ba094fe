"""Model downloads over a real uvicorn server on loopback: an offer with its model inline, entity tags and 304, and
the remote client against a server that inlines and one that does not."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from flasync import codecs
from flasync.clients.remote.client import Client
from flasync.core.errors import RunInterrupted
from flasync.runtime import serve
from flasync.runtime.federation import Federation
from flasync.runtime.serve import OFFER_HEADER, REPORT_HEADER, SESSION_HEADER, asgi_app
from tests.conftest import free_port, remote_config

pytestmark = pytest.mark.timeout(120)

_App = Callable[..., Any]


def _without_inline(app: _App) -> _App:
    """Return ``app`` behind a server that knows no inline model: the query's ``model`` is dropped, as a server of
    the protocol before it ignores it."""

    async def older(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/task":
            query = b"&".join(p for p in scope["query_string"].split(b"&") if not p.startswith(b"model="))
            scope = {**scope, "query_string": query}
        await app(scope, receive, send)

    return older


def counting_paths(paths: list[str], inner: Callable[[_App], _App] | None = None) -> Callable[[_App], _App]:
    """A wrapper for :func:`served` that appends each request's path to ``paths`` (after wrapping the app in
    ``inner``, if given)."""

    def wrap(app: _App) -> _App:
        wrapped = app if inner is None else inner(app)

        async def counted(scope: dict[str, Any], receive: Any, send: Any) -> None:
            paths.append(scope.get("path", ""))
            await wrapped(scope, receive, send)

        return counted

    return wrap


@contextlib.asynccontextmanager
async def served(
    tmp_path: Path, wrap: Callable[[_App], _App] = lambda app: app, **overrides: Any
) -> AsyncIterator[tuple[str, Federation]]:
    """Run a remote federation under uvicorn (flasync's HTTP protocol) on a free loopback port; yield its URL.

    Args:
        tmp_path: Where the tokens file is (the ``tokens`` fixture's).
        wrap: Puts the served application behind something (another server, a counter).
        overrides: Config sections over :func:`~tests.conftest.remote_config`'s, with a run that does not stop.
    """
    overrides = {"stop": {"max_versions": 10**6}, "resilience": {"task_timeout_s": 60.0}, **overrides}
    config = remote_config(tmp_path / "tokens.txt", **overrides)
    federation = Federation(config)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            wrap(asgi_app(federation)),
            host="127.0.0.1",
            port=port,
            http=serve._FastHeaderDeadline,
            log_level="warning",
            lifespan="off",
        )
    )
    serving = asyncio.create_task(server.serve())
    run = asyncio.create_task(federation.run())
    try:
        for _ in range(1000):
            if server.started or serving.done():
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield f"http://127.0.0.1:{port}", federation
    finally:
        federation.request_stop("test over")
        with contextlib.suppress(RunInterrupted):
            await run
        server.should_exit = True
        await serving


async def offer_of(http: httpx.AsyncClient, headers: dict[str, str], **params: Any) -> httpx.Response:
    """Ask for a task until one comes (the run starts and the device connects meanwhile)."""
    for _ in range(200):
        response = await http.get("/v1/task", params={"wait_s": 1.0, **params}, headers=headers)
        if response.status_code == 200:
            return response
        await asyncio.sleep(0.02)
    raise AssertionError("no task came")


def device_headers(token: str) -> dict[str, str]:
    """Return the headers of a device's requests: its bearer token and its session."""
    return {"authorization": f"Bearer {token}", SESSION_HEADER: "device-0"}


async def test_an_inline_offer_holds_the_model_of_its_version(tmp_path: Path, tokens: dict[int, str]) -> None:
    """``model=inline`` answers the task in a header and the model of its version as the body, the very bytes the
    model endpoint serves; asked again naming that version as held, the same task comes with no body; the update is
    then accepted."""
    async with served(tmp_path) as (url, federation), httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        headers = device_headers(tokens[0])
        first = await offer_of(http, headers, model="inline", have=-1)
        assert first.headers["content-type"] == "application/octet-stream"
        offer = json.loads(first.headers[OFFER_HEADER])
        transport = federation.transport
        assert transport is not None
        weights = codecs.decode(first.content, expected_elements=transport.num_params)
        assert weights.shape == (transport.num_params,)
        separate = await http.get(f"/v1/models/{offer['base_version']}", headers=headers)
        assert separate.content == first.content and separate.headers["etag"] == first.headers["etag"]
        again = await offer_of(http, headers, model="inline", have=offer["base_version"])
        assert json.loads(again.headers[OFFER_HEADER]) == offer and again.content == b""
        body = codecs.encode(torch.zeros(transport.num_params))
        upload_headers = {**headers, REPORT_HEADER: json.dumps({"num_samples": 10, "train_loss": 1.0})}
        upload = await http.post(f"/v1/tasks/{offer['task_id']}/update", content=body, headers=upload_headers)
        assert upload.status_code == 202
        assert transport.wire_download_bytes == 2 * len(first.content)


async def test_a_plain_offer_is_json_and_a_malformed_have_is_400(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Without ``model=inline`` the offer is the JSON it always was; a ``have`` that is not a version is 400."""
    async with served(tmp_path) as (url, _), httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        headers = device_headers(tokens[1])
        plain = await offer_of(http, headers)
        assert plain.headers["content-type"] == "application/json" and OFFER_HEADER not in plain.headers
        assert {"task_id", "base_version", "participation", "incarnation"} <= set(plain.json())
        bad = await http.get("/v1/task", params={"wait_s": 0, "model": "inline", "have": "1e3"}, headers=headers)
        assert (bad.status_code, bad.json()["error"]) == (400, "bad_request")


async def test_a_model_named_by_its_etag_is_304_without_a_body(tmp_path: Path, tokens: dict[int, str]) -> None:
    """The model endpoint answers an ``ETag``; ``If-None-Match`` naming it (or ``*``) is 304 with no body and no
    bytes counted, another tag gets the model again."""
    async with served(tmp_path) as (url, federation), httpx.AsyncClient(base_url=url, timeout=30.0) as http:
        headers = device_headers(tokens[2])
        offer = (await offer_of(http, headers)).json()
        path = f"/v1/models/{offer['base_version']}"
        full = await http.get(path, headers=headers)
        etag = full.headers["etag"]
        assert full.status_code == 200 and etag.startswith('"') and len(full.content) > 0
        transport = federation.transport
        assert transport is not None
        counted = transport.wire_download_bytes
        for named in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            held = await http.get(path, headers={**headers, "if-none-match": named})
            assert (held.status_code, held.content, held.headers["etag"]) == (304, b"", etag)
        assert transport.wire_download_bytes == counted
        other = await http.get(path, headers={**headers, "if-none-match": '"not-this-one"'})
        assert (other.status_code, other.content) == (200, full.content)


@pytest.mark.slow
@pytest.mark.parametrize("inlines", [True, False], ids=["server-inlines", "older-server"])
async def test_the_remote_client_trains_against_either_server(
    tmp_path: Path, tokens: dict[int, str], inlines: bool
) -> None:
    """flasync's client answers tasks with a server that inlines models (never asking the model endpoint) and with
    one that answers offers alone (it downloads each model then); either way every model byte the server sent is one
    the client received."""
    paths: list[str] = []
    wrap = counting_paths(paths, None if inlines else _without_inline)
    async with served(tmp_path, wrap) as (url, federation):
        client = Client(url, tokens[3], poll_s=2.0, backoff_s=0.05)
        stats = await client.run(max_tasks=3)
        transport = federation.transport
        assert transport is not None
        assert stats.uploads == 3 and stats.dropped == 0
        assert stats.download_bytes == transport.wire_download_bytes > 0
    downloads = sum(path.startswith("/v1/models/") for path in paths)
    assert (downloads == 0) if inlines else (downloads >= 1)
