"""Running a coroutine in a new event loop that owns its thread, as ``flasync.run`` and the command line do.

A process that imported torch holds about 170,000 objects that the cyclic garbage collector tracks (300,000 with
MLflow); a full collection walks all of them, 60-120 ms on one core. A run allocates enough (a coroutine, a task,
futures and events per client task) that CPython makes a full collection every second or two of a run, each of
them walking torch's objects again. :func:`frozen_heap` lets the run's first full collection happen as usual, then
moves what survived it into the collector's permanent generation (:func:`gc.freeze`), so the run's later full
collections walk only what the run allocated since; the block's end gives it back (:func:`gc.unfreeze`). Nothing
leaks: what is frozen has just been found alive, and a short run that makes no full collection freezes nothing.
The training of a run and its results do not depend on it. The command line, whose process runs one federation
and ends, freezes what exists at the run's start at once instead (``run_loop(..., process_ends=True)``): its runs
make no full collection of torch's objects at all.

:class:`flasync.Federation` inside a caller's own event loop does not use it: the loop and the process are the
caller's, who can wrap the run in ``with frozen_heap():``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

_T = TypeVar("_T")


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep what survives the block's first full garbage collection out of the collector's later passes.

    Nothing happens when objects are frozen already on entry (by the process's own :func:`gc.freeze`, e.g. before a
    fork, or an enclosing block), and nothing is frozen when they are at the collection: it gives back only what
    it froze itself (with anything other code froze during the block after it, which :func:`gc.unfreeze` cannot
    tell apart).
    """
    if gc.get_freeze_count() > 0:
        yield
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


def run_loop(coro: Coroutine[Any, Any, _T], *, process_ends: bool = False) -> _T:
    """Run ``coro`` to its end in a new event loop (uvloop when installed), inside :func:`frozen_heap`.

    Args:
        coro: What to run.
        process_ends: The process ends once ``coro`` has (the command line's ``run``, ``serve`` and ``client``):
            everything alive at the start (the imports' objects) is frozen at once and for good, so not even the
            run's first full collection walks it, and no earlier run's garbage can be kept.
    """
    if process_ends and gc.get_freeze_count() == 0:
        gc.freeze()
    with frozen_heap():
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
            return asyncio.run(coro)
        result: _T = uvloop.run(coro)
        return result
