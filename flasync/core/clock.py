"""Clocks: real time for deployment, discrete-event virtual time for simulation.

Both clocks offer the same three awaitables, and orchestration code uses nothing else to wait:

* ``sleep(seconds)`` - a delay (a simulated transfer, a deadline);
* ``run(executor, fn, simulated_s=...)`` - real work (local training, evaluation) handed to an executor so the
  event loop never blocks; under the virtual clock the job *also* takes ``simulated_s`` of virtual time;
* ``now()`` - seconds since the clock started.

A group of jobs that start together and finish at a few times (a cohort of clients) uses ``start`` and ``finish``
instead of one ``run`` each: one timer per finishing time rather than one per job.

:class:`VirtualClock` is a discrete-event scheduler in the manner of trio's ``MockClock`` with autojump: a driver
task (:meth:`VirtualClock.drive`) fires timers one at a time in ``(time, sequence)`` order. Before firing the next
timer it waits until the loop has settled (no registered activity for a few loop passes), and a timer that stands
for real work fires only once that work is done. So the order in which coroutines resume depends on virtual
times alone, never on how fast threads ran: the same seed gives the same weights, bit for bit, whatever the
number of executor threads.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

__all__ = ["CallsAt", "Clock", "RunClock", "Started", "VirtualClock", "WallClock"]

T = TypeVar("T")


class Started(NamedTuple, Generic[T]):
    """A job handed to an executor by :meth:`Clock.start`: the loop future to await, and what the executor returned
    for it (a batching executor's held future, which the virtual clock tells it is needed)."""

    future: asyncio.Future[T]
    source: object


@runtime_checkable
class Clock(Protocol):
    """What the server, its components and the clients wait with: read the time, sleep, run a job.

    No caller asks which clock it has: how a simulated duration maps to the clock's time is the clock's business
    (:meth:`elapse`, :meth:`run`).
    """

    def now(self) -> float:
        """Return seconds since the clock started."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``."""
        ...

    async def sleep_until(self, when: float) -> None:
        """Wait until the clock reads ``when`` (at once if it has passed)."""
        ...

    async def elapse(self, seconds: float, *, until: float) -> None:
        """Let a simulated activity of ``seconds`` pass that ends at ``until`` on the run's timeline."""
        ...

    async def run(
        self, executor: Executor, fn: Callable[[], T], *, simulated_s: float = 0.0, until: float | None = None
    ) -> T:
        """Run ``fn`` in ``executor``; under virtual time it also takes ``simulated_s`` (or lasts ``until``)."""
        ...

    def start(self, executor: Executor, fn: Callable[[], T]) -> Started[T]:
        """Start ``fn`` in ``executor`` now; :meth:`finish` waits for it."""
        ...

    async def finish(self, jobs: Sequence[Started[Any]], *, until: float) -> list[Any]:
        """Wait for started jobs that end at ``until`` on the run's timeline; return each one's result or exception.

        A cancelled wait cancels the jobs.
        """
        ...


@runtime_checkable
class RunClock(Clock, Protocol):
    """A clock as the runtime holds it: driven, stopped, checkpointed and told of loop activity."""

    @property
    def virtual(self) -> bool:
        """Tell whether time is simulated."""
        ...

    async def drive(self) -> None:
        """Advance time until :meth:`stop` (a no-op for real time)."""
        ...

    def state(self) -> dict[str, float | int]:
        """Return what a checkpoint needs to continue this clock."""
        ...

    def restore(self, state: dict[str, float | int]) -> None:
        """Continue from :meth:`state` (before the run starts)."""
        ...

    def stop(self) -> None:
        """Make :meth:`drive` return."""
        ...

    def poke(self) -> None:
        """Note in-loop activity (the bus calls it on every publish and delivery)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Return :meth:`state` (a checkpoint component)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (before the run starts)."""
        ...


def _submit(executor: Executor, fn: Callable[[], T]) -> Started[T]:
    """Start ``fn`` in ``executor``; return the loop future to await (the executor's, bridged with
    :func:`asyncio.wrap_future`) and what the executor returned for it."""
    source = executor.submit(fn)
    return Started(asyncio.wrap_future(source), source)


def _outcomes(futures: Sequence[asyncio.Future[Any]]) -> list[Any]:
    """Return each done future's result, or its exception (a cancelled one's :class:`asyncio.CancelledError`)."""
    return [
        asyncio.CancelledError() if f.cancelled() else (f.result() if f.exception() is None else f.exception())
        for f in futures
    ]


def _all_done(futures: Sequence[asyncio.Future[Any]]) -> asyncio.Future[None]:
    """Return a future of the running loop that is done once every one of ``futures`` is."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    left = len(futures)

    def one(_: object) -> None:
        nonlocal left
        left -= 1
        if not left and not done.done():
            done.set_result(None)

    if not left:
        done.set_result(None)
    for future in futures:
        future.add_done_callback(one)
    return done


class _Sources(tuple[object, ...]):
    """What the executor returned for each job of a group timer (each is offered to ``on_wait``)."""


@runtime_checkable
class CallsAt(Protocol):
    """A clock that can call a plain function at one of its times from the event loop's own timers.

    A time limit that is rarely reached (a remote task's) then costs a loop timer, not a task that sleeps. Only
    clocks whose time the loop's timers can follow offer it (:class:`WallClock`); the virtual clock orders its
    wake-ups itself and has none.
    """

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        """Call ``callback`` from the running loop once the clock reads ``when``; return its cancellable handle."""
        ...


class WallClock:
    """Real time from an injected monotonic function.

    Without a ``factor`` (a deployment) simulated training durations are ignored: a job takes the time it takes.
    With one (an emulation, ``wall_time_factor``), the simulated durations of the speed and network models become
    real waits scaled by ``factor``: ``now()`` counts simulated seconds (real seconds / ``factor``), every sleep
    lasts ``factor`` times its simulated length, and a job handed to :meth:`run` takes the longer of its real
    computation and its scaled simulated duration. So a service can rehearse a deployment of slow or flaky devices
    in real time (``factor = 1``) or faster (``factor < 1``).

    Args:
        time_fn: Monotonic real seconds.
        factor: Real seconds per simulated second (> 0), or None to run at the machine's pace.

    Raises:
        ValueError: If ``factor`` is not positive.
    """

    virtual = False

    def __init__(self, time_fn: Callable[[], float] = time.monotonic, *, factor: float | None = None) -> None:
        """Start the clock at ``time_fn()``."""
        if factor is not None and not factor > 0:
            raise ValueError(f"factor must be > 0, got {factor}")
        self._time_fn = time_fn
        self._start = time_fn()
        self._factor = factor
        self._scale = 1.0 if factor is None else factor

    @property
    def factor(self) -> float | None:
        """Real seconds per simulated second (None: simulated training durations are ignored)."""
        return self._factor

    def now(self) -> float:
        """Return seconds since the clock started (simulated seconds, i.e. real ones / ``factor``, with one)."""
        return (self._time_fn() - self._start) / self._scale

    async def sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` (times ``factor`` of real time, with one)."""
        await asyncio.sleep(seconds * self._scale)

    def state(self) -> dict[str, float | int]:
        """Return the clock's reading (for a checkpoint)."""
        return {"now": self.now()}

    def restore(self, state: dict[str, float | int]) -> None:
        """Continue from a checkpoint's reading: ``now()`` goes on from ``state["now"]``."""
        self._start = self._time_fn() - float(state["now"]) * self._scale

    async def sleep_until(self, when: float) -> None:
        """Sleep until ``now() >= when``."""
        delay = when - self.now()
        if delay > 0:
            await asyncio.sleep(delay * self._scale)

    def call_at(self, when: float, callback: Callable[[], object]) -> asyncio.TimerHandle:
        """Call ``callback`` from the running loop once ``now() >= when`` (the wait :meth:`sleep_until` makes, as a
        loop timer: no task, no future); return the timer's handle (``cancel()`` it to drop the call)."""
        delay = (when - self.now()) * self._scale
        return asyncio.get_running_loop().call_later(max(delay, 0.0), callback)

    async def elapse(self, seconds: float, *, until: float) -> None:
        """Sleep ``seconds`` (scaled by ``factor``, with one; the simulated timeline's ``until`` does not apply)."""
        await asyncio.sleep(seconds * self._scale)

    def state_dict(self) -> dict[str, Any]:
        """Return :meth:`state`."""
        return dict(self.state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self.restore(state)

    async def run(
        self, executor: Executor, fn: Callable[[], T], *, simulated_s: float = 0.0, until: float | None = None
    ) -> T:
        """Run ``fn`` in ``executor`` and return its result.

        Without a ``factor``, ``simulated_s`` and ``until`` are ignored. With one, the result comes no sooner than
        ``until`` (or ``simulated_s`` from now), on this clock's scaled time.
        """
        job = _submit(executor, fn)[0]
        if self._factor is None:
            return await job
        try:
            await self.sleep_until(until if until is not None else self.now() + simulated_s)
        except BaseException:
            job.cancel()
            raise
        return await job

    def start(self, executor: Executor, fn: Callable[[], T]) -> Started[T]:
        """Start ``fn`` in ``executor`` now."""
        return _submit(executor, fn)

    async def finish(self, jobs: Sequence[Started[Any]], *, until: float) -> list[Any]:
        """Wait for ``jobs``; with a ``factor``, also until ``until`` on this clock's scaled time."""
        futures = [job.future for job in jobs]
        try:
            if self._factor is not None:
                await self.sleep_until(until)
            await _all_done(futures)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return _outcomes(futures)

    async def drive(self) -> None:
        """Return at once: real time advances by itself."""

    def stop(self) -> None:
        """Do nothing."""

    def poke(self) -> None:
        """Do nothing."""


class _Timer(NamedTuple):
    """A pending timer; timers order by ``(when, seq)`` (``seq`` is unique), compared as tuples in C."""

    when: float
    seq: int
    waiter: asyncio.Future[None]
    job: asyncio.Future[Any] | None = None
    source: object = None


class VirtualClock:
    """Discrete-event virtual time driven by :meth:`drive` inside the run's task group.

    Args:
        start: Initial virtual time in seconds.
        settle_passes: Consecutive loop passes without activity that count as "the loop has settled". Every
            step of flasync's own orchestration registers activity (timers, bus traffic), and no chain of its
            steps has more than one unregistered pass between registered ones, so a small number suffices.
    """

    virtual = True

    def __init__(self, *, start: float = 0.0, settle_passes: int = 3) -> None:
        """Create a stopped clock at ``start``."""
        if settle_passes < 1:
            raise ValueError(f"settle_passes must be >= 1, got {settle_passes}")
        self._now = float(start)
        self._settle_passes = settle_passes
        self._heap: list[_Timer] = []
        self._seq = 0
        self._activity = 0
        self._attention: asyncio.Future[None] | None = None
        self._stopped = False
        self._on_wait: list[Callable[[object], None]] = []
        self.fired = 0

    def now(self) -> float:
        """Return the current virtual time in seconds."""
        return self._now

    def poke(self) -> None:
        """Note in-loop activity, postponing the next time advance."""
        self._activity += 1

    def on_wait(self, callback: Callable[[object], None]) -> None:
        """Call ``callback(job)`` whenever the loop has settled and the next timer stands for the executor job ``job``.

        ``job`` is the future the executor returned. A batching executor uses this to start the jobs it holds
        back once the first of them is needed: whether a held job is needed depends on virtual times alone (never
        on how fast other jobs ran), so its batches, and the run, are deterministic.
        """
        self._on_wait.append(callback)

    @property
    def pending(self) -> int:
        """Count timers not yet fired (cancelled ones included until they reach the head)."""
        return len(self._heap)

    def next_timer(self) -> float:
        """Return the virtual time of the earliest timer pending, cancelled ones aside (``inf`` when none).

        A coroutine that has just woken up, with the loop settled, learns from it that nothing else can happen
        before that time unless it makes it happen itself: no other coroutine resumes before the clock fires a
        timer.
        """
        heap = self._heap
        while heap and heap[0].waiter.done():  # cancelled waiters
            heapq.heappop(heap)
        return heap[0].when if heap else math.inf

    def state(self) -> dict[str, float | int]:
        """Return what a checkpoint needs to restart this clock: the time and the timer sequence counter.

        Pending timers belong to the coroutines that wait on them; a resumed run re-creates them (at the same
        absolute times, see :meth:`sleep_until` and ``run(..., until=...)``).
        """
        return {"now": self._now, "seq": self._seq}

    def restore(self, state: dict[str, float | int]) -> None:
        """Set the time and sequence counter from :meth:`state` (before :meth:`drive` starts)."""
        self._now = float(state["now"])
        self._seq = int(state["seq"])

    def _push(self, delay: float, job: asyncio.Future[Any] | None, source: object = None) -> asyncio.Future[None]:
        if not delay >= 0.0:  # also rejects NaN
            raise ValueError(f"a delay must be a finite number >= 0, got {delay}")
        return self._push_at(self._now + delay, job, source)

    def _push_at(self, when: float, job: asyncio.Future[Any] | None, source: object = None) -> asyncio.Future[None]:
        if math.isnan(when):
            raise ValueError("a timer's time must not be NaN")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, _Timer(when, self._seq, waiter, job, source))
        self._seq += 1
        self._activity += 1
        self._wake()
        return waiter

    def _wake(self, _: object = None) -> None:
        attention = self._attention
        if attention is not None and not attention.done():
            attention.set_result(None)

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of virtual time."""
        await self._push(seconds, None)

    async def sleep_until(self, when: float) -> None:
        """Wait until virtual time ``when`` exactly (at once, without moving time back, if it has passed)."""
        await self._push_at(when, None)

    async def elapse(self, seconds: float, *, until: float) -> None:
        """Wait until ``until``: the activity's place on the virtual timeline, whenever it started."""
        await self._push_at(until, None)

    def state_dict(self) -> dict[str, Any]:
        """Return :meth:`state`."""
        return dict(self.state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self.restore(state)

    async def run(
        self, executor: Executor, fn: Callable[[], T], *, simulated_s: float = 0.0, until: float | None = None
    ) -> T:
        """Run ``fn`` in ``executor``; resume ``simulated_s`` virtual seconds later, once ``fn`` has returned.

        The job starts at once in real time; only its *completion*, as seen by the caller, is placed on the
        virtual timeline, and time does not pass that point until the job is really done. ``until`` places the
        completion at that absolute time instead (a resumed task keeps the timeline it started with).
        """
        job, source = _submit(executor, fn)
        waiter = self._push(simulated_s, job, source) if until is None else self._push_at(until, job, source)
        try:
            await waiter
        except asyncio.CancelledError:
            job.cancel()
            raise
        return job.result()

    def start(self, executor: Executor, fn: Callable[[], T]) -> Started[T]:
        """Start ``fn`` in ``executor`` now, in real time; :meth:`finish` places its completion in virtual time."""
        return _submit(executor, fn)

    async def finish(self, jobs: Sequence[Started[Any]], *, until: float) -> list[Any]:
        """Resume at virtual time ``until`` once every one of ``jobs`` is done: one timer for the group, which
        fires as :meth:`run`'s would for each job (each job is offered to ``on_wait`` callbacks)."""
        futures = [job.future for job in jobs]
        waiter = self._push_at(until, _all_done(futures), _Sources(job.source for job in jobs))
        try:
            await waiter
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        return _outcomes(futures)

    def stop(self) -> None:
        """Make :meth:`drive` return at its next step (a stopped clock cannot be driven again)."""
        self._stopped = True
        self._wake()

    async def drive(self) -> None:
        """Fire timers in virtual-time order until :meth:`stop` is called."""
        loop = asyncio.get_running_loop()
        while True:
            await self._settle()
            if self._stopped:
                break
            heap = self._heap
            while heap and heap[0].waiter.done():  # cancelled waiters
                heapq.heappop(heap)
            if heap and heap[0].source is not None:
                head = heap[0].source
                for callback in self._on_wait:
                    if type(head) is _Sources:
                        for source in head:
                            callback(source)
                    else:
                        callback(head)
            if not heap or (heap[0].job is not None and not heap[0].job.done()):
                # Nothing to fire yet: wait for a new timer, the head job's completion or stop().
                self._attention = loop.create_future()
                if heap and heap[0].job is not None:
                    heap[0].job.add_done_callback(self._wake)
                try:
                    await self._attention
                finally:
                    self._attention = None
                continue
            timer = heapq.heappop(heap)
            if timer.when > self._now:
                self._now = timer.when
            self._activity += 1
            self.fired += 1
            timer.waiter.set_result(None)

    async def _settle(self) -> None:
        quiet = 0
        while quiet < self._settle_passes:
            mark = self._activity
            await asyncio.sleep(0)
            quiet = quiet + 1 if self._activity == mark else 0
