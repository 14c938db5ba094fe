"""A FastAPI service with its own routes that is also the federated-learning server of remote devices.

    python examples/fastapi_service.py TOKENS_FILE [--port 8080]
    python -m flasync client --server http://127.0.0.1:8080/fl --token-file MY_TOKEN    # on each device

flasync's application is mounted under ``/fl``; the federation runs in the service's own event loop, started by
its lifespan, and the service's routes (``/health``, ``/progress``) keep answering while it trains: flasync never
blocks the loop. ``build_app`` is what a test drives over HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI

import flasync
import flasync.runtime.serve


def federation_config(tokens_file: str, **overrides: Any) -> dict[str, Any]:
    """Return the run: FedBuff on digits, five devices, served on the wall clock."""
    config: dict[str, Any] = {
        "clock": "wall",
        "partition": {"kind": "iid"},
        "model": {"kind": "mlp", "hidden": [32]},
        "population": {"num_clients": 5},
        "client": {"epochs": 2},
        "server": {"kind": "fedbuff", "buffer_size": 3, "concurrency": 5},
        "stop": {"max_versions": 30},
        "resilience": {"task_timeout_s": 30.0},
        "remote": {"enabled": True, "tokens_file": tokens_file},
        "tracking": {"experiment": "fastapi-service"},
    }
    config.update(overrides)
    return config


def build_app(config: Mapping[str, Any]) -> tuple[FastAPI, flasync.Federation]:
    """Return the service and its federation (started and stopped by the service's lifespan)."""
    federation = flasync.Federation(config)
    runs: list[asyncio.Task[flasync.RunSummary]] = []

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runs.append(asyncio.create_task(federation.run()))
        try:
            yield
        finally:
            if not runs[0].done():
                federation.request_stop("service shutting down")
            with contextlib.suppress(flasync.RunInterrupted):
                await runs[0]

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/progress")
    async def progress() -> dict[str, Any]:
        server = federation.server
        if runs and runs[0].done() and not runs[0].cancelled() and runs[0].exception() is None:
            summary = runs[0].result()
            return {"state": "finished", "version": summary.versions, "accuracy": summary.accuracy}
        if server is None:
            return {"state": "starting"}
        return {"state": "running", "version": int(server.version), "accuracy": server.stats.accuracy}

    app.mount("/fl", flasync.runtime.serve.asgi_app(federation))
    return app, federation


def main() -> None:
    """Serve the example under uvicorn."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokens_file", help="lines 'CLIENT_ID TOKEN' for client ids 0..4")
    parser.add_argument("--port", type=int, default=8080)
    args = parser.parse_args()
    app, _ = build_app(federation_config(args.tokens_file))
    uvicorn.run(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
