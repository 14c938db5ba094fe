"""Run a federation inside an existing async service, in real time, while the service keeps working.

    python examples/embed.py

The "service" here is a heartbeat task standing in for a web server; it keeps ticking throughout because flasync
never blocks the event loop (training, evaluation and MLflow calls run in worker threads). A second task watches
the run through the event bus, as a dashboard or a websocket handler would.
"""

from __future__ import annotations

import asyncio
import time

import flasync
from flasync.core.bus import OverflowPolicy
from flasync.core.events import Evaluated, RunFinished


async def heartbeat(stop: asyncio.Event) -> int:
    """Tick every 50 ms until stopped; return the worst gap between ticks in milliseconds."""
    worst, last = 0.0, time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.05)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    return round(1000 * worst)


async def watch(federation: flasync.Federation) -> None:
    """Print progress from the bus (drop-oldest: a slow watcher never slows the run)."""
    with federation.bus.subscribe(Evaluated, RunFinished, policy=OverflowPolicy.DROP_OLDEST) as events:
        async for event in events:
            if isinstance(event, Evaluated):
                print(f"  version {event.version:>3}  accuracy {event.accuracy:.3f}  wall {event.wall_s:.1f}s")
            else:
                print(f"  finished: {event.reason}")


async def main() -> None:
    """Serve, run a federation in real time beside it, and report how responsive the loop stayed."""
    config = flasync.load_config(
        None, ["clock=wall", "stop.max_versions=40", "eval.every_versions=10", "tracking.enabled=false"]
    )
    federation = flasync.Federation(config)
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        beat = tg.create_task(heartbeat(stop))
        tg.create_task(watch(federation))
        summary = await federation.run()
        stop.set()
    print(f"accuracy {summary.accuracy:.3f} after {summary.updates_accepted} updates in {summary.wall_s:.1f}s")
    print(f"worst heartbeat gap while training: {beat.result()} ms (the service kept serving)")


if __name__ == "__main__":
    asyncio.run(main())
