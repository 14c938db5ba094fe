"""A remote run end to end in one process: the ASGI app driven by flasync.remote clients over httpx's ASGI transport."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from flasync.remote import Client
from flasync.runtime import Federation
from flasync.serve import asgi_app
from tests.remote.conftest import remote_config

pytestmark = pytest.mark.timeout(120)


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


async def test_a_client_that_leaves_is_timed_out(tmp_path: Path, tokens: dict[int, str]) -> None:
    """A client that stops asking for tasks has its next task timed out by the registry; the run finishes."""
    config = remote_config(tmp_path / "tokens.txt", resilience={"task_timeout_s": 1.0}, stop={"max_versions": 30})
    federation = Federation(config)
    app = asgi_app(federation)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=60.0) as http:
        run = asyncio.create_task(federation.run())
        clients = [Client("http://fl", token, http=http, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
        leaving = clients[-1].run(max_tasks=1)
        results = await asyncio.gather(leaving, *(client.run() for client in clients[:-1]))
        summary = await run
    assert summary.stop_reason == "max_versions"
    assert results[0].uploads == 1
    assert summary.tasks_timed_out >= 1
