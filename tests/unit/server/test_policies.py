"""Policies: async slots stay full, sync rounds close at quorum or deadline and abandon stragglers."""

from __future__ import annotations

import asyncio

import pytest

from flasync.core.events import RoundDeadlinePassed, TaskAssigned
from flasync.server import SyncRounds
from flasync.testing import EventRecorder, ScriptedClients, ServerHarness

pytestmark = pytest.mark.timeout(30)


async def test_async_slots_keep_concurrency_tasks_in_flight() -> None:
    """Every answer frees a slot that is refilled at once: in flight never exceeds C, and K answers make a version."""
    harness = ServerHarness(max_versions=5, concurrency=3, buffer_size=2)
    events = EventRecorder(harness.bus)
    stats = await harness.run()
    assigned = events.of(TaskAssigned)
    assert stats.versions == 5 and stats.updates_accepted == 10
    # Tasks dispatched: the first three, then one per answer handled before the stop.
    assert len(assigned) == stats.tasks_dispatched == 3 + stats.updates_accepted - 1
    assert stats.staleness_max >= 1  # with three in flight and K = 2, some answers arrive a version late


def _rounds(harness: ServerHarness, *, quorum: float = 1.0, deadline_s: float | None = None) -> SyncRounds:
    return SyncRounds(
        clients_per_round=4,
        over_selection=0.5,
        quorum=quorum,
        deadline_s=deadline_s,
        registry=harness.registry,
        sampler=harness.sampler,
        clock=harness.clock,
        bus=harness.bus,
        accounting=harness.accounting,
        log=harness.log,
    )


async def test_sync_rounds_close_at_quorum_and_abandon_the_rest() -> None:
    """Over-selection samples 6 for 4 wanted; the round closes after 3 answers (quorum 0.75), abandoning 3."""
    harness = ServerHarness(
        max_versions=2,
        policy=lambda h: _rounds(h, quorum=0.75),
        buffer_size=100,  # the round, not the buffer, decides
    )
    stats = await harness.run()
    rounds = harness.log.events("server.round")
    assert [r["accepted"] for r in rounds] == [3, 3]
    assert [r["abandoned"] for r in rounds] == [3, 3]
    assert stats.tasks_dispatched == 12 and stats.tasks_abandoned == 6 and stats.updates_accepted == 6


async def test_sync_rounds_close_at_their_deadline_with_who_answered() -> None:
    """Slow clients miss a 2 s deadline: the round steps with the fast ones and abandons the slow ones."""
    harness = ServerHarness(
        max_versions=1,
        policy=lambda h: _rounds(h, deadline_s=2.0),
        buffer_size=100,
        clients=lambda bus, clock: ScriptedClients(
            bus, clock, 4, delay_s=lambda task: 1.0 if int(task.client_id) % 2 else 5.0
        ),
    )
    events = EventRecorder(harness.bus)
    stats = await harness.run()
    (round_,) = harness.log.events("server.round")
    assert round_["deadline_passed"] == 1
    assert round_["accepted"] == stats.updates_accepted > 0
    assert round_["accepted"] + round_["abandoned"] == 6
    assert events.count(RoundDeadlinePassed) == 1
    assert harness.clock.now() == pytest.approx(2.0)


async def test_an_empty_round_makes_no_version_and_says_so() -> None:
    """Every member failing leaves nothing to aggregate: a warning, no step, and the next round starts."""

    def fail_first_round(task: TaskAssigned) -> str | None:
        return "crash" if task.task_id < 6 else None

    harness = ServerHarness(
        max_versions=1,
        policy=lambda h: _rounds(h),
        buffer_size=100,
        clients=lambda bus, clock: ScriptedClients(bus, clock, 4, fail=fail_first_round),
    )
    stats = await harness.run()
    assert [r["step"] for r in harness.log.events("server.round_empty")] == [0]
    assert stats.versions == 1 and stats.updates_failed == 6


async def test_an_idle_wait_on_a_wall_clock_ends_at_a_stop_request() -> None:
    """A wait for clients to come online ends when woken (and every later one at once); a virtual clock's is
    awaited as it is."""
    from flasync.core.clock import WallClock
    from flasync.server.policies import IdleWait

    idle = IdleWait()
    waiting = asyncio.ensure_future(idle.until(WallClock(), 3600.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    idle.wake()
    assert await asyncio.wait_for(waiting, 10) is False
    assert await idle.until(WallClock(), 3600.0) is False
