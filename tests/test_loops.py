"""Runs in a new event loop: the heap frozen out of the garbage collector for the run, and given back."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator

import pytest

import flasync
from flasync.loops import frozen_heap, run_loop
from flasync.summary import weights_sha256

SMALL = {
    "population": {"num_clients": 8},
    "server": {"kind": "fedavg", "clients_per_round": 4},
    "stop": {"max_versions": 2},
    "data": {"kind": "synthetic", "samples_per_client": 40, "num_features": 8, "test_samples": 40},
    "model": {"kind": "mlp", "hidden": [8]},
    "tracking": {"enabled": False, "log_level": "warning"},
}


@pytest.fixture(autouse=True)
def _nothing_frozen() -> Iterator[None]:
    assert gc.get_freeze_count() == 0, "a test before this one left objects frozen"
    yield
    gc.unfreeze()


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_frozen_heap_freezes_what_exists_and_gives_it_back() -> None:
    old = _Node()
    old_ref = weakref.ref(old)
    del old  # garbage before the block: kept out of the collector's passes while it lasts
    with frozen_heap() as froze:
        assert froze
        assert gc.get_freeze_count() > 0
        new = _Node()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # garbage made inside the block is collected as usual
        assert old_ref() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # and the rest once the block has ended: nothing leaks


def test_frozen_heap_leaves_a_heap_frozen_by_someone_else_frozen() -> None:
    gc.freeze()
    frozen = gc.get_freeze_count()
    with frozen_heap() as froze:
        assert not froze
        with frozen_heap() as nested:
            assert not nested
    assert gc.get_freeze_count() == frozen  # what the process froze itself stays frozen


def test_frozen_heap_gives_the_heap_back_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_run_loop_returns_the_coroutine_result_with_the_heap_frozen_meanwhile() -> None:
    async def count() -> int:
        await asyncio.sleep(0)
        return gc.get_freeze_count()

    assert run_loop(count()) > 0
    assert gc.get_freeze_count() == 0


def test_flasync_run_freezes_during_the_run_only_and_trains_the_same_weights() -> None:
    seen: list[int] = []

    def wall() -> float:
        seen.append(gc.get_freeze_count())
        return time.perf_counter()

    summary = flasync.run(SMALL, wall=wall)
    assert seen and min(seen) > 0  # every wall reading of the run saw the heap frozen
    assert gc.get_freeze_count() == 0
    federation = flasync.Federation(SMALL)
    embedded = asyncio.run(federation.run())  # a caller's own loop: nothing frozen, the same weights
    assert federation.weights is not None
    assert embedded.weights_sha256 == summary.weights_sha256 == weights_sha256(federation.weights)
