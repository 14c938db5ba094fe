"""examples/fastapi_service.py: a FastAPI service mounting flasync, driven over real HTTP by five remote clients."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import uvicorn

from flasync.clients.remote.client import Client
from tests.conftest import EXAMPLES, free_port

pytestmark = pytest.mark.timeout(120)

_EXAMPLE = EXAMPLES / "fastapi_service.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fastapi_service", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
async def test_the_service_trains_and_keeps_answering(tmp_path: Path, tokens: dict[int, str]) -> None:
    """The service's own routes answer while remote clients train through /fl; the run reaches 0.85."""
    example = _load()
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = example.federation_config(
        str(tmp_path / "tokens.txt"), tracking={"uri": store, "experiment": "fastapi", "log_model": False}
    )
    app, _federation = example.build_app(config)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1000):
            if server.started:
                break
            await asyncio.sleep(0.02)
        clients = [Client(f"{base}/fl", token, poll_s=2.0, backoff_s=0.05) for token in tokens.values()]
        training = asyncio.gather(*(client.run() for client in clients))
        worst = 0.0
        async with httpx.AsyncClient(base_url=base) as http:
            while not training.done():
                start = time.monotonic()
                assert (await http.get("/health")).json() == {"status": "ok"}
                worst = max(worst, time.monotonic() - start)
                await asyncio.sleep(0.05)
            results = await training
            for _ in range(100):
                progress = (await http.get("/progress")).json()
                if progress["state"] == "finished":
                    break
                await asyncio.sleep(0.1)
    finally:
        server.should_exit = True
        await serving
    assert progress["state"] == "finished"
    assert progress["version"] == 30
    assert progress["accuracy"] >= 0.85
    assert sum(r.uploads for r in results) >= 90
    assert worst < 1.0  # the service's route answers while the run trains in the same loop
