"""Client-side evaluation by remote clients: reports travel with the updates over HTTP to a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest

from flasync.clients.remote.client import Client
from flasync.config import validate
from flasync.core import seeding
from flasync.core.events import ClientEvaluated, TaskAssigned
from flasync.data import prepare
from flasync.runtime.federation import Federation
from flasync.runtime.serve import serve
from flasync.testing import EventRecorder, MemoryTracker
from tests.conftest import remote_config

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


async def test_remote_clients_report_their_evaluations_over_http(tmp_path: Path, tokens: dict[int, str]) -> None:
    """Devices evaluate the downloaded model on the held-out share a simulation gives them and send the report with
    their update: the server counts each towards the task's version and logs the client_eval figures."""
    config = remote_config(
        tmp_path / "tokens.txt",
        stop={"max_versions": 8},
        eval={"metrics": ["f1"], "clients": {"fraction": 0.5, "min_reports": 2}},
    )
    tracker = MemoryTracker()
    federation = Federation(config, tracker=tracker)
    recorder = EventRecorder(federation.bus)
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(serve(federation, port=0, on_ready=port.set_result, linger_s=3.0))
    url = f"http://127.0.0.1:{await port}"
    async with httpx.AsyncClient(timeout=60.0) as http:
        clients = [Client(url, token, http=http, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
        await asyncio.gather(*(client.run() for client in clients))
    summary = await server
    reports = recorder.of(ClientEvaluated)
    assert reports and summary.versions == 8
    base = {task.task_id: task.base_version for task in recorder.of(TaskAssigned)}
    assert all(report.version == base[report.task_id] for report in reports)
    resolved = validate(config)
    loaded = prepare.load(resolved)
    _, held = prepare.partition(resolved, loaded.train).hold_out(
        0.2, seeding.numpy_stream(resolved.seed, seeding.CLIENT_EVAL)
    )
    assert all(report.num_samples == len(held[int(report.client_id)]) for report in reports)
    assert all(0.0 <= report.metrics["f1"] <= 1.0 and report.when == "before" for report in reports)
    counted = tracker.history("client_eval/version/reports")
    assert counted and sum(n for _, n in counted) <= len(reports)
    assert tracker.history("client_eval/f1/mean") and tracker.history("client_eval/accuracy/worst10")
    assert np.isfinite([v for _, v in tracker.history("client_eval/accuracy/mean")]).all()
