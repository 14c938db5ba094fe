"""What a remote client says while it waits for its server: one line when the wait starts, not one per try."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from flasync.clients.remote.client import Client, RemoteError
from flasync.runtime.federation import Federation
from flasync.runtime.serve import asgi_app
from tests.conftest import ROOT, free_port, remote_config

pytestmark = pytest.mark.timeout(120)


class Flaky(httpx.AsyncBaseTransport):
    """Refuse the connection on the requests whose 0-based numbers are in ``refused``; pass the others on."""

    def __init__(self, inner: httpx.AsyncBaseTransport, refused: set[int]) -> None:
        self.inner = inner
        self.refused = refused
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        number, self.requests = self.requests, self.requests + 1
        if number in self.refused:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return await self.inner.handle_async_request(request)


WAITING = (
    r"waiting for http://fl: cannot reach it \(ConnectError: \[Errno 111\] Connection refused\); "
    r"next try in \d+\.\d s"
)


@pytest.mark.slow
async def test_a_client_says_when_it_waits_connects_and_gets_through_again(
    tmp_path: Path, tokens: dict[int, str]
) -> None:
    """Refused at first and again mid-run, a client says once that it waits (why, and when it tries next), once
    that it connected, once that it waits again and once that it got through: four lines for seven refusals."""
    config = remote_config(tmp_path / "tokens.txt", stop={"max_versions": 6})
    config["server"] = {"kind": "fedbuff", "buffer_size": 2, "concurrency": 5}
    federation = Federation(config)
    app = asgi_app(federation)
    flaky = Flaky(httpx.ASGITransport(app=app), refused={0, 1, 2, 8, 9, 10, 11})
    lines: list[str] = []
    first, second = list(tokens.values())[:2]
    async with (
        httpx.AsyncClient(transport=flaky, timeout=60.0) as flaky_http,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http,
    ):
        run = asyncio.create_task(federation.run())
        # Until the run serves, requests are answered 503 (a retry and a line besides the refusals counted here).
        hello = {"authorization": f"Bearer {second}"}
        for _ in range(1000):
            if (await http.get("http://fl/v1/hello", headers=hello)).status_code != 503:
                break
            await asyncio.sleep(0.01)
        waiter = Client("http://fl", first, http=flaky_http, poll_s=2.0, backoff_s=0.01, on_status=lines.append)
        other = Client("http://fl", second, http=http, poll_s=2.0, backoff_s=0.01)
        stats, _ = await asyncio.gather(waiter.run(), other.run())
        await run
    # The seven refusals; a poll that meets the run ending (a 503 while the server finishes) waits once more.
    ending = len(lines) == 6 and "it answers 503" in lines[4] and lines[5].startswith("got through")
    assert stats.retries == 7 + ending and stats.finished == "finished"
    assert len(lines) == 4 or ending, lines
    assert re.fullmatch(WAITING, lines[0]), lines[0]
    assert lines[1] == f"connected to http://fl as client {stats.client_id}"
    assert re.fullmatch(WAITING, lines[2]), lines[2]
    assert re.fullmatch(r"got through to http://fl again after \d+\.\d s", lines[3]), lines[3]


async def test_a_long_wait_is_said_again_every_so_often_not_per_try() -> None:
    """While the server stays unreachable the client says so again at most every ``status_every_s`` (with the time
    and tries so far), then gives up with RemoteError."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    clock = itertools.count(0.0, 1.0)  # each reading of the wall clock is one second later
    lines: list[str] = []
    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as http:
        client = Client(
            "http://fl",
            "token",
            http=http,
            backoff_s=0.001,
            max_backoff_s=0.001,
            give_up_s=100.0,
            wall=lambda: next(clock),
            on_status=lines.append,
            status_every_s=20.0,
        )
        with pytest.raises(RemoteError, match="unreachable for 100 s"):
            await client.run()
    assert client.stats.retries >= 40
    assert 3 <= len(lines) <= 1 + 100 / 20, lines
    assert re.fullmatch(WAITING, lines[0]), lines[0]
    for line in lines[1:]:
        assert re.fullmatch(
            r"still waiting for http://fl after \d+ s and \d+ tries: cannot reach it \(ConnectError: .+\); "
            r"next try in \d+\.\d s",
            line,
        ), line


@pytest.mark.slow
def test_flasync_client_prints_one_waiting_line_then_the_error(tmp_path: Path) -> None:
    """`flasync client` for a port nobody listens on prints one waiting line on stderr, then gives up: exit 2."""
    port = free_port()
    (tmp_path / "token").write_text("abc\n")
    root = str(ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = ["flasync", "client", "--server", f"http://127.0.0.1:{port}", "--token-file", str(tmp_path / "token")]
    done = subprocess.run(
        [sys.executable, "-m", *command, "--give-up-s", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, done.stderr
    assert re.fullmatch(
        rf"flasync client: waiting for http://127\.0\.0\.1:{port}: cannot reach it \(ConnectError: .+\); "
        r"next try in \d+\.\d s",
        lines[0],
    ), lines[0]
    assert lines[1].startswith(f"flasync: error: http://127.0.0.1:{port} unreachable for 2 s")
