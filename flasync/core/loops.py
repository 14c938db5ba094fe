"""Running a coroutine in a new event loop that owns its thread, as ``flasync.run`` and the command line do.

A process that imported torch holds about 170,000 objects that the cyclic garbage collector tracks (300,000 with
MLflow); a full collection walks all of them, 60-120 ms on one core. A run allocates enough (a coroutine, a task,
futures and events per client task) that CPython makes a full collection every second or two of a run, each of
them walking torch's objects again. :func:`frozen_heap` lets the run's first full collection happen as usual, then
moves what survived it into the collector's permanent generation (:func:`gc.freeze`), so the run's later full
collections walk only what the run allocated since; the block's end gives it back (:func:`gc.unfreeze`). Nothing
leaks: what is frozen has just been found alive, and a short run that makes no full collection freezes nothing.
The training of a run and its results do not depend on it.

That first full collection still walks torch's objects once per run: 60-120 ms, a tenth of a short run with
1,000 clients a round. ``flasync.run`` builds its federation inside the loop, so everything the run allocates is
allocated inside the block, and it freezes the heap at the block's start instead (``frozen_heap(at_start=True)``):
no collection during the run walks what existed before it, and at the end a full collection, which walks only what
the run allocated, frees the run's garbage before the heap is given back, so one run after another keeps no earlier
run's garbage (a federation built before the block and dropped after it would be, which is why this is not the
default). The command line, whose process runs one federation and ends, freezes what exists at the run's start at
once and for good (``run_loop(..., process_ends=True)``): its runs make no full collection of torch's objects at all.

Within the run, CPython collects the youngest generation after every 700 net allocations: the loop allocates a few
objects per event, future and task, and such a collection walks every young object still alive (the cohort's
messages and tasks in flight) to free almost nothing, since those objects die by reference counting. :func:`run_loop`
spaces them out to every :data:`YOUNG_COLLECTION_THRESHOLD` allocations (:func:`spaced_young_collections`) for the
run and gives the threshold back after it, so each young object still alive is walked far less often. The older
generations keep their thresholds, which count the collections below them, so garbage in reference cycles waits
longer to be freed.

:class:`flasync.Federation` inside a caller's own event loop does not use them: the loop and the process are the
caller's, who can wrap the run in ``with frozen_heap(), spaced_young_collections():``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

_T = TypeVar("_T")

YOUNG_COLLECTION_THRESHOLD = 20_000
"""Net allocations between two collections of the youngest generation during a run (CPython's default: 700)."""


@contextlib.contextmanager
def frozen_heap(*, at_start: bool = False) -> Iterator[None]:
    """Keep what survives the block's first full garbage collection out of the collector's later passes.

    Nothing happens when objects are frozen already on entry (by the process's own :func:`gc.freeze`, e.g. before a
    fork, or an enclosing block), and nothing is frozen when they are at the collection: it gives back only what
    it froze itself (with anything other code froze during the block after it, which :func:`gc.unfreeze` cannot
    tell apart).

    Args:
        at_start: For a block that builds what it runs (``flasync.run``): freeze every object at the block's start
            (after collecting the young generations' garbage) instead of after its first full collection, and end
            the block with a full collection of what it allocated before giving the heap back. Garbage made before
            the block is kept until it ends; an object built before the block that becomes garbage after it is
            frozen again by the next such block, and so on until a full collection outside one finds it.
    """
    if gc.get_freeze_count() > 0:
        yield
        return
    if at_start:
        if not gc.isenabled():  # a process that turned the collector off collects nothing, here neither
            yield
            return
        gc.collect(1)
        gc.freeze()
        try:
            yield
        finally:
            gc.collect()  # the block's garbage: what it allocated (the frozen heap is not walked)
            gc.unfreeze()
        return
    froze: list[bool] = []
    open_block = [True]
    # A collection on another thread may have called the callback before the block ends and freeze after it: the
    # lock orders the two, and a callback that comes late finds the block closed. (Reentrant: a collection on this
    # thread inside the locked end runs the callback too.)
    lock = threading.RLock()

    def after_full_collection(phase: str, info: dict[str, int]) -> None:
        # The heap was just walked whole: what is left is alive, so freezing it keeps no garbage.
        if phase != "stop" or info["generation"] != 2:
            return
        with lock:
            if open_block and not froze and gc.get_freeze_count() == 0:
                gc.freeze()
                froze.append(True)

    gc.callbacks.append(after_full_collection)
    try:
        yield
    finally:
        with lock:
            open_block.clear()
            gc.callbacks.remove(after_full_collection)
            if froze:
                gc.unfreeze()


@contextlib.contextmanager
def collections_held() -> Iterator[None]:
    """Make no cyclic garbage collection during the block (the collector is off, unless it was off already).

    For imports that build a large heap that stays alive (torch's: about 170,000 objects): the collections their
    allocations set off walk it again and again, a seventh of the CPU torch's import takes, and find almost nothing
    to free. What the block leaves is collected as usual after it (or frozen by :func:`run_loop`).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def spaced_young_collections(threshold: int = YOUNG_COLLECTION_THRESHOLD) -> Iterator[None]:
    """Collect the youngest generation after ``threshold`` net allocations during the block, not more often.

    The older generations keep their thresholds (each counts the collections of the one below it, so they are spaced
    out alike). Nothing changes where the collector is off or its youngest threshold is already at least
    ``threshold`` (or 0), and the block leaves a threshold that other code set during it as that code set it.

    Args:
        threshold: The youngest generation's threshold in the block (> 0).
    """
    if threshold <= 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    young, *older = gc.get_threshold()
    if not gc.isenabled() or young == 0 or young >= threshold:
        yield
        return
    gc.set_threshold(threshold, *older)
    try:
        yield
    finally:
        if gc.get_threshold()[0] == threshold:  # nobody changed it meanwhile
            gc.set_threshold(young, *older)


def run_loop(coro: Coroutine[Any, Any, _T], *, process_ends: bool = False, builds_inside: bool = False) -> _T:
    """Run ``coro`` to its end in a new event loop (uvloop when installed), inside :func:`frozen_heap` and
    :func:`spaced_young_collections`.

    Args:
        coro: What to run.
        process_ends: The process ends once ``coro`` has (the command line's ``run``, ``serve`` and ``client``):
            everything alive at the start (the imports' objects) is frozen at once and for good, so not even the
            run's first full collection walks it, and no earlier run's garbage can be kept.
        builds_inside: ``coro`` builds what it runs (``flasync.run``'s federation): the heap is frozen at the start
            (``frozen_heap(at_start=True)``).
    """
    if process_ends and gc.get_freeze_count() == 0:
        gc.freeze()
    with frozen_heap(at_start=builds_inside), spaced_young_collections():
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
            return asyncio.run(coro)
        result: _T = uvloop.run(coro)
        return result
