"""``flasync serve``'s heap settling: the served run's objects are frozen once its first model is published, and
full collections made rarer."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from flasync.cli.serve import FULL_COLLECTION_EVERY, settle_heap
from flasync.core.bus import EventBus
from flasync.core.events import ModelPublished, Version

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Start with nothing frozen and give back whatever a test froze."""
    if gc.get_freeze_count():
        pytest.skip("this process froze its heap already")
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.slow
async def test_the_heap_is_frozen_once_the_first_model_is_published(unfrozen: None) -> None:
    """Nothing is frozen while the run starts; the first ModelPublished freezes what is alive, an object of the run's
    included, and sets the full collections' threshold."""
    bus = EventBus()
    settling = asyncio.create_task(settle_heap(bus))
    built = [object()]  # tracked by the collector, alive until the test ends
    for _ in range(3):
        await asyncio.sleep(0)
    assert gc.get_freeze_count() == 0 and not settling.done()
    assert gc.get_threshold()[2] != FULL_COLLECTION_EVERY
    await bus.publish(ModelPublished(version=Version(0), simulated_s=0.0, download_bytes=4))
    await asyncio.wait_for(settling, 10)
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[2] == FULL_COLLECTION_EVERY
    assert not any(o is built for o in gc.get_objects())  # frozen: out of the collected generations
    bus.close()


async def test_a_run_that_publishes_no_model_freezes_nothing(unfrozen: None) -> None:
    """A bus closed before any model was published ends the settling without freezing anything."""
    bus = EventBus()
    settling = asyncio.create_task(settle_heap(bus))
    await asyncio.sleep(0)
    bus.close()
    await asyncio.wait_for(settling, 10)
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold()[2] != FULL_COLLECTION_EVERY
