"""Where training runs: worker threads or Ray actors, behind one executor Protocol."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

__all__ = ["LoopExecutor"]


class LoopExecutor(Executor, abc.ABC):
    """An executor that hands the results of jobs submitted together to the event loop itself, one loop future for
    them all: one job or a cohort's.

    A subclass declares the capability (:class:`~flasync.training.executors.threads.CohortBatcher` does); the
    client coroutine then submits its training jobs through :meth:`submit_many_async` - each alone as a batch of
    one, or a group that trains together as one batch - instead of bridging a thread future per job with
    :func:`asyncio.wrap_future`.
    """

    @abc.abstractmethod
    def submit_many_async(self, jobs: Sequence[Any]) -> asyncio.Future[list[Any]]:
        """Start ``jobs`` together; return one future of the running loop that resolves, once every job is done,
        with each job's result or exception (as a value), in order. Cancelling it cancels the jobs not started."""
