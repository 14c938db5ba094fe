"""Runs in a new event loop: what exists before a run (``flasync.run``), or what survives its first full collection
(``frozen_heap`` on its own), is kept out of its later collections."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest

import flasync
from flasync.core.loops import (
    YOUNG_COLLECTION_THRESHOLD,
    collections_held,
    frozen_heap,
    run_loop,
    spaced_young_collections,
)
from flasync.observe.summary import weights_sha256

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


@pytest.mark.slow
def test_frozen_heap_freezes_what_survives_the_first_full_collection_and_gives_it_back() -> None:
    garbage = _Node()
    garbage_ref = weakref.ref(garbage)
    del garbage
    alive = _Node()
    alive_ref = weakref.ref(alive)
    with frozen_heap():
        assert gc.get_freeze_count() == 0  # nothing before a full collection
        gc.collect()
        assert gc.get_freeze_count() > 0
        assert garbage_ref() is None  # the collection freed it: garbage is never frozen
        del alive  # alive when frozen: not collected while the block lasts
        new = _Node()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # garbage made after the freeze is collected as usual
        assert alive_ref() is not None
    assert gc.get_freeze_count() == 0
    assert not any("after_full_collection" in repr(callback) for callback in gc.callbacks)
    gc.collect()
    assert alive_ref() is None  # and the rest once the block has ended: nothing leaks


@pytest.mark.slow
def test_frozen_heap_at_start_freezes_at_once_and_collects_the_blocks_garbage_at_its_end() -> None:
    """at_start: the heap is frozen when the block starts, without a full collection (young garbage is collected
    first); a full collection inside walks only what the block allocated; the block's end frees its garbage and
    gives the heap back."""
    old = _Node()
    old_ref = weakref.ref(old)
    gc.collect()  # old is in the oldest generation now, like the objects of a process's imports
    young_garbage = _Node()
    young_ref = weakref.ref(young_garbage)
    del young_garbage
    full = gc.get_stats()[2]["collections"]
    with frozen_heap(at_start=True):
        assert gc.get_freeze_count() > 0
        assert gc.get_stats()[2]["collections"] == full  # no full collection to get there
        assert young_ref() is None  # the young generations' garbage was collected, not frozen
        del old  # frozen: kept while the block lasts
        gc.collect()
        assert old_ref() is not None
        inside = _Node()
        inside_ref = weakref.ref(inside)
        del inside  # garbage made inside, not collected yet
        gc.disable()  # no automatic collection from here to the block's end
    try:
        assert inside_ref() is None  # freed by the block's end
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
    gc.collect()
    assert old_ref() is None  # given back, and collected as usual


def test_frozen_heap_at_start_does_nothing_where_the_collector_is_off() -> None:
    gc.disable()
    try:
        with frozen_heap(at_start=True):
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_frozen_heap_leaves_a_heap_frozen_by_someone_else_frozen() -> None:
    """What the process froze itself stays frozen (an unfreeze would leave none) and nothing more is frozen. Frozen
    objects freed meanwhile, by another test's thread say, leave the frozen heap: the count may only fall a little."""
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with frozen_heap(), frozen_heap():
            gc.collect()
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_collections_held_turns_the_collector_off_for_the_block_and_back_on_after_it() -> None:
    """The collector is off inside the block and on again after it, also when the block raises."""
    with collections_held():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), collections_held():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_collections_held_leaves_a_collector_turned_off_by_someone_else_off() -> None:
    """A process that turned the collector off keeps it off after the block."""
    gc.disable()
    try:
        with collections_held():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.fixture
def default_thresholds() -> Iterator[tuple[int, int, int]]:
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        yield gc.get_threshold()
    finally:
        gc.set_threshold(*saved)


def test_spaced_young_collections_raise_the_youngest_threshold_for_the_block_only(
    default_thresholds: tuple[int, int, int],
) -> None:
    """Inside the block the youngest generation waits for 20,000 allocations, the older ones keep theirs; the block's
    end, raising or not, gives the thresholds back."""
    with spaced_young_collections():
        assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, 10, 10)
    assert gc.get_threshold() == default_thresholds
    seen: list[tuple[int, int, int]] = []

    def fail() -> None:
        with spaced_young_collections(5_000):
            seen.append(gc.get_threshold())
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail()
    assert seen == [(5_000, 10, 10)]
    assert gc.get_threshold() == default_thresholds


def test_spaced_young_collections_leave_what_they_should_not_touch(default_thresholds: tuple[int, int, int]) -> None:
    """A collector that is off, a threshold already as high (or 0, never collecting) and a threshold other code sets
    in the block are left as they are; a threshold that is not positive is refused."""
    gc.disable()
    try:
        with spaced_young_collections():
            assert gc.get_threshold() == default_thresholds
    finally:
        gc.enable()
    for young in (50_000, 0):
        gc.set_threshold(young, 10, 10)
        with spaced_young_collections():
            assert gc.get_threshold() == (young, 10, 10)
        assert gc.get_threshold() == (young, 10, 10)
    gc.set_threshold(700, 10, 10)
    with spaced_young_collections():
        gc.set_threshold(1_234, 10, 10)
    assert gc.get_threshold() == (1_234, 10, 10)
    with pytest.raises(ValueError, match="threshold must be > 0, got 0"), spaced_young_collections(0):
        pass


def test_run_loop_spaces_young_collections_while_it_runs(default_thresholds: tuple[int, int, int]) -> None:
    async def threshold() -> tuple[int, int, int]:
        return gc.get_threshold()

    assert run_loop(threshold()) == (YOUNG_COLLECTION_THRESHOLD, 10, 10)
    assert gc.get_threshold() == default_thresholds


def _collect_then_fail() -> None:
    with frozen_heap():
        gc.collect()
        assert gc.get_freeze_count() > 0
        raise RuntimeError("boom")


@pytest.mark.slow
def test_frozen_heap_gives_the_heap_back_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        _collect_then_fail()
    assert gc.get_freeze_count() == 0


def test_a_full_collection_on_another_thread_that_ends_after_the_block_freezes_nothing() -> None:
    """The callback a collection on another thread took while the block was open, run after it closed (its thread
    held up meanwhile), freezes nothing: the heap is not left frozen for good."""
    before = list(gc.callbacks)
    with frozen_heap():
        (late,) = [callback for callback in gc.callbacks if callback not in before]
    thread = threading.Thread(target=late, args=("stop", {"generation": 2, "collected": 0, "uncollectable": 0}))
    thread.start()
    thread.join()
    assert gc.get_freeze_count() == 0
    assert late not in gc.callbacks


@pytest.mark.slow
def test_run_loop_returns_the_coroutine_result_inside_frozen_heap() -> None:
    async def count() -> int:
        await asyncio.sleep(0)
        gc.collect()
        return gc.get_freeze_count()

    assert run_loop(count()) > 0
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_a_loop_its_process_ends_with_freezes_the_heap_at_once_and_for_good() -> None:
    """The command line's loop: what exists at the start is frozen before the coroutine runs, without a collection,
    and stays frozen; a loop the process outlives freezes nothing before a full collection."""
    gc.collect()  # no automatic full collection is due for a while: neither loop below makes one
    before = len(gc.get_objects())

    async def frozen() -> int:
        return gc.get_freeze_count()

    assert run_loop(frozen()) == 0
    assert run_loop(frozen(), process_ends=True) >= before
    assert gc.get_freeze_count() >= before  # for good (the fixture gives it back for the next tests)


@pytest.mark.slow
def test_flasync_run_freezes_after_a_full_collection_and_trains_the_same_weights() -> None:
    seen: list[int] = []

    def wall() -> float:
        if not seen:
            gc.collect()  # a full collection early in the run
        seen.append(gc.get_freeze_count())
        return time.perf_counter()

    summary = flasync.run(SMALL, wall=wall)
    assert seen[-1] > 0  # frozen after it, to the run's end
    assert gc.get_freeze_count() == 0
    federation = flasync.Federation(SMALL)
    embedded = asyncio.run(federation.run())  # a caller's own loop: nothing frozen, the same weights
    assert federation.weights is not None
    assert embedded.weights_sha256 == summary.weights_sha256 == weights_sha256(federation.weights)


@pytest.mark.slow
def test_flasync_run_freezes_at_its_start_without_a_full_collection() -> None:
    """flasync.run builds its federation inside the loop and freezes the heap at once: a run walks none of what
    existed before it, and the heap is given back when it returns."""
    seen: list[int] = []

    def wall() -> float:
        seen.append(gc.get_freeze_count())
        return time.perf_counter()

    frozen_at_full: list[int] = []

    def full_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            frozen_at_full.append(gc.get_freeze_count())

    gc.callbacks.append(full_collection)
    try:
        flasync.run(SMALL, wall=wall)
    finally:
        gc.callbacks.remove(full_collection)
    assert seen and min(seen) > 0
    assert frozen_at_full and min(frozen_at_full) > 0  # the block's end's among them: none walked the old heap
    assert gc.get_freeze_count() == 0


@pytest.mark.slow
def test_runs_one_after_another_without_collections_between_them_keep_a_flat_heap() -> None:
    """A sweep of runs with nothing collecting between them: each run's garbage is freed at its end, none is frozen
    by the next one."""
    counts = []
    for _ in range(5):
        flasync.run(SMALL)
        counts.append(len(gc.get_objects()))
    assert counts[-1] - counts[1] < 100, counts


@pytest.mark.slow
def test_runs_one_after_another_in_one_process_keep_no_earlier_run_alive() -> None:
    """Every run's garbage is collectable after it: the live objects stay flat over runs, collections or not."""

    def collecting_wall() -> float:
        gc.collect()
        return time.perf_counter()

    counts = []
    for _ in range(4):
        flasync.run(SMALL, wall=collecting_wall)  # full collections (so freezes) inside every run
        counts.append(len(gc.get_objects()))  # no collection between runs: a sweep's runs follow each other
    assert counts[-1] - counts[1] < 100, counts
