"""Policies: async slots stay full, sync rounds close at quorum or deadline and abandon stragglers."""

from __future__ import annotations

import asyncio
from dataclasses import fields
from typing import Any

import pytest

from flasync.config import RunConfig
from flasync.core.events import RoundDeadlinePassed, TaskAssigned
from flasync.runtime import Federation
from flasync.server import AsyncSlots, SyncRounds
from flasync.testing import EventRecorder, ScriptedClients, ServerHarness, small_config

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


async def _fill_one_at_a_time(self: AsyncSlots) -> None:
    """Refill free slots as single draws: one idle client drawn, then dispatched, per slot (the reference)."""
    registry = self.registry
    while len(registry) < self.concurrency:
        client_id = self.sampler.sample_idle(registry.busy, self.clock.now())
        if client_id is None:
            if len(registry):
                return
            if not await self.idle.until(self.clock, self.sampler.next_online(self.clock.now())):
                return
            continue
        await registry.dispatch_many((int(client_id),))


def _virtual(name: str) -> bool:
    """Tell whether an event field is not a wall-clock duration (those differ between any two runs)."""
    return not name.endswith("_s") or name == "simulated_s" or name.startswith("sim_")


async def _recorded_run(config: RunConfig) -> tuple[list[Any], str]:
    """Run ``config``; return every event published (batches as their members, as its class and fields but the wall
    times) and the final weights' digest."""
    federation = Federation(config)
    recorder = EventRecorder(federation.bus)
    summary = await federation.run()
    events = [
        (type(e).__name__, {f.name: getattr(e, f.name) for f in fields(e) if _virtual(f.name)}) for e in recorder.events
    ]
    return events, summary.weights_sha256


@pytest.mark.parametrize(
    "overrides",
    [
        ("population.sampling=uniform", "faults.crash=0.1", "faults.dropout=0.1", "faults.hang=0.05"),
        ("population.sampling=lru", "faults.crash=0.1", "faults.dropout=0.1", "faults.hang=0.05"),
        ("population.sampling=uniform", "faults.crash=0.1", "faults.availability.period_s=20"),
        ("population.sampling=weighted", "faults.dropout=0.1"),
    ],
)
async def test_async_slots_filling_free_slots_together_publishes_what_single_draws_did(
    overrides: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FedBuff run (faults on, tasks timed out, availability windows) that draws its free slots' clients together
    and dispatches them at once publishes the same events, tasks (ids, clients, participations, times) in the same
    order and reaches the same weights as one that draws and dispatches a client per slot."""
    overrides = (*overrides, "resilience.task_timeout_s=30")
    if any("availability" in o for o in overrides):
        overrides = (*overrides, "faults.availability.online_fraction=0.4")
    server = {"kind": "fedbuff", "buffer_size": 3, "concurrency": 12}
    config = small_config(*overrides, "stop.max_versions=10", server=server)
    together, together_weights = await _recorded_run(config)
    monkeypatch.setattr(AsyncSlots, "fill", _fill_one_at_a_time)
    single, single_weights = await _recorded_run(config)
    assert sum(name == "TaskAssigned" for name, _ in single) > 12
    assert together == single and together_weights == single_weights


@pytest.mark.parametrize(
    "overrides",
    [
        ("population.sampling=uniform",),
        ("population.sampling=lru", "executor.kind=vectorized"),
        ("population.sampling=weighted", "server.max_staleness=1", "resilience.zscore_threshold=1.5"),
        ("population.sampling=lru", "resilience.clip_update_norm=0.5", "resilience.max_update_norm=2.0"),
    ],
)
@pytest.mark.slow
async def test_async_slots_refilling_between_the_uploads_of_a_batch_keeps_every_task_and_weight(
    overrides: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedBuff with every client as fast (uploads arrive together): slots refilled between the uploads of a batch as
    they are taken, the tasks announced once the batch is taken up to the next version, give the same tasks (ids,
    clients, participations, versions, times), events of each kind in the same order, the same events between two
    versions and the same weights as every upload taken alone and its slot filled after it; with refusals and
    clipping."""
    server = {"kind": "fedbuff", "buffer_size": 4, "concurrency": 10}
    config = small_config(
        *overrides,
        "population.speed={kind: constant}",
        "stop.max_versions=12",
        "population.num_clients=30",
        server=server,
    )
    refills = 0
    refill = AsyncSlots.refill

    def counted(self: AsyncSlots) -> None:
        nonlocal refills
        refills += 1
        refill(self)

    monkeypatch.setattr(AsyncSlots, "refill", counted)
    together, together_weights = await _recorded_run(config)
    assert refills > 12  # the batches' slots were refilled between their uploads
    monkeypatch.setattr(AsyncSlots, "refills_at_once", property(lambda self: False))
    alone, alone_weights = await _recorded_run(config)
    assert together_weights == alone_weights and together != alone
    for kind in {name for name, _ in alone}:
        assert [e for e in together if e[0] == kind] == [e for e in alone if e[0] == kind]

    def between_versions(events: list[Any]) -> list[list[str]]:
        stretches: list[list[str]] = [[]]
        for name, values in events:
            if name != "UpdateUploaded":  # a group publishes its uploads due at one time before they are taken
                stretches[-1].append(repr((name, values)))
            if name == "Aggregated":
                stretches.append([])
        return [sorted(stretch) for stretch in stretches]

    assert between_versions(together) == between_versions(alone)


@pytest.mark.parametrize("speed", ["constant", "lognormal"])
@pytest.mark.slow
async def test_a_refill_of_one_slot_drawn_the_quick_way_is_the_general_draw(
    speed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Least-recently-used FedBuff: once every client was used, a slot freed by an upload is refilled with the idle
    heap's oldest client (:meth:`Population.least_recent_idle`, no lists); the run publishes the same events (tasks,
    clients, participations, times) and reaches the same weights as one that draws every slot the general way."""
    from flasync.clients.simulated.population import Population

    server = {"kind": "fedbuff", "buffer_size": 4, "concurrency": 10}
    config = small_config(
        "population.sampling=lru",
        f"population.speed={{kind: {speed}}}",
        "population.num_clients=16",
        "stop.max_versions=12",
        server=server,
    )
    answered = 0
    quick = Population.least_recent_idle

    def counted(self: Population, busy: Any) -> int | None:
        nonlocal answered
        client = quick(self, busy)
        answered += client is not None
        return client

    monkeypatch.setattr(Population, "least_recent_idle", counted)
    quick_events, quick_weights = await _recorded_run(config)
    assert answered > 20  # most refills after the first few versions
    monkeypatch.setattr(Population, "least_recent_idle", lambda self, busy: None)
    general_events, general_weights = await _recorded_run(config)
    assert sum(name == "TaskAssigned" for name, _ in quick_events) > 40
    assert quick_events == general_events and quick_weights == general_weights
