"""The task registry: which client trains from which model version, and every task's lifetime.

The registry dispatches a task (a :class:`~flasync.core.events.TaskAssigned` record, a model download, a coroutine that
runs it), starts a watchdog when tasks have a time limit, releases a task exactly once when its answer, failure or
timeout arrives (a second answer finds nothing to release), and starts a checkpoint's tasks again on their original
timelines. It keeps each base model a task started from until the last such task is released, and owns every task
it starts in the run's ``TaskGroup``. How a task runs (an in-process client coroutine, a remote device) is the
``start`` callable it is given (:data:`StartGroup`): the transport seam. It starts each task in a call of its own, or,
told to ``share``, the tasks dispatched on one model before the first of them starts in one call (see
:class:`~flasync.clients.simulated.client.CohortClients`); a task alone is a group of one.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Protocol, cast

import numpy as np
import torch

from flasync.core.bus import EventBus
from flasync.core.clock import CallsAt
from flasync.core.errors import CheckpointError
from flasync.core.events import (
    CLOUD,
    ClientId,
    ClientTimedOut,
    TaskAssigned,
    TasksAssigned,
    Version,
    positional,
)
from flasync.core.snapshots import ModelSnapshot
from flasync.server.accounting import Accounting

__all__ = [
    "Answer",
    "PostTask",
    "StartGroup",
    "StartTask",
    "TaskRegistry",
    "Timer",
    "one_each",
    "participation_counters",
]

_ClientIds = list[ClientId]

StartTask = Callable[[TaskAssigned, ModelSnapshot], Coroutine[Any, Any, None]]
"""Run one task: train ``snapshot`` on the task's client and put the answer on the bus (never raise)."""

PostTask = Callable[[TaskAssigned, ModelSnapshot], None]
"""Hand one task to its client and return at once (a transport's mailbox): the answer comes on the bus later, and a
task released meanwhile is found so by the transport (:meth:`TaskRegistry.holds`)."""

StartGroup = Callable[[Sequence[TaskAssigned], ModelSnapshot], Coroutine[Any, Any, None]]
"""Run tasks on one model (one or several): train ``snapshot`` on each task's client and put the answers on the bus
(never raise), answering only those still in flight (:meth:`TaskRegistry.holds`) when their answers are due."""


def one_each(start_task: StartTask) -> StartGroup:
    """Return a :data:`StartGroup` that runs each task of a group with ``start_task`` in turn (a registry that does
    not ``share`` starts groups of one)."""

    async def start(tasks: Sequence[TaskAssigned], snapshot: ModelSnapshot) -> None:
        for task in tasks:
            await start_task(task, snapshot)

    return start


class _Cancellable(Protocol):
    """A watchdog: a task that sleeps until a time limit, or a loop timer (:class:`~flasync.core.clock.CallsAt`)."""

    def cancel(self) -> object:
        """Drop the watch (nothing happens if it has fired)."""
        ...


@dataclass(slots=True, eq=False)
class _Group:
    """Tasks dispatched on one model whose coroutine has not started yet (it takes later dispatches too)."""

    snapshot: ModelSnapshot
    tasks: list[TaskAssigned] = field(default_factory=list)


class Timer(Protocol):
    """The clock the server's components need: read it and wait."""

    def now(self) -> float:
        """Return seconds since the clock started."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``."""
        ...

    async def sleep_until(self, when: float) -> None:
        """Wait until the clock reads ``when``."""
        ...


class Answer(Protocol):
    """Anything that names a task: an upload, a failure, a timeout, a closing notice."""

    @property
    def task_id(self) -> int: ...

    @property
    def client_id(self) -> ClientId: ...

    @property
    def base_version(self) -> Version: ...


class TaskRegistry:
    """The tasks in flight and the models they started from.

    Args:
        bus: Where :class:`TaskAssigned` and :class:`ClientTimedOut` go.
        clock: Times watchdogs: a loop timer each where the clock offers
            :meth:`~flasync.core.clock.CallsAt.call_at` (real time), else a task that sleeps (virtual time).
        accounting: Counts dispatches and their downloads.
        num_clients: Size of the population (the clients' ids are ``0..num_clients - 1``).
        start: Runs tasks: a :data:`StartGroup` runs each in a call of its own, cancelled when the task is released,
            or those dispatched together in one call where ``share``; a :data:`PostTask` (``post``) hands each to its
            client at dispatch, with no coroutine of its own.
        timeout_s: A task not answered this long after dispatch is timed out (None: never).
        mark_used: Told the clients dispatched (e.g. a least-recently-used sampler).
        mark_idle: Told each client whose task was released (e.g. a least-recently-used sampler following the
            tasks in flight, :attr:`busy`).
        on_release: Told each task released (e.g. to forget what a checkpoint would restore for it).
        share: Start the tasks dispatched on one model before the first of them starts in one call of ``start``
            (its answers then depend on nothing but their own timelines: no fault, no task released early by
            another's answer), instead of a call each.
        holding: Tells whether a task's client holds its answer (a trained update waiting for its secure
            aggregation group): such a task does not start again when a checkpoint is resumed.
        on_attach: Told when the registry is attached to the run's task group (what a restored state holds may
            start then).
        post: ``start`` is a :data:`PostTask`.
    """

    def __init__(
        self,
        *,
        bus: EventBus,
        clock: Timer,
        accounting: Accounting,
        num_clients: int,
        start: StartGroup | PostTask,
        timeout_s: float | None = None,
        mark_used: Callable[[list[int]], None] | None = None,
        mark_idle: Callable[[int], None] | None = None,
        on_release: Callable[[TaskAssigned], None] | None = None,
        share: bool = False,
        holding: Callable[[TaskAssigned], bool] | None = None,
        on_attach: Callable[[], None] | None = None,
        post: bool = False,
    ) -> None:
        """Start with no task and no model."""
        if post and share:
            raise ValueError("a registry that posts tasks starts no group: share must be False")
        self._holding = holding
        self._on_attach = on_attach
        self._bus = bus
        self._clock = clock
        self._call_at = clock.call_at if isinstance(clock, CallsAt) else None
        self._accounting = accounting
        self._start_tasks = cast(StartGroup, start)
        self._post = cast(PostTask, start) if post else None
        self.share = share
        self._open: _Group | None = None
        self.timeout_s = timeout_s
        self._mark_used = mark_used
        self._mark_idle = mark_idle
        self._on_release = on_release
        self.current: ModelSnapshot | None = None
        self._bases: dict[Version, ModelSnapshot] = {}
        self._base_refs: Counter[Version] = Counter()
        self._in_flight: dict[ClientId, TaskAssigned] = {}
        self._reserved: list[int] = []  # held by reserve, in flight once assign_reserved gives them their tasks
        self._handles: dict[int, asyncio.Task[None]] = {}
        self._watchdogs: dict[int, _Cancellable] = {}
        self._num_clients = num_clients
        # Tasks dispatched to each client so far, for the clients dispatched to: a population of any size costs its
        # clients that took part, not a counter each.
        self._participations: dict[int, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None

    # ---------------------------------------------------------------------------------------------- tasks
    def attach(self, tg: asyncio.TaskGroup) -> None:
        """Own every task started from now on in ``tg`` (the run's task group)."""
        self._tg = tg
        if self._on_attach is not None:
            self._on_attach()

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Start a background task of the run (cancelled by :meth:`cancel_all`); raise RuntimeError, with ``coro``
        closed unrun, when the registry has no task group or its group has finished."""
        try:
            if self._tg is None:
                raise RuntimeError("the registry has no task group: call attach() inside the run")
            handle = self._tg.create_task(coro, name=name)
        except RuntimeError:
            coro.close()
            raise
        self._tasks.add(handle)
        handle.add_done_callback(self._tasks.discard)
        return handle

    def cancel_all(self) -> None:
        """Cancel every task the registry started and detach from the task group."""
        for task in list(self._tasks):
            task.cancel()
        for watchdog in self._watchdogs.values():
            watchdog.cancel()  # the loop timers (watchdog tasks were cancelled above)
        self._tg = None
        self._open = None

    # --------------------------------------------------------------------------------------------- models
    @property
    def num_clients(self) -> int:
        """Size of the population."""
        return self._num_clients

    def publish(self, snapshot: ModelSnapshot) -> None:
        """Make ``snapshot`` the current model; the previous one is kept only while tasks use it."""
        previous = self.current
        self.current = snapshot
        self._bases[snapshot.version] = snapshot
        if previous is not None and previous.version not in self._base_refs:
            self._bases.pop(previous.version, None)

    def base(self, version: Version) -> ModelSnapshot | None:
        """Return the model of ``version`` if a task in flight started from it (or it is current)."""
        return self._bases.get(version)

    # -------------------------------------------------------------------------------------------- in flight
    def __len__(self) -> int:
        """Count the tasks in flight."""
        return len(self._in_flight)

    def __contains__(self, client_id: object) -> bool:
        """Tell whether ``client_id`` has a task in flight."""
        return client_id in self._in_flight

    def holds(self, task: TaskAssigned) -> bool:
        """Tell whether ``task`` is still in flight (not answered, timed out or abandoned)."""
        return self._in_flight.get(task.client_id) is task

    def __iter__(self) -> Iterator[TaskAssigned]:
        """Iterate over the tasks in flight, oldest first."""
        return iter(sorted(self._in_flight.values(), key=lambda t: t.task_id))

    @property
    def busy(self) -> dict[ClientId, TaskAssigned]:
        """The tasks in flight by client (read-only use)."""
        return self._in_flight

    async def dispatch(
        self, client_id: ClientId | int, snapshot: ModelSnapshot | None = None, *, reply_to: str = CLOUD
    ) -> TaskAssigned:
        """Start a task for ``client_id`` on ``snapshot`` (default: the current model): :meth:`dispatch_many` of one.

        Args:
            client_id: The client.
            snapshot: The model to train from (an edge passes the model it holds).
            reply_to: Where the client uploads (the cloud or an edge's address).
        """
        (task,) = await self.dispatch_many((int(client_id),), snapshot, reply_to=reply_to)
        return task

    async def dispatch_many(
        self,
        client_ids: Sequence[int] | np.ndarray,
        snapshot: ModelSnapshot | None = None,
        *,
        reply_to: str = CLOUD,
    ) -> list[TaskAssigned]:
        """Start a task for each of ``client_ids`` (distinct clients, none in flight) on ``snapshot``, in order:
        :meth:`reserve`, :meth:`assign_reserved`, then :meth:`start_assigned`.

        Args:
            client_ids: The clients.
            snapshot: The model to train from (default: the current model; an edge passes the model it holds).
            reply_to: Where the clients upload (the cloud or an edge's address).
        """
        if snapshot is None:
            snapshot = self.current
            if snapshot is None:
                raise RuntimeError("no model was published before the first dispatch")
        self.reserve(client_ids)
        tasks = self.assign_reserved(snapshot, reply_to=reply_to)
        await self.start_assigned(tasks, snapshot)
        return tasks

    def reserve(self, client_ids: Sequence[int] | np.ndarray) -> None:
        """Hold ``client_ids`` (distinct clients, none in flight) for the tasks :meth:`assign_reserved` puts in
        flight: they count as in flight and are marked used now, so that a later draw sees what it would after their
        tasks; their task ids, participations and downloads wait for :meth:`assign_reserved`."""
        clients = _distinct_ints(client_ids)
        if clients:
            if self._mark_used is not None:
                self._mark_used(clients)
            for client in cast(_ClientIds, clients):  # mostly one (a slot refilled after each upload): no dict built
                self._in_flight[client] = _RESERVED
            self._reserved += clients

    def assign_reserved(self, snapshot: ModelSnapshot, *, reply_to: str = CLOUD) -> list[TaskAssigned]:
        """Put a task on ``snapshot`` in flight for each client :meth:`reserve` held, in the order they were held,
        without announcing or starting it (:meth:`start_assigned` does, for the tasks of one snapshot): each gets the
        next task id and its client's next participation, and counts its download."""
        clients, self._reserved = self._reserved, []
        if not clients:
            return []
        # An edge may still serve a version the cloud has moved past: keep its weights while tasks use it.
        version, bases = snapshot.version, self._bases
        if version not in bases:
            bases[version] = snapshot
        participations = _participations(self._participations, clients)
        now, download, from_cloud = self._clock.now(), snapshot.download_bytes, reply_to == CLOUD
        tasks = _assigned(clients, participations, version, now, reply_to, self._accounting, download, from_cloud)
        self._in_flight.update(zip(cast(_ClientIds, clients), tasks, strict=True))
        self._base_refs[version] += len(tasks)
        return tasks

    async def start_assigned(self, tasks: list[TaskAssigned], snapshot: ModelSnapshot) -> None:
        """Announce ``tasks`` (assigned on ``snapshot`` by :meth:`assign_reserved`) and start them.

        The :class:`TaskAssigned` events go out as one :class:`TasksAssigned` where every observer takes batches (one
        by one otherwise), then the tasks start.
        """
        if not tasks:
            return
        await self._bus.publish_together(TasksAssigned, tasks)
        if self.share and self.timeout_s is None:  # the tasks join one group as they would one by one
            group = self._open
            if group is None or group.snapshot is not snapshot:
                group = self._group_for(snapshot, tasks[0])
            group.tasks += tasks
        else:
            for task in tasks:
                self._start(task, snapshot)

    def _start(self, task: TaskAssigned, snapshot: ModelSnapshot, *, client: bool = True) -> None:
        if client and self._post is not None:
            self._post(task, snapshot)
        elif client and self.share:
            self._group_for(snapshot, task).tasks.append(task)
        elif client:
            name = f"flasync-client-{task.client_id}-task-{task.task_id}"
            self._handles[task.task_id] = self.spawn(self._start_tasks((task,), snapshot), name=name)
        if self.timeout_s is not None:
            self._watchdogs[task.task_id] = self._watchdog(task, self.timeout_s)

    def _group_for(self, snapshot: ModelSnapshot, task: TaskAssigned) -> _Group:
        """Return the open group of tasks on ``snapshot`` whose coroutine has not started, starting one for ``task``
        (the first to join it) if there is none."""
        group = self._open
        if group is None or group.snapshot is not snapshot:
            group = self._open = _Group(snapshot)
            self.spawn(self._run_group(group), name=f"flasync-clients-from-task-{task.task_id}")
        return group

    def _watchdog(self, task: TaskAssigned, limit_s: float) -> _Cancellable:
        """Start timing ``task`` out ``limit_s`` after its dispatch: a loop timer that starts :meth:`_expire` when it
        fires, where the clock offers one, else a task that sleeps until then (the virtual clock's timelines)."""
        when = task.simulated_s + limit_s
        if self._call_at is None:
            return self.spawn(self._watch(task, when, limit_s=limit_s), name=f"flasync-timeout-{task.task_id}")

        def fire() -> None:
            # The task that publishes the timeout takes the timer's place: releasing the task cancels it, as it
            # would cancel a sleeping watchdog.
            if self._watchdogs.get(task.task_id) is handle and self._tg is not None:
                self._watchdogs[task.task_id] = self.spawn(
                    self._expire(task, limit_s), name=f"flasync-timeout-{task.task_id}"
                )

        handle = self._call_at(when, fire)
        return handle

    async def _run_group(self, group: _Group) -> None:
        if self._open is group:
            self._open = None  # later dispatches start a group of their own
        await self._start_tasks(group.tasks, group.snapshot)

    async def _watch(self, task: TaskAssigned, when: float, *, limit_s: float) -> None:
        await self._clock.sleep_until(when)
        await self._expire(task, limit_s)

    async def _expire(self, task: TaskAssigned, limit_s: float) -> None:
        """Time ``task`` out if it is still in flight."""
        current = self._in_flight.get(task.client_id)
        if current is not None and current.task_id == task.task_id:
            await self._bus.publish(
                ClientTimedOut(
                    to=task.reply_to,
                    task_id=task.task_id,
                    client_id=task.client_id,
                    base_version=task.base_version,
                    timeout_s=limit_s,
                    simulated_s=self._clock.now(),
                )
            )

    def hold(self, task: TaskAssigned) -> None:
        """Learn that ``task``'s client holds its answer, a trained update waiting for its secure-aggregation group:
        the task stays in flight (its client takes no other) but its time limit no longer runs."""
        watchdog = self._watchdogs.pop(task.task_id, None)
        if watchdog is not None:
            watchdog.cancel()

    def redispatch(self, answered: set[int] | frozenset[int] = frozenset()) -> None:
        """Start again the tasks a checkpoint had in flight, on their original timelines.

        Args:
            answered: Tasks whose answer the checkpoint holds on its way (only their watchdogs start again).
        """
        holding = self._holding
        for task in self:
            held = holding is not None and holding(task)
            self._start(task, self._bases[task.base_version], client=task.task_id not in answered and not held)
            if held:
                self.hold(task)

    def release(self, message: Answer) -> bool:
        """Close the task ``message`` answers; False if no such task is in flight (nothing changes then)."""
        task = self._in_flight.get(message.client_id)
        if task is None or task.task_id != message.task_id or task.base_version != message.base_version:
            return False
        if task is _RESERVED:
            return False  # a forged answer naming a task not assigned yet
        del self._in_flight[message.client_id]
        if self._mark_idle is not None:
            self._mark_idle(task.client_id)
        if self._handles:  # empty where tasks start in groups or are posted
            handle = self._handles.pop(task.task_id, None)
            if handle is not None and not handle.done():
                handle.cancel()  # a timed-out or abandoned client; one that answered has ended already
        if self._watchdogs:  # empty without a time limit
            watchdog = self._watchdogs.pop(task.task_id, None)
            if watchdog is not None:
                watchdog.cancel()
        if self._on_release is not None:
            self._on_release(task)
        base_version, refs = task.base_version, self._base_refs
        left = refs[base_version] - 1
        if left > 0:
            refs[base_version] = left
        else:
            del refs[base_version]
            if self.current is None or base_version != self.current.version:
                self._bases.pop(base_version, None)
        return True

    def release_all(self) -> int:
        """Release every task in flight (a round closed without them); return how many."""
        released = 0
        for task in self:
            self.release(task)
            released += 1
        return released

    # ---------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the models in use, the participation counters and the tasks in flight (copied).

        The counters are those of the clients dispatched to: ``participation_clients`` (ascending ids) and
        ``participation_counts`` (their tasks so far), int64 tensors of one length, beside ``num_clients``.
        """
        if self.current is None or self._reserved:
            raise RuntimeError("nothing was published yet" if self.current is None else "clients are reserved")
        clients = sorted(self._participations)
        return {
            "snapshot_version": int(self.current.version),
            "bases": [_snapshot_state(self._bases[v]) for v in sorted(self._bases)],
            "num_clients": self._num_clients,
            "participation_clients": torch.tensor(clients, dtype=torch.int64),
            "participation_counts": torch.tensor([self._participations[c] for c in clients], dtype=torch.int64),
            "in_flight": [_task_record(t) for t in self],
        }

    def load_state_dict(self, state: dict[str, Any], *, device: torch.device) -> None:
        """Restore :meth:`state_dict` (before the run starts; :meth:`redispatch` then starts the tasks); a state
        whose ``participations`` is one counter per client (as checkpoints held before) reads too."""
        num_clients, clients, counts = participation_counters(state)
        if num_clients != self._num_clients:
            raise CheckpointError(f"checkpoint has {num_clients} clients, this run {self._num_clients}")
        self._participations = dict(zip(clients.tolist(), counts.tolist(), strict=True))
        self._bases = {
            Version(int(b["version"])): ModelSnapshot(
                version=Version(int(b["version"])),
                weights=b["weights"].to(device),
                exact=b["exact"].to(device),
                download_bytes=int(b["download_bytes"]),
                extra=_extra(b, device),
            )
            for b in state["bases"]
        }
        self.current = self._bases[Version(int(state["snapshot_version"]))]
        self._in_flight = {}
        self._base_refs = Counter()
        for record in state["in_flight"]:
            task = TaskAssigned(
                task_id=int(record["task_id"]),
                client_id=ClientId(int(record["client_id"])),
                participation=int(record["participation"]),
                base_version=Version(int(record["base_version"])),
                simulated_s=float(record["simulated_s"]),
                reply_to=str(record.get("reply_to", CLOUD)),
            )
            self._in_flight[task.client_id] = task
            self._base_refs[task.base_version] += 1


_RESERVED = TaskAssigned(
    task_id=-1, client_id=ClientId(-1), participation=0, base_version=Version(-1), simulated_s=0.0, reply_to=CLOUD
)
"""What :meth:`TaskRegistry.busy` holds for a reserved client until its task is assigned (no upload answers it)."""

_MAKE_TASK = positional(TaskAssigned)
"""A :class:`TaskAssigned` from its fields in order (task id, client, participation, base version, time, reply_to)."""


def _participations(counters: dict[int, int], clients: list[int]) -> list[int]:
    """Return each of ``clients``' participation (its tasks so far) and count one more task for each."""
    participations = [counters.get(client, 0) for client in clients]
    counters.update(zip(clients, [p + 1 for p in participations], strict=True))
    return participations


def _assigned(
    clients: list[int],
    participations: list[int],
    version: Version,
    now: float,
    reply_to: str,
    accounting: Accounting,
    download: int,
    from_cloud: bool,
) -> list[TaskAssigned]:
    """Return the tasks of ``clients`` (distinct) with their ``participations``, numbered by the ``accounting`` that
    counts their dispatches and downloads, in order."""
    ids = accounting.dispatched_many(download, clients, from_cloud=from_cloud)
    # The ints are the client ids they stand for (no NewType call per task); the fields in their order.
    return list(
        map(_MAKE_TASK, ids, cast(_ClientIds, clients), participations, repeat(version), repeat(now), repeat(reply_to))
    )


def _distinct_ints(client_ids: Sequence[int] | np.ndarray) -> list[int]:
    """Return ``client_ids`` as a list of Python ints.

    Raises:
        ValueError: If a client appears twice (a client has one task in flight at most).
    """
    if type(client_ids) is list and len(client_ids) == 1:  # one client: nothing to convert in bulk or compare
        return [int(client_ids[0])]
    if isinstance(client_ids, np.ndarray):
        clients: list[int] = client_ids.reshape(-1).astype(np.int64).tolist()
    else:
        clients = list(map(int, client_ids))
    if len(clients) > 1 and len(set(clients)) != len(clients):
        raise ValueError("dispatch_many takes distinct clients (a client has one task in flight at most)")
    return clients


def _task_record(task: TaskAssigned) -> dict[str, Any]:
    """Return a task in flight as a checkpoint holds it (plain values)."""
    return {
        "task_id": task.task_id,
        "client_id": int(task.client_id),
        "participation": task.participation,
        "base_version": int(task.base_version),
        "simulated_s": task.simulated_s,
        "reply_to": task.reply_to,
    }


def participation_counters(state: dict[str, Any]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Return a registry state's population size, the clients dispatched to and their counts (int64 tensors).

    Reads :meth:`TaskRegistry.state_dict`'s counters, and a dense ``participations`` tensor of one counter per client
    (its clients with a count above zero).

    Raises:
        CheckpointError: If neither is there, or the dense counters are not a 1-D tensor.
    """
    dense = state.get("participations")
    if dense is not None:
        if not isinstance(dense, torch.Tensor) or dense.dim() != 1:
            raise CheckpointError("checkpoint field registry.participations: must be a 1-D tensor")
        touched = torch.nonzero(dense, as_tuple=True)[0].to(torch.int64)
        return int(dense.numel()), touched, dense[touched].to(torch.int64)
    num_clients = state.get("num_clients")
    clients, counts = state.get("participation_clients"), state.get("participation_counts")
    if isinstance(num_clients, bool) or not isinstance(num_clients, int):
        raise CheckpointError("checkpoint field registry.num_clients: missing or not an integer")
    for key, value in (("participation_clients", clients), ("participation_counts", counts)):
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point():
            raise CheckpointError(f"checkpoint field registry.{key}: must be a 1-D integer tensor")
    assert isinstance(clients, torch.Tensor) and isinstance(counts, torch.Tensor)
    if clients.shape != counts.shape:
        raise CheckpointError("checkpoint field registry.participation_counts: not one count per client")
    return num_clients, clients.to(torch.int64), counts.to(torch.int64)


def _snapshot_state(snapshot: ModelSnapshot) -> dict[str, Any]:
    state: dict[str, Any] = {
        "version": int(snapshot.version),
        "weights": snapshot.weights.clone(),
        "exact": snapshot.exact.clone(),
        "download_bytes": snapshot.download_bytes,
    }
    if snapshot.extra is not None:
        state["extra"] = snapshot.extra.clone()
    return state


def _extra(state: dict[str, Any], device: torch.device | str) -> torch.Tensor | None:
    """Return a checkpointed snapshot's extra (``control`` in checkpoints written before it was named so)."""
    value = state.get("extra", state.get("control"))
    return value.to(device) if value is not None else None
