"""A real uvicorn server flooded from one address: every request is answered, the flood is limited (429 with
Retry-After), the status endpoint still answers, and the refusals are counters, not rows per request."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import signal
import socket
import sys
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from flasync.core.errors import RunInterrupted
from flasync.runtime.federation import Federation
from flasync.runtime.serve import REPORT_HEADER, serve
from flasync.testing import MemoryTracker
from tests.conftest import free_port, remote_config, write_remote_config

pytestmark = pytest.mark.timeout(120)

_OTHER_ADDRESS = "127.0.0.2"
_REQUESTS = 240
_CONCURRENCY = 16


def _can_bind(address: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


@dataclass
class Flooded:
    """A served run on a real port (no client trains), its tracker and the tokens of its clients."""

    url: str
    federation: Federation
    tracker: MemoryTracker
    tokens: dict[int, str]

    def refused(self) -> dict[str, int]:
        transport = self.federation.transport
        assert transport is not None
        return dict(transport.statistics()["refused"])

    def refusal_rows(self) -> list[str]:
        return [row.key for row in self.tracker.metrics if row.key.startswith("remote/refused/")]


@pytest.fixture
async def flooded(tmp_path: Path, tokens: dict[int, str]) -> AsyncIterator[Flooded]:
    config = remote_config(tmp_path / "tokens.txt", stop={"max_versions": 1000}, resilience={"task_timeout_s": 60.0})
    tracker = MemoryTracker()
    federation = Federation(config, tracker=tracker)
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    served = asyncio.create_task(serve(federation, port=0, on_ready=port.set_result, linger_s=0.1))
    url = f"http://127.0.0.1:{await port}"
    async with httpx.AsyncClient(base_url=url) as http:
        for _ in range(500):
            if (await http.get("/v1/status")).json()["state"] == "running":
                break
            await asyncio.sleep(0.01)
    yield Flooded(url, federation, tracker, tokens)
    federation.request_stop("test over")
    with contextlib.suppress(RunInterrupted):
        await served


async def _flood(url: str, requests: list[tuple[str, str, dict[str, str], bytes | None]]) -> list[httpx.Response]:
    """Send ``requests`` from 127.0.0.1 over :data:`_CONCURRENCY` connections; return every response in order."""
    answers: list[httpx.Response | None] = [None] * len(requests)

    async def connection(first: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as http:
            for index in range(first, len(requests), _CONCURRENCY):
                method, path, headers, body = requests[index]
                answers[index] = await http.request(method, path, headers=headers, content=body)

    await asyncio.gather(*(connection(first) for first in range(_CONCURRENCY)))
    assert all(answer is not None for answer in answers)
    return [answer for answer in answers if answer is not None]


def _assert_limited(responses: list[httpx.Response], refused_codes: set[int]) -> Counter[int]:
    """Every answer is a refusal or 429 with a Retry-After of whole seconds; each comes; return the codes."""
    codes = Counter(response.status_code for response in responses)
    assert set(codes) == {*refused_codes, 429}, codes
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"] == "rate_limited"
    return codes


def _assert_bounded_rows(flooded: Flooded) -> None:
    """A refusal's metric line (its reason's count and the total) comes at the 1st, 2nd, 4th, ... of its reason."""
    lines = sum(math.floor(math.log2(count)) + 1 for count in flooded.refused().values())
    assert len(flooded.refusal_rows()) == 2 * lines


async def _status_answers(flooded: Flooded) -> None:
    """The status endpoint answers 200 from the flooding address and from another one, with a token and without."""
    auth = {"authorization": f"Bearer {flooded.tokens[0]}"}
    async with httpx.AsyncClient(base_url=flooded.url) as same:
        assert (await same.get("/v1/status", headers=auth)).json()["state"] == "running"
        assert (await same.get("/v1/status")).status_code == 200
    if _can_bind(_OTHER_ADDRESS):
        transport = httpx.AsyncHTTPTransport(local_address=_OTHER_ADDRESS)
        async with httpx.AsyncClient(transport=transport, base_url=flooded.url) as other:
            assert (await other.get("/v1/status", headers=auth)).json()["state"] == "running"
            assert (await other.get("/v1/hello", headers=auth)).status_code == 200  # only the flooder is limited


@pytest.mark.slow
async def test_an_unauthenticated_flood_is_answered_limited_and_counted(flooded: Flooded) -> None:
    """Requests without a valid token from one address, 16 at a time: each is answered, 401 until the address's
    budget is spent, then 429 with Retry-After; the transport counts each; the status endpoint answers during the
    flood and after it; the store gets a few rows per reason."""
    requests = [
        ("GET", "/v1/task?wait_s=0", {}, None) if i % 2 else ("GET", "/v1/hello", {"authorization": "Bearer x"}, None)
        for i in range(_REQUESTS)
    ]
    flood = asyncio.create_task(_flood(flooded.url, requests))
    await _status_answers(flooded)
    responses = await flood
    codes = _assert_limited(responses, {401})
    assert responses[0].status_code == 401
    refused = flooded.refused()
    assert refused == {"unauthorized": codes[401], "rate_limited": codes[429]}
    await _status_answers(flooded)
    _assert_bounded_rows(flooded)
    assert len(flooded.refusal_rows()) < _REQUESTS / 8


@pytest.mark.slow
async def test_a_flood_of_refused_requests_with_a_token_is_answered_limited_and_counted(flooded: Flooded) -> None:
    """A valid token's updates (16 KiB bodies) for tasks that are not its client's and requests for malformed model
    versions, from one address: each is answered, 403 or 400 until the address's budget is spent, then 429 with
    Retry-After; each is counted by its reason; the status endpoint still answers."""
    auth = {"authorization": f"Bearer {flooded.tokens[1]}"}
    upload = {**auth, REPORT_HEADER: '{"num_samples": 1, "train_loss": 0}'}
    body = b"\0" * 16384
    requests = [
        ("POST", f"/v1/tasks/{10**9 + i}/update", upload, body) if i % 2 else ("GET", f"/v1/models/v{i}", auth, None)
        for i in range(_REQUESTS)
    ]
    flood = asyncio.create_task(_flood(flooded.url, requests))
    await _status_answers(flooded)
    responses = await flood
    codes = _assert_limited(responses, {400, 403})
    assert flooded.refused() == {"bad_request": codes[400], "not_your_task": codes[403], "rate_limited": codes[429]}
    await _status_answers(flooded)
    _assert_bounded_rows(flooded)


@pytest.mark.slow
async def test_flasync_serve_prints_a_floods_refusals_when_stopped(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A `flasync serve` process flooded from one address, then stopped by SIGINT: its summary's refusals (before:
    not printed for a stopped run) are the answers the flood got, and the store holds a few rows per reason."""
    store = tmp_path / "mlflow.db"
    config = write_remote_config(
        tmp_path / "served.yaml", tmp_path / "tokens.txt", tracking={"uri": f"sqlite:///{store}"}
    )
    port = free_port()
    command = [sys.executable, "-m", "flasync", "serve", str(config), "--port", str(port), "--no-system-metrics"]
    server = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path, env=dict(os.environ)
    )
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url) as http:
            for _ in range(600):
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/v1/status")).json()["state"] == "running":
                        break
                await asyncio.sleep(0.1)
            # A device online: the server waits for messages, where it sees the stop (with none online it waits for
            # one to come and misses the first SIGINT).
            assert (await http.get("/v1/hello", headers={"authorization": f"Bearer {tokens[0]}"})).status_code == 200
        requests = [("GET", "/v1/task?wait_s=0", {}, None)] * _REQUESTS
        codes = _assert_limited(await _flood(url, requests), {401})
        server.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(server.communicate(), 60)
    finally:
        if server.returncode is None:
            server.kill()
            await server.wait()
    assert server.returncode == 130, err.decode()[-2000:]
    line = re.search(r"requests refused: (.*)", out.decode())
    assert line is not None, out.decode()
    assert line.group(1) == f"rate_limited {codes[429]}, unauthorized {codes[401]}"
