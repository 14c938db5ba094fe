"""Ending a run: clean-up off the event loop that a cancellation cannot cut short, and closing the executor and the
tracking run with the run's status."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any, Literal, TypeVar

from flasync import tracking
from flasync.runtime.run_tracking import tag_constants
from flasync.training.executors.threads import TrainingExecutor

__all__ = ["Status", "close", "end_run", "off_loop"]

_T = TypeVar("_T")

Status = Literal["FINISHED", "FAILED", "KILLED"]
"""How a tracking run ends."""


async def off_loop(fn: Callable[..., _T], *args: Any) -> _T:
    """Run ``fn(*args)`` in a worker thread and wait for it, also while the awaiting task is being cancelled.

    Clean-up (an executor's shutdown, a tracker's finish over a slow network) must neither block the event loop
    nor be cut short by the cancellation that caused it: the first cancellation arriving meanwhile is held until
    ``fn`` returned, then re-raised. A second one stops the wait at once (``fn`` goes on in its thread, and the
    interpreter waits for it at exit), so a caller that insists is never held up by a hung store.
    """
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    held: asyncio.CancelledError | None = None
    while True:
        try:
            result = await asyncio.shield(work)
        except asyncio.CancelledError as cancel:
            if work.done() or held is not None:
                raise
            held = cancel
            continue
        except BaseException:
            if held is not None:
                raise held from None  # the cancellation wins over a failing clean-up
            raise
        if held is not None:
            raise held
        return result


def close(
    executor: TrainingExecutor,
    tracker: tracking.Tracker,
    status: Status,
    trace_dir: str | None = None,
) -> None:
    """Shut the executor down, end the tracking run with ``status`` and remove the traces folder (blocking)."""
    try:
        executor.shutdown()
    finally:
        tracker.finish(status)
        if trace_dir is not None:
            shutil.rmtree(trace_dir, ignore_errors=True)


async def end_run(
    executor: TrainingExecutor,
    tracker: tracking.Tracker,
    status: Status,
    log: Any,
    *,
    opening: Future[str] | None,
    constant: tracking.ConstantSeries | None,
    trace_dir: str | None,
) -> None:
    """Wait for the tracking run's opening, tag its constant metrics, then :func:`close` it with ``status``; all off
    the loop, and completed even while the task is being cancelled (see :func:`off_loop`)."""
    if opening is not None:
        await off_loop(futures_wait, [opening])  # the dataset input is recorded before the run ends
    if constant is not None and (opening is None or opening.exception() is None):
        # A run that logged its artifacts tagged them already (this finds none left): a failed one has not.
        await off_loop(tag_constants, tracker, constant, log)
    await off_loop(close, executor, tracker, status, trace_dir)
