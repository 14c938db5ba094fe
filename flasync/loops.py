"""Running a coroutine in a new event loop that owns its thread, as ``flasync.run`` and the command line do.

A process that imported torch holds about 170,000 objects that the cyclic garbage collector tracks (300,000 with
MLflow); a full collection walks all of them, 60-180 ms on one core. A run allocates enough (a coroutine, a task,
futures and events per client task) that CPython makes one or two full collections in a run of a second or so,
which is 10-25 % of it. :func:`frozen_heap` moves what exists when a run starts into the collector's permanent
generation (:func:`gc.freeze`) for the run's duration, so full collections walk only what the run itself allocated,
and gives it back afterwards (:func:`gc.unfreeze`): nothing is leaked, and garbage that already existed is collected
after the run instead of during it. The training of a run and its results do not depend on it.

:class:`flasync.Federation` inside a caller's own event loop does not freeze anything: the loop and the process are
the caller's. It can use :func:`frozen_heap` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

_T = TypeVar("_T")


@contextlib.contextmanager
def frozen_heap() -> Iterator[bool]:
    """Keep the objects alive on entry out of the garbage collector's passes until the block ends.

    Yields whether it froze anything. It does not when objects are frozen already (by the process's own
    :func:`gc.freeze`, e.g. before a fork, or an enclosing block): it then leaves the collector as it is, so that it
    never unfreezes what it did not freeze.
    """
    if gc.get_freeze_count() > 0:
        yield False
        return
    gc.freeze()
    try:
        yield True
    finally:
        gc.unfreeze()


def run_loop(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` to its end in a new event loop (uvloop when installed), the heap frozen (:func:`frozen_heap`)."""
    with frozen_heap():
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
            return asyncio.run(coro)
        result: _T = uvloop.run(coro)
        return result
