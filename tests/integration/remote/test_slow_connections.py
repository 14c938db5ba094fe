"""A real uvicorn server with flasync's HTTP protocol: connections that send their headers too slowly are closed."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from flasync.runtime import serve
from tests.conftest import free_port

pytestmark = pytest.mark.timeout(60)


async def _status(request: Request) -> JSONResponse:
    return JSONResponse({"state": "running"})


@pytest.mark.parametrize("protocol", [serve._FastHeaderDeadline, serve._HeaderDeadline], ids=["httptools", "h11"])
@pytest.mark.slow
async def test_slow_header_connections_are_closed_and_others_served(
    monkeypatch: pytest.MonkeyPatch, protocol: type[asyncio.Protocol]
) -> None:
    """Fifty connections that never finish their headers (before: still open after 20 s), and one that goes quiet
    mid-headers after a whole request, are closed at the header deadline; a well-formed request is answered during
    and after (over httptools, as flasync serve runs, and h11)."""
    monkeypatch.setattr(serve, "HEADER_TIMEOUT_S", 0.3)
    port = free_port()
    app = Starlette(routes=[Route("/v1/status", _status)])
    config = uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, log_level="warning")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(500):  # uvicorn says it started by a flag
            if server.started or serving.done():
                break
            await asyncio.sleep(0.01)
        assert server.started
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(50)]
        for _, writer in slow:
            writer.write(b"GET /v1/status HTTP/1.1\r\nHost: fl\r\n")  # never the blank line
            await writer.drain()
        kept_alive = await asyncio.open_connection("127.0.0.1", port)
        kept_alive[1].write(b"GET /v1/status HTTP/1.1\r\nHost: fl\r\n\r\n")
        first = await asyncio.wait_for(kept_alive[0].readuntil(b'{"state":"running"}'), 5)
        assert first.startswith(b"HTTP/1.1 200")
        kept_alive[1].write(b"GET /v1/status HTTP/1.1\r\n")  # then goes quiet
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/v1/status")).status_code == 200
            for reader, _ in [*slow, kept_alive]:
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server, nothing answered
            assert (await http.get("/v1/status")).status_code == 200
        for _, writer in [*slow, kept_alive]:
            writer.close()
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving


async def _slow(request: Request) -> JSONResponse:
    await asyncio.sleep(0.8)  # a long poll: longer than the header deadline
    return JSONResponse({"state": "slow"})


@pytest.mark.parametrize("protocol", [serve._FastHeaderDeadline, serve._HeaderDeadline], ids=["httptools", "h11"])
@pytest.mark.slow
async def test_a_request_answered_after_the_header_deadline_keeps_its_connection(
    monkeypatch: pytest.MonkeyPatch, protocol: type[asyncio.Protocol]
) -> None:
    """A request whose headers came in time is answered however long its answer takes (a long poll), and its
    connection then serves the next request."""
    monkeypatch.setattr(serve, "HEADER_TIMEOUT_S", 0.3)
    port = free_port()
    app = Starlette(routes=[Route("/slow", _slow), Route("/v1/status", _status)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=protocol, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started or serving.done():
                break
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: fl\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b'{"state":"slow"}'), 5)).startswith(b"HTTP/1.1 200")
        writer.write(b"GET /v1/status HTTP/1.1\r\nHost: fl\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b'{"state":"running"}'), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await serving
