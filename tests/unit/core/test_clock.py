"""Virtual and wall clocks."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from flasync.core.clock import Clock, RunClock, VirtualClock, WallClock


async def _drive(clock: VirtualClock, body: object) -> None:
    """Run ``body`` (a coroutine) while the clock is driven, then stop the clock."""
    async with asyncio.TaskGroup() as tg:
        tg.create_task(clock.drive())
        try:
            await body  # type: ignore[misc]
        finally:
            clock.stop()


async def test_sleepers_wake_in_virtual_time_order() -> None:
    """Sleepers resume in order of their virtual wake times, at those times."""
    clock = VirtualClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.now()))

    async def body() -> None:
        async with asyncio.TaskGroup() as tg:
            for name, seconds in [("c", 3.0), ("a", 1.0), ("b", 2.0)]:
                tg.create_task(sleeper(name, seconds))

    await _drive(clock, body())
    assert woke == [("a", 1.0), ("b", 2.0), ("c", 3.0)]


async def test_ties_break_by_registration_order() -> None:
    """Timers at the same virtual time fire in the order they were registered."""
    clock = VirtualClock()
    woke: list[int] = []

    async def sleeper(i: int) -> None:
        await clock.sleep(5.0)
        woke.append(i)

    async def body() -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(10):
                tg.create_task(sleeper(i))

    await _drive(clock, body())
    assert woke == list(range(10))


async def test_virtual_time_does_not_wait_in_real_time() -> None:
    """An hour of virtual sleep returns at once."""
    clock = VirtualClock()
    start = time.monotonic()
    await _drive(clock, clock.sleep(3600.0))
    assert clock.now() == 3600.0
    assert time.monotonic() - start < 5.0


async def test_job_completion_follows_simulated_not_real_duration() -> None:
    """A job that is slow in real time but short in simulated time resumes first."""
    clock = VirtualClock()
    order: list[str] = []
    with ThreadPoolExecutor(2) as pool:

        async def job(name: str, real_s: float, simulated_s: float) -> None:
            await clock.run(pool, lambda: time.sleep(real_s), simulated_s=simulated_s)
            order.append(name)

        async def body() -> None:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(job("slow-real-short-sim", 0.3, 1.0))
                tg.create_task(job("fast-real-long-sim", 0.0, 2.0))

        await _drive(clock, body())
    assert order == ["slow-real-short-sim", "fast-real-long-sim"]
    assert clock.now() == 2.0


async def test_job_result_and_exception_propagate() -> None:
    """The caller gets the job's return value, or its exception."""
    clock = VirtualClock()
    with ThreadPoolExecutor(1) as pool:

        def boom() -> int:
            raise RuntimeError("boom")

        async def body() -> None:
            assert await clock.run(pool, lambda: 41 + 1, simulated_s=1.0) == 42
            with pytest.raises(RuntimeError, match="boom"):
                await clock.run(pool, boom, simulated_s=1.0)

        await _drive(clock, body())
    assert clock.now() == 2.0


def _order_with_threads(workers: int, seed: int) -> list[tuple[int, float]]:
    """Run 40 jobs with random real durations and chained sleeps; return the resume order."""
    clock = VirtualClock()
    jitter = random.Random(seed)
    delays = [jitter.uniform(0.0, 0.01) for _ in range(40)]
    order: list[tuple[int, float]] = []

    async def client(i: int, pool: ThreadPoolExecutor) -> None:
        await clock.sleep(0.5 * (i % 3))
        await clock.run(pool, lambda: time.sleep(delays[i]), simulated_s=1.0 + (i % 5))
        await clock.sleep(0.25)
        order.append((i, clock.now()))

    async def main() -> None:
        with ThreadPoolExecutor(workers) as pool:

            async def body() -> None:
                async with asyncio.TaskGroup() as tg:
                    for i in range(40):
                        tg.create_task(client(i, pool))

            await _drive(clock, body())

    asyncio.run(main())
    return order


def test_resume_order_is_independent_of_threads_and_real_durations() -> None:
    """The same workload resumes in the same order with 1 or 4 threads and different real durations."""
    reference = _order_with_threads(1, seed=1)
    assert _order_with_threads(4, seed=2) == reference
    assert _order_with_threads(3, seed=3) == reference


async def test_cancelled_sleeper_does_not_block_others() -> None:
    """Cancelling a waiting task leaves the timeline moving."""
    clock = VirtualClock()

    async def body() -> None:
        doomed = asyncio.create_task(clock.sleep(1.0))
        await asyncio.sleep(0)
        doomed.cancel()
        await clock.sleep(2.0)
        with pytest.raises(asyncio.CancelledError):
            await doomed

    await _drive(clock, body())
    assert clock.now() == 2.0


async def test_negative_or_nan_delay_is_rejected() -> None:
    """A negative or NaN delay raises ValueError."""
    clock = VirtualClock()
    with pytest.raises(ValueError, match="delay"):
        await clock.sleep(-1.0)
    with pytest.raises(ValueError, match="delay"):
        await clock.sleep(float("nan"))


async def test_job_runs_off_the_event_loop_thread() -> None:
    """Work handed to ``run`` executes on a worker thread, not the loop's."""
    clock = VirtualClock()
    loop_thread = threading.get_ident()
    with ThreadPoolExecutor(1) as pool:

        async def body() -> None:
            ident = await clock.run(pool, threading.get_ident, simulated_s=0.0)
            assert ident != loop_thread

        await _drive(clock, body())


async def test_wall_clock_uses_injected_time() -> None:
    """WallClock.now() is measured with the injected time function."""
    ticks = iter([100.0, 107.5])
    clock = WallClock(time_fn=lambda: next(ticks))
    assert clock.now() == 7.5
    assert not clock.virtual
    assert isinstance(clock, Clock)


async def test_wall_clock_runs_jobs_and_sleeps() -> None:
    """WallClock runs jobs in the executor and sleeps in real time."""
    clock = WallClock()
    with ThreadPoolExecutor(1) as pool:
        assert await clock.run(pool, lambda: 7, simulated_s=100.0) == 7
    await clock.sleep(0.0)
    await clock.drive()


class _HoldingExecutor(ThreadPoolExecutor):
    """Holds every job back until told to start them all, like a batching executor."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)
        self.held: list[tuple[object, object]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        from concurrent.futures import Future

        future: Future[object] = Future()
        self.held.append((fn, future))
        return future

    def start_all(self, needed: object) -> None:
        self.needed.append(needed)
        for fn, future in self.held:
            try:
                future.set_result(fn())  # type: ignore[operator, attr-defined]
            except Exception as exc:
                future.set_exception(exc)  # type: ignore[attr-defined]
        self.held.clear()

    needed: list[object]


async def test_on_wait_starts_held_jobs_only_when_needed() -> None:
    """on_wait callbacks get the head timer's job; jobs held back are started then, and all complete in order."""
    clock = VirtualClock()
    executor = _HoldingExecutor()
    executor.needed = []
    clock.on_wait(executor.start_all)
    done: list[tuple[int, float]] = []

    async def client(i: int) -> None:
        value = await clock.run(executor, lambda: i, simulated_s=float(i + 1))
        done.append((value, clock.now()))

    async def body() -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(3):
                tg.create_task(client(i))

    try:
        await _drive(clock, body())
    finally:
        executor.shutdown()
    assert done == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert len(executor.needed) >= 1  # called with a job future while the jobs were held


async def test_a_group_of_started_jobs_finishes_at_one_time_with_one_timer() -> None:
    """start() hands jobs over at once; finish() resumes at ``until`` once all are done, with one timer for the group,
    returning each job's result or exception; every job of a held group is offered to the on_wait callbacks."""
    clock = VirtualClock()
    executor = _HoldingExecutor()
    executor.needed = []
    clock.on_wait(executor.start_all)

    def broken() -> int:
        raise ValueError("broken job")

    async def body() -> list[object]:
        jobs = [clock.start(executor, lambda: 1), clock.start(executor, broken), clock.start(executor, lambda: 3)]
        assert len(executor.held) == 3  # handed over, still held
        fired = clock.fired
        outcomes = await clock.finish(jobs, until=2.5)
        assert clock.fired == fired + 1 and clock.now() == 2.5
        return outcomes

    async def driven() -> list[object]:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(clock.drive())
            try:
                return await body()
            finally:
                clock.stop()

    try:
        outcomes = await driven()
    finally:
        executor.shutdown()
    assert outcomes[0] == 1 and outcomes[2] == 3
    assert isinstance(outcomes[1], ValueError) and str(outcomes[1]) == "broken job"
    assert len(executor.needed) >= 1


async def test_a_cancelled_group_finish_cancels_its_jobs() -> None:
    """Cancelling the wait of finish() cancels every job of the group (a held job never starts)."""
    clock = VirtualClock()
    executor = _HoldingExecutor()
    executor.needed = []
    jobs = []

    async def body() -> None:
        jobs.extend(clock.start(executor, lambda: 0) for _ in range(2))
        waiting = asyncio.ensure_future(clock.finish(jobs, until=1.0))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    try:
        await _drive(clock, body())
    finally:
        executor.shutdown()
    assert all(job.future.cancelled() for job in jobs)


async def test_wall_clock_finishes_a_group_when_its_jobs_are_done() -> None:
    """WallClock.finish waits for the jobs only (no factor: ``until`` is the simulated timeline's, not real time)."""
    clock = WallClock()
    with ThreadPoolExecutor(2) as pool:
        jobs = [clock.start(pool, lambda: 4), clock.start(pool, lambda: 1 // 0)]
        outcomes = await clock.finish(jobs, until=1e9)
    assert outcomes[0] == 4 and isinstance(outcomes[1], ZeroDivisionError)


async def test_absolute_timers_land_exactly_and_never_move_time_back() -> None:
    """sleep_until and run(until=...) fire at exactly the given time; a time already past fires at once."""
    clock = VirtualClock()
    clock.restore({"now": 10.0, "seq": 7})
    seen: list[float] = []

    async def body() -> None:
        await clock.sleep_until(10.1 + 0.2)
        seen.append(clock.now())
        with ThreadPoolExecutor(1) as pool:
            assert await clock.run(pool, lambda: 5, simulated_s=99.0, until=3.0) == 5
        seen.append(clock.now())

    await _drive(clock, body())
    assert seen == [10.1 + 0.2, 10.1 + 0.2]
    assert clock.state() == {"now": 10.1 + 0.2, "seq": 9}


def test_wall_clock_restore_continues_its_reading() -> None:
    """A wall clock restored from a checkpoint reads on from the checkpoint's time."""
    ticks = iter([100.0, 250.0, 251.5])
    clock = WallClock(time_fn=lambda: next(ticks))
    clock.restore({"now": 40.0})
    assert clock.now() == pytest.approx(41.5)


async def test_elapse_places_a_simulated_activity_on_the_virtual_timeline() -> None:
    """Virtual time: elapse waits until the activity's end on the timeline, whatever its own length says."""
    clock = VirtualClock()
    driver = asyncio.create_task(clock.drive())
    await clock.elapse(5.0, until=2.5)
    assert clock.now() == 2.5
    clock.stop()
    await driver


async def test_elapse_on_the_wall_clock_sleeps_the_activity_in_real_time() -> None:
    """Real time: elapse sleeps the activity's own seconds (the simulated end does not apply)."""
    now = [0.0]
    clock = WallClock(time_fn=lambda: now[0])
    started = asyncio.get_running_loop().time()
    await clock.elapse(0.05, until=1000.0)
    assert asyncio.get_running_loop().time() - started >= 0.04


def test_both_clocks_are_run_clocks_and_checkpoint_components() -> None:
    """The runtime's view (RunClock) covers both; their state round-trips through state_dict."""
    for clock in (VirtualClock(start=3.0), WallClock()):
        assert isinstance(clock, RunClock)
        state = clock.state_dict()
        clock.load_state_dict(state)
        assert clock.now() == pytest.approx(state["now"], abs=0.01)


async def test_next_timer_is_the_earliest_live_timer() -> None:
    """next_timer reads the earliest pending timer's time, past cancelled ones, and infinity when none is pending:
    what a coroutine that has just woken up may rely on to know nothing else happens before then."""
    clock = VirtualClock()
    assert clock.next_timer() == float("inf")

    async def body() -> None:
        early = asyncio.create_task(clock.sleep_until(2.0))
        late = asyncio.create_task(clock.sleep_until(5.0))
        await asyncio.sleep(0)
        assert clock.next_timer() == 2.0
        early.cancel()
        await asyncio.sleep(0)
        assert clock.next_timer() == 5.0
        await clock.sleep_until(1.0)  # woken with the loop settled: nothing else before 5.0
        assert clock.now() == 1.0 and clock.next_timer() == 5.0
        await late
        assert clock.next_timer() == float("inf")

    await _drive(clock, body())


class _ThreadsWithLoopMethods(ThreadPoolExecutor):
    """A thread pool that merely has methods named like a loop executor's: the clock never asks for them."""

    def submit_async(self, fn: Callable[[], Any]) -> Any:
        raise AssertionError("the clock probed an executor for a loop future")

    def submit_many_async(self, jobs: Sequence[Any]) -> Any:
        raise AssertionError("the clock probed an executor for a batch future")


async def test_the_clock_bridges_any_executors_future_without_probing_it() -> None:
    """The clock starts a job with the executor's own ``submit`` and bridges its future, whatever other methods the
    executor has (what an executor can do besides is declared, and only the client coroutine asks)."""
    clock = WallClock()
    with _ThreadsWithLoopMethods(max_workers=1) as pool:
        started = clock.start(pool, lambda: 41 + 1)
        assert isinstance(started.future, asyncio.Future) and started.source is not started.future
        assert await started.future == 42
        assert await clock.run(pool, lambda: "plain") == "plain"
