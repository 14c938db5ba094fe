"""Secure aggregation among simulated clients: each holds its trained update until its group is complete.

Under ``[secure_aggregation]`` a simulated client that finished training does not upload its delta. It keeps it,
online, in the :class:`SecureRoom` (the clients' side of the run, as every simulated client's state is), and its
task stays in flight, so the sampler hands that client nothing while it waits. A group is complete when

* FedBuff: ``buffer_size`` clients hold updates: the buffer is the first ``K`` clients to finish training after
  the previous buffer closed (Nguyen et al., AISTATS 2022), and the version it steps from is named then;
* FedAvg: every task of the round still in flight holds its update (the others failed and were released).

The group then runs SecAgg+ (:class:`~flasync.secure.SecureAggregator`: X25519, HKDF, AES-GCM, Shamir shares,
every message through its wire form) in a worker thread. Each member weights its own update before masking
(staleness weight of ``version - base_version`` times its example weight, over the run's largest example weight),
the group's server side (:class:`~flasync.secure.SecAggServer`) holds only masked ring vectors and unmasks their
sum, and each of the four rounds lasts, in virtual time, as long as its slowest member's transfers on that member's
own link (the population's network model) plus the round trip. A member whose availability window closes before
its group starts drops out at round 0; one whose window closes while the protocol runs drops out at the round
during which it goes offline (the rounds' times are known from their prices), recovered with the others' shares up
to the threshold, or the group is abandoned. When the protocol ends the room publishes a
:class:`~flasync.core.events.SecureGroupClosed` with the weighted sum to the cloud, which folds it in and releases
the members' tasks. Groups run one after the other, so each names the version its sum will step.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from flasync.aggregation import ExampleWeight, StalenessWeight
from flasync.clients.simulated.population import Network
from flasync.core.bus import EventBus
from flasync.core.clock import Clock
from flasync.core.errors import BusFull
from flasync.core.events import CLOUD, SecureGroupClosed, TaskAssigned, Version
from flasync.secure import ClientUpdate, GroupReport, Phase, PhaseCost, SecureAggregator
from flasync.secure.ring import RingVector

__all__ = ["SecureRoom"]

_VERSION_BYTES = 8
"""What the server sends each member of a buffer with round 0: the version the buffer steps from."""


@dataclass(frozen=True, slots=True)
class _Held:
    """A client that finished training and holds its update until its group is complete."""

    task: TaskAssigned
    delta: torch.Tensor
    num_samples: int
    held_s: float


@dataclass(frozen=True, slots=True)
class _Group:
    """A complete group waiting for (or running) its protocol."""

    members: tuple[_Held, ...]
    closed_s: float


class SecureRoom:
    """The clients that hold their updates for secure aggregation, and their groups' protocol runs.

    Args:
        aggregator: Runs one group through SecAgg+ (its seed draws keys, graphs and dropouts per group and client).
        buffer_size: FedBuff's ``K`` (None: FedAvg, one group per round).
        staleness: ``s(tau)`` each FedBuff member applies to itself.
        example_weight: ``e(n)`` of a client with ``n`` samples.
        example_scale: Example weights are divided by it (weights must land in ``[0, 1]``).
        network: Each client's link; a protocol round lasts as long as its slowest member's transfers.
        clock: The run's clock.
        bus: Where each group's end goes (to the cloud).
        pool: Where the protocol's cryptography runs (off the event loop).
        in_flight: The tasks in flight (the registry's): a FedAvg round is complete when each of them holds.
        spawn: Starts a background task of the run (the registry's), cancelled at its end.
        held: Told each task whose client holds its update (the registry's: its time limit stops).
        online: Tells whether a client is online at a time (the availability windows; None: always): a member
            offline when its group starts drops out at the first round.
        offline_at: When a client online at a time next goes offline (the availability windows; None: never): a
            member drops out at the protocol round during which its window closes.
        observe: Called with each masked input the group's server side receives (instrumentation; None: nothing).
    """

    name = "secure_aggregation"

    def __init__(
        self,
        *,
        aggregator: SecureAggregator,
        buffer_size: int | None,
        staleness: StalenessWeight,
        example_weight: ExampleWeight,
        example_scale: float,
        network: Network,
        clock: Clock,
        bus: EventBus,
        pool: Executor,
        in_flight: Callable[[], Iterable[TaskAssigned]],
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
        held: Callable[[TaskAssigned], None] = lambda task: None,
        online: Callable[[int, float], bool] | None = None,
        offline_at: Callable[[int, float], float] | None = None,
        observe: Callable[[int, RingVector], None] | None = None,
    ) -> None:
        """Start with nobody waiting."""
        self.aggregator = aggregator
        self.buffer_size = buffer_size
        self.staleness = staleness
        self.example_weight = example_weight
        self.example_scale = example_scale
        self.network = network
        self.clock = clock
        self.bus = bus
        self.pool = pool
        self.in_flight = in_flight
        self.spawn = spawn
        self.held = held
        self.online = online
        self.offline_at = offline_at
        self.observe = observe
        self.waiting: list[_Held] = []
        self.pending: deque[_Group] = deque()
        self.version = 0
        self.groups = 0
        self._driver: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------- the clients' side
    def holds(self, task: TaskAssigned) -> bool:
        """Tell whether ``task``'s client holds its update here (waiting, or in a group not closed yet): such a
        task does not train again when a checkpoint is resumed."""
        return task.task_id in self.held_tasks()

    def hold(self, task: TaskAssigned, delta: torch.Tensor, num_samples: int, at: float) -> None:
        """Keep a trained update (its delta, float32, read and kept) until its group is complete at time ``at``."""
        self.waiting.append(_Held(task, delta.to(torch.float32).clone(), num_samples, at))
        self.held(task)
        self._close_groups(at)

    def released(self, task: TaskAssigned) -> None:
        """Learn that the server released ``task`` (its failure may complete a round's group)."""
        if self.buffer_size is None and self.waiting:
            self._close_groups(self.clock.now())

    def attached(self) -> None:
        """Start the groups a restored state holds, once the run's task group exists."""
        self._start()

    def _close_groups(self, now: float) -> None:
        """Form the complete groups of the clients waiting, and start their protocol."""
        k = self.buffer_size
        if k is not None:
            while len(self.waiting) >= k:
                members, self.waiting = self.waiting[:k], self.waiting[k:]
                self.pending.append(_Group(tuple(members), members[-1].held_s))
        else:
            held = {h.task.task_id for h in self.waiting}
            if all(task.task_id in held for task in self.in_flight()):
                self.pending.append(_Group(tuple(self.waiting), now))
                self.waiting = []
        self._start()

    def _start(self) -> None:
        if self.pending and (self._driver is None or self._driver.done()):
            self._driver = self.spawn(self._drain(), "flasync-secure-aggregation")

    # ------------------------------------------------------------------------------------------ the protocol
    async def _drain(self) -> None:
        """Run the complete groups one after the other (each names the version its sum steps)."""
        while self.pending:
            await self._run(self.pending[0])

    def _weights(self, held: _Held, version: int) -> ClientUpdate:
        """Return what a member computes itself once the server named its group's version: its two weights."""
        example = min(1.0, self.example_weight(held.num_samples) / self.example_scale)
        staleness = self.staleness(version - int(held.task.base_version)) if self.buffer_size is not None else 1.0
        return ClientUpdate(int(held.task.client_id), held.delta, min(1.0, staleness * example), example)

    def _price(self, cost: PhaseCost) -> float:
        """Return a protocol round's simulated seconds: its slowest member's transfers on its own link."""
        network = self.network
        clients = cost.upload_bytes.keys() | cost.download_bytes.keys()
        return max(
            (
                network.upload_seconds(c, cost.upload_bytes.get(c, 0))
                + network.download_seconds(c, cost.download_bytes.get(c, 0))
                for c in clients
            ),
            default=0.0,
        )

    def _protocol(self, group_id: int, updates: list[ClientUpdate], now: float) -> tuple[GroupReport, float]:
        """Run one group starting at ``now`` (worker thread); return its report and the CPU seconds it took."""
        started = time.thread_time()
        clients = [u.client for u in updates]
        drops = self.aggregator.drops(group_id, clients)
        if self.online is not None:  # a member whose availability window closed before its group started
            drops.update({c: Phase.ADVERTISE for c in clients if not self.online(c, now)})
        if self.offline_at is None:
            return self._aggregate(group_id, updates, drops, self.observe), time.thread_time() - started
        offline_at = self.offline_at
        closing = {c: offline_at(c, now) for c in clients if drops.get(c) != Phase.ADVERTISE}
        report = self._window_drops(group_id, updates, drops, closing, now)
        if self.observe is not None:  # the instrumentation sees the masked inputs of the run that stands
            report = self._aggregate(group_id, updates, drops, self.observe)
        return report, time.thread_time() - started

    def _aggregate(
        self,
        group_id: int,
        updates: list[ClientUpdate],
        drops: Mapping[int, Phase],
        observe: Callable[[int, RingVector], None] | None = None,
    ) -> GroupReport:
        """Run one group's protocol with ``drops`` (worker thread)."""
        return self.aggregator.aggregate(
            group_id,
            updates,
            drops=drops,
            announce_bytes=_VERSION_BYTES if self.buffer_size is not None else 0,
            observe=observe,
            price=self._price,
        )

    def _window_drops(
        self,
        group_id: int,
        updates: list[ClientUpdate],
        drops: dict[int, Phase],
        closing: Mapping[int, float],
        now: float,
    ) -> GroupReport:
        """Drop each member at the round during which its availability window closes (``closing``: when).

        The rounds run from ``now`` one after the other, each as long as its price. Round by round, a member still
        in the protocol whose window closes before the round ends sends nothing from that round on; the group is
        run again with it dropping there, and the next rounds start when that shorter round ends. The same drops
        and prices give the same times, so the outcome is deterministic. ``drops`` is updated in place.
        """
        report = self._aggregate(group_id, updates, drops)
        start = now
        for phase in Phase:
            end = start + report.phase_s[phase.name.lower()]
            late = [c for c, at in closing.items() if drops.get(c, len(Phase)) > phase and at < end]
            if late:
                drops.update(dict.fromkeys(late, phase))
                report = self._aggregate(group_id, updates, drops)
                end = start + report.phase_s[phase.name.lower()]
            start = end
        return report

    async def _run(self, group: _Group) -> None:
        """Run ``group``'s protocol from now; publish its end to the cloud when its last round is over."""
        clock = self.clock
        members = group.members
        version = self.version if self.buffer_size is not None else int(members[0].task.base_version)
        updates = [self._weights(held, version) for held in members]
        job = functools.partial(self._protocol, self.groups, updates, clock.now())
        report, cpu_s = await clock.run(self.pool, job)
        await clock.sleep_until(clock.now() + sum(report.phase_s.values()))
        figures = {**report.figures(), "secagg.cpu_s": cpu_s, "secagg.protocol_s": clock.now() - group.closed_s}
        message = SecureGroupClosed(
            to=CLOUD,
            group=self.groups,
            version=Version(version),
            members=tuple(held.task for held in members),
            survivors=report.survivors,
            dropped=report.dropped,
            recovered=len(report.recovered),
            weighted_sum=b"" if report.weighted_sum is None else report.weighted_sum.numpy().tobytes(),
            example_weight=report.total_weight,
            upload_bytes=dict(report.upload_bytes),
            download_bytes=dict(report.download_bytes),
            figures=figures,
            reason=report.reason,
            simulated_s=clock.now(),
        )
        # The room's state and the message change together: a checkpoint sees the group pending, or its end sent.
        self.pending.popleft()
        self.groups += 1
        if self.buffer_size is not None and not report.abandoned:
            self.version += 1
        try:
            self.bus.publish_nowait(message)
        except BusFull:
            await self.bus.publish(message)

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the clients waiting with their updates and the groups not closed yet (copied)."""

        def held(h: _Held) -> dict[str, Any]:
            return {"task": h.task.task_id, "delta": h.delta.clone(), "num_samples": h.num_samples, "at": h.held_s}

        return {
            "version": self.version,
            "groups": self.groups,
            "waiting": [held(h) for h in self.waiting],
            "pending": [{"members": [held(h) for h in g.members], "closed_s": g.closed_s} for g in self.pending],
        }

    def load_state_dict(self, state: Mapping[str, Any], tasks: Mapping[int, TaskAssigned]) -> None:
        """Restore :meth:`state_dict`; ``tasks`` are the tasks in flight by id (the registry's, restored)."""
        if not state:
            return

        def held(h: Mapping[str, Any]) -> _Held:
            return _Held(tasks[int(h["task"])], h["delta"].clone(), int(h["num_samples"]), float(h["at"]))

        self.version = int(state["version"])
        self.groups = int(state["groups"])
        self.waiting = [held(h) for h in state["waiting"]]
        self.pending = deque(
            _Group(tuple(held(h) for h in g["members"]), float(g["closed_s"])) for g in state["pending"]
        )

    def held_tasks(self) -> set[int]:
        """Return the ids of the tasks whose clients hold their updates here (they must not train again)."""
        ids = {h.task.task_id for h in self.waiting}
        ids.update(h.task.task_id for group in self.pending for h in group.members)
        return ids
