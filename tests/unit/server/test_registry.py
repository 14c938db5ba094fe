"""The task registry: dispatch, release exactly once, base models kept while used, watchdogs, checkpoints."""

from __future__ import annotations

import asyncio
import copy
import inspect
import random
from collections.abc import Awaitable, Sequence

import numpy as np
import pytest
import torch

from flasync.core.bus import EventBus
from flasync.core.clock import VirtualClock, WallClock
from flasync.core.events import CLOUD, ClientId, ClientTimedOut, TaskAssigned, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.server.accounting import Accounting
from flasync.server.registry import TaskRegistry
from flasync.testing import EventRecorder, ScriptedClients, ServerHarness

pytestmark = pytest.mark.timeout(30)


def _silent(bus: EventBus, clock: VirtualClock) -> ScriptedClients:
    """Clients that never answer: the registry's own behaviour is under test."""
    return ScriptedClients(bus, clock, 4, fail=lambda task: "hang")


def _snapshot(version: int) -> ModelSnapshot:
    weights = torch.full((4,), float(version))
    return ModelSnapshot(version=Version(version), weights=weights, exact=weights, download_bytes=100)


async def _started(harness: ServerHarness, body: Awaitable[object]) -> None:
    await _attached(harness.registry, body)


async def _attached(registry: TaskRegistry, body: Awaitable[object]) -> None:
    """Await ``body`` with ``registry`` attached to a task group; cancel the registry's tasks after it."""
    async with asyncio.TaskGroup() as tg:
        registry.attach(tg)
        try:
            await body
        finally:
            registry.cancel_all()


async def test_dispatch_records_the_task_counts_the_download_and_publishes_it() -> None:
    """A dispatch numbers the task, counts one participation and its download, and announces it on the bus."""
    harness = ServerHarness(clients=_silent)
    events = EventRecorder(harness.bus)
    registry = harness.registry
    registry.publish(_snapshot(0))

    async def body() -> None:
        first = await registry.dispatch(3)
        second = await registry.dispatch(3 + 1)
        assert (first.task_id, second.task_id) == (0, 1)
        assert first.participation == 0 and first.reply_to == CLOUD
        assert 3 in registry and len(registry) == 2
        registry.release(first)
        third = await registry.dispatch(3)
        assert third.participation == 1  # the client's second task

    await _started(harness, body())
    await asyncio.sleep(0)
    assert [e.task_id for e in events.of(TaskAssigned)] == [0, 1, 2]
    assert harness.accounting.stats.tasks_dispatched == 3
    assert harness.accounting.stats.download_bytes == 300 == harness.accounting.stats.cloud_egress_bytes


async def test_a_task_is_released_once_and_only_by_its_own_answer() -> None:
    """Release takes the exact task (id, client, base version); a repeat or a forged answer finds nothing."""
    harness = ServerHarness(clients=_silent)
    registry = harness.registry
    registry.publish(_snapshot(0))

    async def body() -> None:
        task = await registry.dispatch(5)
        forged = TaskAssigned(
            task_id=task.task_id, client_id=ClientId(5), participation=0, base_version=Version(7), simulated_s=0.0
        )
        assert not registry.release(forged)
        assert registry.release(task)
        assert not registry.release(task)
        assert len(registry) == 0

    await _started(harness, body())


async def test_an_old_base_model_is_kept_while_a_task_uses_it() -> None:
    """Publishing v1 keeps v0 for the task that started from it, and drops it when that task is released."""
    harness = ServerHarness(clients=_silent)
    registry = harness.registry
    registry.publish(_snapshot(0))

    async def body() -> None:
        task = await registry.dispatch(1)
        registry.publish(_snapshot(1))
        assert registry.base(Version(0)) is not None
        registry.release(task)
        assert registry.base(Version(0)) is None
        assert registry.base(Version(1)) is registry.current

    await _started(harness, body())


async def test_an_unused_old_model_is_dropped_at_once() -> None:
    """Without tasks on it, the previous model is not kept when a new one is published."""
    harness = ServerHarness()
    harness.registry.publish(_snapshot(0))
    harness.registry.publish(_snapshot(1))
    assert harness.registry.base(Version(0)) is None


async def test_the_watchdog_times_out_a_silent_task_to_whoever_it_answers() -> None:
    """A task not answered within timeout_s produces one ClientTimedOut addressed like its answer."""
    harness = ServerHarness(timeout_s=5.0, clients=_silent)
    registry = harness.registry
    registry.publish(_snapshot(0))
    timeouts = harness.bus.subscribe(ClientTimedOut, address="edge7")

    async def body() -> None:
        drive = asyncio.create_task(harness.clock.drive())
        task = await registry.dispatch(2, reply_to="edge7")
        timed_out = await timeouts.receive()
        assert (timed_out.task_id, timed_out.to, timed_out.timeout_s) == (task.task_id, "edge7", 5.0)
        assert harness.clock.now() == pytest.approx(5.0)
        harness.clock.stop()
        await drive

    await _started(harness, body())


async def test_state_round_trip_restores_tasks_models_and_participations() -> None:
    """A registry loaded from another's state has the same tasks in flight, base models and counters."""
    source = ServerHarness(clients=_silent)
    source.registry.publish(_snapshot(0))

    async def body() -> None:
        await source.registry.dispatch(4)
        source.registry.publish(_snapshot(1))
        await source.registry.dispatch(6, reply_to="edge1")

    await _started(source, body())
    state = source.registry.state_dict()
    target = ServerHarness()
    target.registry.load_state_dict(state, device=torch.device("cpu"))
    assert [(t.client_id, t.base_version, t.reply_to) for t in target.registry] == [(4, 0, CLOUD), (6, 1, "edge1")]
    assert target.registry.current is not None and target.registry.current.version == 1
    assert target.registry.base(Version(0)) is not None
    restored = target.registry.state_dict()
    assert restored["participation_clients"].tolist() == state["participation_clients"].tolist() == [4, 6]
    assert restored["participation_counts"].tolist() == state["participation_counts"].tolist() == [1, 1]


async def test_state_with_one_counter_per_client_still_loads() -> None:
    """A registry state holding a dense ``participations`` tensor (one counter per client) loads as sparse counters."""
    source = ServerHarness(clients=_silent)
    source.registry.publish(_snapshot(0))
    state = source.registry.state_dict()
    del state["participation_clients"], state["participation_counts"], state["num_clients"]
    dense = torch.zeros(source.registry.num_clients, dtype=torch.int64)
    dense[3], dense[5] = 2, 7
    state["participations"] = dense
    target = ServerHarness()
    target.registry.load_state_dict(state, device=torch.device("cpu"))
    restored = target.registry.state_dict()
    assert restored["participation_clients"].tolist() == [3, 5]
    assert restored["participation_counts"].tolist() == [2, 7]


async def test_tasks_dispatched_before_the_first_starts_run_as_one_group() -> None:
    """A registry that shares calls: the dispatches made before the group's coroutine runs join it; later ones start
    a new group; a group sees which of its tasks are still in flight through ``holds``."""
    harness = ServerHarness(clients=_silent)
    registry = TaskRegistry(
        bus=harness.bus,
        clock=harness.clock,
        accounting=harness.accounting,
        num_clients=8,
        start=lambda tasks, snapshot: start_group(tasks, snapshot),
        share=True,
    )
    groups: list[list[int]] = []
    held: list[list[bool]] = []
    release_next = asyncio.Event()

    async def start_group(tasks: object, snapshot: ModelSnapshot) -> None:
        members = list(tasks)  # type: ignore[call-overload]
        groups.append([t.task_id for t in members])
        await release_next.wait()
        held.append([registry.holds(t) for t in members])

    registry.publish(_snapshot(0))

    async def body() -> None:
        first = [await registry.dispatch(c) for c in (0, 1, 2)]
        await asyncio.sleep(0)  # the group's coroutine starts with the three
        later = await registry.dispatch(3)
        registry.publish(_snapshot(1))
        other_model = await registry.dispatch(4)
        await asyncio.sleep(0)
        assert groups == [[t.task_id for t in first], [later.task_id], [other_model.task_id]]
        assert registry.release(first[1])
        release_next.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert held[0] == [True, False, True]
        assert registry._handles == {}  # a group's tasks have no coroutine of their own to cancel on release

    await _attached(registry, body())


async def test_a_registry_that_does_not_share_starts_groups_of_one_and_cancels_them_on_release() -> None:
    """Without ``share`` every task starts in a call of its own (a group of one), and releasing the task cancels
    that call (a hanging or abandoned client stops)."""
    harness = ServerHarness(clients=_silent)
    calls: list[list[int]] = []
    cancelled: list[int] = []

    async def start(tasks: object, snapshot: ModelSnapshot) -> None:
        members = list(tasks)  # type: ignore[call-overload]
        calls.append([t.task_id for t in members])
        try:
            await asyncio.get_running_loop().create_future()  # never answers
        except asyncio.CancelledError:
            cancelled.extend(t.task_id for t in members)
            raise

    registry = TaskRegistry(
        bus=harness.bus, clock=harness.clock, accounting=harness.accounting, num_clients=8, start=start
    )
    registry.publish(_snapshot(0))

    async def body() -> None:
        tasks = await registry.dispatch_many([0, 1, 2])
        await asyncio.sleep(0)
        assert calls == [[t.task_id] for t in tasks]
        assert registry.release(tasks[1])
        await asyncio.sleep(0)
        assert cancelled == [tasks[1].task_id]

    await _attached(registry, body())


async def test_a_registry_that_posts_hands_each_task_over_at_dispatch_with_no_coroutine() -> None:
    """With ``post`` each task is handed to ``start`` during its dispatch (a transport's mailbox), in order, with its
    model; no task of the run is made for it, and a checkpoint's tasks are posted again when resumed. A posting
    registry cannot share."""
    harness = ServerHarness(clients=_silent)
    posted: list[tuple[int, int]] = []

    def post(task: TaskAssigned, snapshot: ModelSnapshot) -> None:
        posted.append((task.task_id, int(snapshot.version)))

    registry = TaskRegistry(
        bus=harness.bus, clock=harness.clock, accounting=harness.accounting, num_clients=8, start=post, post=True
    )
    registry.publish(_snapshot(3))

    async def body() -> None:
        tasks = await registry.dispatch_many([4, 1, 6])
        assert posted == [(t.task_id, 3) for t in tasks]  # already during the dispatch
        assert registry._tasks == set() and registry._handles == {}
        assert registry.release(tasks[0]) and not registry.holds(tasks[0]) and registry.holds(tasks[1])
        state = registry.state_dict()
        again = TaskRegistry(
            bus=harness.bus, clock=harness.clock, accounting=harness.accounting, num_clients=8, start=post, post=True
        )
        again.load_state_dict(state, device=torch.device("cpu"))
        posted.clear()
        again.redispatch()
        assert posted == [(tasks[1].task_id, 3), (tasks[2].task_id, 3)]

    await _attached(registry, body())
    with pytest.raises(ValueError, match="share must be False"):
        TaskRegistry(
            bus=harness.bus,
            clock=harness.clock,
            accounting=harness.accounting,
            num_clients=8,
            start=post,
            post=True,
            share=True,
        )


async def test_a_task_spawned_with_no_task_group_is_closed_not_left_unawaited() -> None:
    """A background task asked for before the run or after it stopped raises, and its coroutine is closed (no
    "never awaited" warning from a round timer set as a served run stops)."""
    harness = ServerHarness(clients=_silent)

    async def never() -> None:
        await asyncio.sleep(0)

    coro = never()
    with pytest.raises(RuntimeError, match="no task group"):
        harness.registry.spawn(coro, "late")
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED

    async def failing_run() -> None:
        async with asyncio.TaskGroup() as tg:
            harness.registry.attach(tg)
            tg.create_task(_fail())
            await asyncio.sleep(0.01)

    with pytest.raises(ExceptionGroup):
        await failing_run()
    late = never()  # the registry still names the run's group, which has finished
    with pytest.raises(RuntimeError):
        harness.registry.spawn(late, "late")
    assert inspect.getcoroutinestate(late) == inspect.CORO_CLOSED


async def _fail() -> None:
    raise RuntimeError("the run failed")


async def test_dispatch_many_starts_the_tasks_dispatch_would_start_one_by_one() -> None:
    """dispatch_many gives the tasks of dispatch() in turn - ids, participations, downloads, least-recently-used
    marks, the same events in order - with one TasksAssigned where every observer takes batches; a client named
    twice is refused."""
    marks: dict[str, list[int]] = {"one": [], "many": []}

    def harness_for(name: str) -> ServerHarness:
        harness = ServerHarness(clients=_silent)
        harness.registry._mark_used = marks[name].extend
        harness.registry.publish(_snapshot(0))
        return harness

    one, many = harness_for("one"), harness_for("many")
    seen_one, seen_many = EventRecorder(one.bus), EventRecorder(many.bus)
    published = many.bus.statistics().published
    cohorts = ([3, 7, 1], [7, 2])

    async def one_by_one() -> None:
        for cohort in cohorts:
            for client in cohort:
                await one.registry.dispatch(client)
            for task in list(one.registry):
                one.registry.release(task)

    async def together() -> None:
        for cohort in cohorts:
            await many.registry.dispatch_many(cohort)
            for task in list(many.registry):
                many.registry.release(task)
        with pytest.raises(ValueError, match="distinct"):
            await many.registry.dispatch_many([4, 4])
        assert await many.registry.dispatch_many([]) == []

    await _started(one, one_by_one())
    await _started(many, together())
    assert seen_many.of(TaskAssigned) == seen_one.of(TaskAssigned)  # ids, clients, participations, versions, times
    assert [t.participation for t in seen_many.of(TaskAssigned)] == [0, 0, 0, 1, 0]
    assert marks["many"] == marks["one"] == [3, 7, 1, 7, 2]
    assert many.accounting.stats == one.accounting.stats
    assert many.bus.statistics().published == published + 2  # one event per cohort


async def test_reserved_clients_are_busy_at_once_and_get_their_tasks_in_order_later() -> None:
    """reserve (of a group, or of one client as a slot's refill) makes its clients busy and marks them used at once,
    with no task id, download or event; no answer releases a reserved client and no checkpoint is taken;
    assign_reserved gives them their tasks (ids, participations, downloads) in the order they were held, and
    start_assigned announces them in one TasksAssigned and starts them: the tasks, events, marks and counts of
    dispatch_many."""
    marks: dict[str, list[int]] = {"reserved": [], "dispatched": []}
    harnesses = {name: ServerHarness(clients=_silent) for name in marks}
    for name, harness in harnesses.items():
        harness.registry._mark_used = marks[name].extend
        harness.registry.publish(_snapshot(0))
    seen = {name: EventRecorder(harness.bus) for name, harness in harnesses.items()}
    reserved, dispatched = harnesses["reserved"], harnesses["dispatched"]
    published = reserved.bus.statistics().published
    before = copy.deepcopy(reserved.accounting.stats)

    async def in_steps() -> None:
        registry = reserved.registry
        snapshot = registry.current
        assert snapshot is not None
        registry.reserve([5, 2])
        registry.reserve(np.array([6]))
        registry.reserve([np.int64(4)])  # type: ignore[list-item]  # one drawn NumPy integer, held as an int
        assert len(registry) == 4 and 2 in registry and set(registry.busy) == {5, 2, 6, 4}
        assert all(type(client) is int for client in registry.busy)
        assert marks["reserved"] == [5, 2, 6, 4] and reserved.accounting.stats == before
        with pytest.raises(RuntimeError, match="reserved"):
            registry.state_dict()  # no checkpoint holds a client without its task
        for task_id in (-1, 0):  # the placeholder's numbers, and the task the client will get
            forged = TaskAssigned(
                task_id=task_id, client_id=ClientId(2), participation=0, base_version=Version(-1), simulated_s=0.0
            )
            assert not registry.release(forged)
        tasks = registry.assign_reserved(snapshot)
        assert [(t.task_id, t.client_id) for t in tasks] == [(0, 5), (1, 2), (2, 6), (3, 4)]
        assert all(registry.holds(t) for t in tasks) and registry.assign_reserved(snapshot) == []
        assert reserved.bus.statistics().published == published  # nothing announced yet
        await registry.start_assigned(tasks, snapshot)
        await registry.start_assigned([], snapshot)

    async def at_once() -> None:
        await dispatched.registry.dispatch_many([5, 2, 6, 4])

    await _started(reserved, in_steps())
    await _started(dispatched, at_once())
    assert seen["reserved"].of(TaskAssigned) == seen["dispatched"].of(TaskAssigned)
    assert marks["reserved"] == marks["dispatched"] == [5, 2, 6, 4]
    assert reserved.accounting.stats == dispatched.accounting.stats
    assert reserved.bus.statistics().published == published + 1  # one event for the four


async def test_each_released_client_is_marked_idle_once() -> None:
    """A release tells ``mark_idle`` its client (a least-recently-used draw following the tasks in flight): once a
    task, and never for an answer that releases nothing."""
    idle: list[int] = []
    harness = ServerHarness(clients=_silent)
    registry = harness.registry
    registry._mark_idle = idle.append
    registry.publish(_snapshot(0))

    async def body() -> None:
        first, second = await registry.dispatch_many([2, 6])
        forged = TaskAssigned(
            task_id=first.task_id, client_id=ClientId(2), participation=0, base_version=Version(9), simulated_s=0.0
        )
        assert not registry.release(forged)
        assert registry.release(second) and not registry.release(second)
        assert registry.release(first)
        assert 2 not in registry.busy and 6 not in registry.busy

    await _started(harness, body())
    assert idle == [6, 2]


def _wall_registry(timeout_s: float) -> tuple[TaskRegistry, EventBus]:
    """A registry on real time (a deployment's clock) whose clients never answer."""

    async def silent(tasks: Sequence[TaskAssigned], snapshot: ModelSnapshot) -> None:
        await asyncio.Event().wait()

    bus = EventBus()
    registry = TaskRegistry(
        bus=bus, clock=WallClock(), accounting=Accounting(10), num_clients=4, start=silent, timeout_s=timeout_s
    )
    registry.publish(_snapshot(0))
    return registry, bus


async def test_on_real_time_the_watchdog_is_a_loop_timer_that_times_the_task_out() -> None:
    """On a clock with loop timers a task's time limit costs no task of its own, and still times the task out."""
    registry, bus = _wall_registry(timeout_s=0.01)
    timeouts = bus.subscribe(ClientTimedOut, address="edge7")

    async def body() -> None:
        before = len(asyncio.all_tasks())
        task = await registry.dispatch(2, reply_to="edge7")
        assert len(asyncio.all_tasks()) == before + 1  # the client's task alone
        timed_out = await timeouts.receive()
        assert (timed_out.task_id, timed_out.to, timed_out.timeout_s) == (task.task_id, "edge7", 0.01)

    await _attached(registry, body())


async def test_on_real_time_a_released_or_held_task_never_times_out() -> None:
    """Releasing a task (or learning that its client holds its answer) drops its timer: no timeout follows."""
    registry, bus = _wall_registry(timeout_s=0.0)  # a timer due at the loop's next pass
    events = EventRecorder(bus)

    async with asyncio.TaskGroup() as tg:
        registry.attach(tg)
        try:
            released = await registry.dispatch(1)
            held = await registry.dispatch(2)
            assert registry.release(released)
            registry.hold(held)
            for _ in range(5):  # the timers' passes, and those of any task they would start
                await asyncio.sleep(0)
            assert held.client_id in registry
        finally:
            registry.cancel_all()
    assert events.of(ClientTimedOut) == []


class _SetClock:
    """A clock read as it is set (the registry reads it at dispatch)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)

    async def sleep_until(self, when: float) -> None:
        await asyncio.sleep(0)


@pytest.mark.parametrize("seed", range(6))
async def test_dispatch_many_over_random_cohorts_gives_the_tasks_of_the_field_by_field_path(seed: int) -> None:
    """Random cohorts (one client or several, on the current model or another, to the cloud or an edge) with random
    releases between them give the tasks the keyword constructor makes of the next task id, each client's tasks so
    far, the model's version and the clock's time, in order; the events carry them in that order, the accounting
    counts each, the least-recently-used marks follow them, a shared group takes them as they come, and a model is
    kept exactly while a task uses it (or it is current)."""
    rng = random.Random(seed)
    clock = _SetClock()
    bus, accounting = EventBus(), Accounting(10)
    groups: list[tuple[list[TaskAssigned], Version]] = []

    async def start(tasks: Sequence[TaskAssigned], snapshot: ModelSnapshot) -> None:
        groups.append((list(tasks), snapshot.version))

    marks: list[int] = []
    registry = TaskRegistry(
        bus=bus, clock=clock, accounting=accounting, num_clients=12, start=start, mark_used=marks.extend, share=True
    )
    events = EventRecorder(bus)
    registry.publish(_snapshot(0))
    expected: list[TaskAssigned] = []
    counts: dict[int, int] = {}
    in_use: dict[Version, int] = {}

    async def body() -> None:
        for step in range(60):
            clock.t = float(step) * 0.5
            if rng.random() < 0.2:
                registry.publish(_snapshot(step + 1))
            idle = [c for c in range(12) if c not in registry]
            cohort = rng.sample(idle, min(len(idle), rng.choice([1, 1, 2, 3, 5])))
            snapshot = _snapshot(100 + step) if rng.random() < 0.2 else None
            reply_to = "edge-1" if rng.random() < 0.3 else CLOUD
            want: list[TaskAssigned] = []
            for client in cohort:
                assert registry.current is not None
                version = (snapshot or registry.current).version
                want.append(
                    TaskAssigned(
                        task_id=len(expected) + len(want),
                        client_id=ClientId(client),
                        participation=counts.get(client, 0),
                        base_version=version,
                        simulated_s=clock.t,
                        reply_to=reply_to,
                    )
                )
                counts[client] = counts.get(client, 0) + 1
                in_use[version] = in_use.get(version, 0) + 1
            got = await registry.dispatch_many(cohort, snapshot, reply_to=reply_to)
            assert got == want and all(type(t) is TaskAssigned for t in got)
            expected.extend(want)
            if rng.random() < 0.5:
                await asyncio.sleep(0)  # the open group starts: later tasks join a new one
            for task in list(registry):
                if rng.random() < 0.5:
                    assert registry.release(task)
                    in_use[task.base_version] -= 1
            for version, count in in_use.items():
                assert (registry.base(version) is not None) == (count > 0 or version == registry.current.version)  # type: ignore[union-attr]
        await asyncio.sleep(0)

    await _attached(registry, body())
    assert events.of(TaskAssigned) == expected
    assert marks == [t.client_id for t in expected]
    assert [t for tasks, _ in groups for t in tasks] == expected
    assert all(t.base_version == version for tasks, version in groups for t in tasks)
    assert accounting.stats.tasks_dispatched == len(expected)
    assert accounting.stats.download_bytes == 100 * len(expected)
    assert accounting.stats.cloud_egress_bytes == 100 * sum(t.reply_to == CLOUD for t in expected)
    state = registry.state_dict()
    assert (
        dict(zip(state["participation_clients"].tolist(), state["participation_counts"].tolist(), strict=True))
        == counts
    )
