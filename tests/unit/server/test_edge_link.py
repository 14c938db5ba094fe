"""An edge's link to its parent: models arrive after their transfer time, sends are held on the link until then."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any

import pytest

from flasync.config import EdgeLinkConfig
from flasync.core.bus import EventBus
from flasync.core.clock import VirtualClock
from flasync.core.events import CLOUD, EdgeForwarded, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.server import EdgeLink

pytestmark = pytest.mark.timeout(30)


class _Spawner:
    """A registry stand-in: background tasks go to one task group."""

    def __init__(self, tg: asyncio.TaskGroup) -> None:
        self.tg = tg

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self.tg.create_task(coro, name=name)


def _snapshot(version: int, download_bytes: int) -> ModelSnapshot:
    import torch

    weights = torch.zeros(2)
    return ModelSnapshot(version=Version(version), weights=weights, exact=weights, download_bytes=download_bytes)


def _partial(payload: bytes) -> EdgeForwarded:
    return EdgeForwarded(
        to=CLOUD,
        edge="e0",
        tier="edge1",
        count=1,
        num_samples=1,
        example_weight=1.0,
        base_version=Version(0),
        payload=payload,
        simulated_s=0.0,
        sent_wall_s=0.0,
    )


async def _with_link(link_config: EdgeLinkConfig, body: Any) -> None:
    """Run ``body(link, clock, bus)`` with a link over ``link_config`` on a driven virtual clock."""
    clock = VirtualClock()
    bus = EventBus(on_activity=clock.poke)
    installed: list[tuple[int, float]] = []
    async with asyncio.TaskGroup() as tg:
        tg.create_task(clock.drive())
        try:
            network = SimpleNamespace(
                settings=SimpleNamespace(link=link_config), clock=clock, bus=bus, registry=_Spawner(tg)
            )
            link = EdgeLink("e0", network, lambda s: installed.append((int(s.version), clock.now())))  # type: ignore[arg-type]
            await body(link, clock, bus, installed)
        finally:
            clock.stop()


async def test_a_link_that_takes_no_time_installs_at_once() -> None:
    """With no latency and unbounded bandwidth a model is installed on the spot and nothing is on the way."""

    async def body(link: EdgeLink, clock: VirtualClock, bus: EventBus, installed: list[tuple[int, float]]) -> None:
        link.download(_snapshot(3, 1000))
        assert installed == [(3, 0.0)] and link.installs == {}

    await _with_link(
        EdgeLinkConfig(latency_s=0.0, upload_bytes_per_s=float("inf"), download_bytes_per_s=float("inf")), body
    )


async def test_a_model_arrives_after_latency_and_transfer() -> None:
    """A model of 100 bytes over 1 s latency and 50 B/s is on the way (with its arrival time) until t = 3."""

    async def body(link: EdgeLink, clock: VirtualClock, bus: EventBus, installed: list[tuple[int, float]]) -> None:
        link.download(_snapshot(1, 100))
        assert installed == [] and [(int(s.version), at) for s, at in link.installs.values()] == [(1, 3.0)]
        await clock.sleep(5.0)
        assert installed == [(1, 3.0)] and link.installs == {}

    await _with_link(EdgeLinkConfig(latency_s=1.0, upload_bytes_per_s=10.0, download_bytes_per_s=50.0), body)


async def test_a_send_is_held_on_the_link_until_it_arrives() -> None:
    """A 20-byte partial over 1 s latency and 10 B/s is published to the parent at t = 3, held on the link until."""

    async def body(link: EdgeLink, clock: VirtualClock, bus: EventBus, installed: list[tuple[int, float]]) -> None:
        inbox = bus.subscribe(EdgeForwarded, address=CLOUD)
        sending = asyncio.create_task(link.send(_partial(bytes(20)), loop=True))
        await clock.sleep(1.0)
        assert [(at, loop) for _, at, loop in link.sends.values()] == [(3.0, True)]
        message = await inbox.receive()
        assert clock.now() == 3.0 and len(message.payload) == 20 and link.sends == {}
        await sending

    await _with_link(EdgeLinkConfig(latency_s=1.0, upload_bytes_per_s=10.0, download_bytes_per_s=10.0), body)
