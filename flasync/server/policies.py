"""Policies: when tasks start and when a new version is due, behind one Protocol the server loop drives.

* :class:`AsyncSlots` (FedBuff, FedAsync): ``concurrency`` tasks always in flight; each answer frees a slot that
  is refilled at once; the aggregator says when a version is due.
* :class:`SyncRounds` (FedAvg): each round samples a cohort (over-selected by ``over_selection``) and closes once
  ``quorum`` of ``clients_per_round`` answered, its deadline passed, or nothing is left in flight; the clients
  still training are abandoned (McMahan et al., AISTATS 2017; Bonawitz et al., MLSys 2019 for over-selection).
* :class:`TreeRounds` (HierFAVG, Liu et al., ICC 2020): each cloud round samples a cohort and lets every top edge
  with members in it run its ``kappa2`` edge rounds; the round closes once every such edge forwarded its partial.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from flasync.core.bus import EventBus
from flasync.core.events import EdgeForwarded, RoundDeadlinePassed, Version
from flasync.core.snapshots import ModelSnapshot
from flasync.server.accounting import Accounting
from flasync.server.registry import TaskRegistry, Timer
from flasync.server.sampler import ClientSampler

if TYPE_CHECKING:
    from flasync.server.edges import EdgeNetwork

__all__ = ["AsyncSlots", "IdleWait", "Policy", "SyncRounds", "TreeRounds"]


_MIN_CLIENTS_POLL_S = 0.25
"""How often a round waiting for server.min_clients looks again, in seconds."""


class IdleWait:
    """A policy's wait for clients to come online, which a stop request cuts short.

    With no client online and no task in flight a policy sleeps until the next client comes online; a served run
    with no device connected would sleep until one connects, the stop request waiting in the inbox unread. On a
    wall clock the sleep ends at a stop request; a virtual clock (``virtual`` true, or no such attribute) is awaited
    as it is: its time jumps to the next client at once.
    """

    def __init__(self) -> None:
        self.stopping = False
        self._woken: asyncio.Event | None = None

    async def until(self, clock: Timer, when: float) -> bool:
        """Sleep until ``clock`` reads ``when``; False when a stop request came before or cut the sleep short."""
        if self.stopping:
            return False
        if getattr(clock, "virtual", True):
            await clock.sleep_until(when)
            return not self.stopping
        woken = self._woken = asyncio.Event()
        sleeper = asyncio.ensure_future(clock.sleep_until(when))
        waker = asyncio.ensure_future(woken.wait())
        try:
            await asyncio.wait({sleeper, waker}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            waker.cancel()
            self._woken = None
        return not self.stopping

    def wake(self) -> None:
        """End the wait now and every later one: the run is stopping."""
        self.stopping = True
        if self._woken is not None:
            self._woken.set()


class Policy(Protocol):
    """When tasks start and when the loop makes a new version.

    Attributes:
        rounds: Stop conditions are checked only when a version is due (between rounds), not after every message.
        interruptible: A stop request ends the run in the middle of a round (its state is checkpointed there).
        abandons: A message may make the policy release tasks still in flight (a round closing on its quorum or
            deadline): answers due at one time must then reach the loop one at a time, so that none of them comes
            from a task abandoned by an earlier one.
    """

    rounds: bool
    interruptible: bool
    abandons: bool

    def start(self) -> None:
        """Start what runs beside the loop for the whole run (e.g. async edges)."""
        ...

    idle: IdleWait
    """Its wait for clients to come online, which :meth:`flasync.server.Server.request_stop` ends."""

    async def fill(self) -> None:
        """Start the tasks the policy wants in flight now (none once its :attr:`idle` wait is stopping)."""
        ...

    def note(self, message: object, *, accepted: bool) -> None:
        """Learn of a message the loop handled (``accepted``: it was an update folded in)."""
        ...

    def step_due(self) -> bool:
        """Tell whether the loop should make a new version now."""
        ...

    def close_step(self) -> None:
        """End the aggregation period before its version is made (a round abandons its stragglers)."""
        ...

    def published(self, snapshot: ModelSnapshot) -> None:
        """Learn of a new model (e.g. send it down to the edges)."""
        ...

    def resumed(self) -> None:
        """Restart the timers of a restored state (after :meth:`load_state_dict`, inside the run)."""
        ...

    def answered(self) -> set[int]:
        """Tasks in flight whose answer the policy's state holds on its way (they must not run again)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Return the policy's state for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


class AsyncSlots:
    """Keep ``concurrency`` tasks in flight; a version is due when the aggregator says so.

    Args:
        concurrency: Tasks in flight.
        registry: Dispatches tasks.
        sampler: Draws idle clients.
        clock: Waits for a client to come online.
        ready: The aggregator's "a version is due".
        edges: Async edges that relay each new model down (None: a flat run).
        accounting: Counts the bytes sent to the edges.
    """

    rounds = False
    interruptible = False

    def __init__(
        self,
        *,
        concurrency: int,
        registry: TaskRegistry,
        sampler: ClientSampler,
        clock: Timer,
        ready: Callable[[], bool],
        accounting: Accounting,
        edges: EdgeNetwork | None = None,
    ) -> None:
        """Bind the registry and the sampler."""
        self.concurrency = concurrency
        self.registry = registry
        self.sampler = sampler
        self.idle = IdleWait()
        """Its wait for clients to come online (a stop request ends it)."""
        self.clock = clock
        self.ready = ready
        self.accounting = accounting
        self.edges = edges
        self.abandons = edges is not None  # edges close rounds of their own
        self._quick_one = sampler.quick_one

    def start(self) -> None:
        """Start every edge's receive loop."""
        if self.edges is not None:
            self.edges.start()

    async def fill(self) -> None:
        """Refill the free slots with newly sampled idle clients.

        A flat run draws a client for every free slot first (each draw excluding those before it) and dispatches
        them together; where a draw finds no idle client online, those drawn are dispatched and the free slots are
        filled at the next message, or, with no task in flight, once the next client comes online.
        """
        if self.edges is not None:
            await self._fill_from_edges(self.edges)
            return
        while True:
            every = self.refill()
            await self.start_refilled()
            if every:
                return  # every slot is taken (only the loop, awaiting this, releases tasks)
            if len(self.registry):
                return  # the free slots are filled at the next message
            if not await self.idle.until(self.clock, self.sampler.next_online(self.clock.now())):
                return  # stopping

    @property
    def refills_at_once(self) -> bool:
        """Tell whether :meth:`refill` may stand for :meth:`fill` between two uploads of a batch: a flat run in which
        every client is always online (a draw then always finds one, and :meth:`fill` never waits or goes by edge)."""
        return self.edges is None and self.sampler.faults is None

    def refill(self) -> bool:
        """Draw a client for every free slot (each draw excluding those before it) and reserve it at once
        (:meth:`~flasync.server.registry.TaskRegistry.reserve`); :meth:`start_refilled` gives the reserved clients
        their tasks on the current model, announces and starts them. Return whether every free slot was filled (a draw
        may find no idle client online; with :attr:`refills_at_once` one always does).

        :meth:`fill` is this, the start, and a wait where no client is online; between two uploads of a batch, this
        alone (the state each draw sees is the one :meth:`fill` after each upload would see)."""
        registry = self.registry
        free = self.concurrency - len(registry)
        if free <= 0:
            return True
        if free == 1 and self._quick_one is not None:  # one slot, as after each upload: no lists where it can
            client = self._quick_one(registry.busy)
            if client is not None:
                registry.reserve([client])
                return True
        drawn = self.sampler.sample_idle_many(registry.busy, self.clock.now(), free)
        registry.reserve(drawn)
        return len(drawn) == free

    async def start_refilled(self) -> None:
        """Give the clients :meth:`refill` reserved since the last call their tasks on the current model, in the order
        they were drawn, then announce and start them."""
        snapshot = self.registry.current
        assert snapshot is not None, "the server publishes a model before it fills its slots"
        await self.registry.start_assigned(self.registry.assign_reserved(snapshot), snapshot)

    async def _fill_from_edges(self, edges: EdgeNetwork) -> None:
        """Refill the free slots one client at a time, each on its edge's model and answering to its edge."""
        registry = self.registry
        while len(registry) < self.concurrency:
            client_id = self.sampler.sample_idle(registry.busy, self.clock.now())
            if client_id is None:
                if len(registry):
                    return  # the free slots are filled at the next message
                if not await self.idle.until(self.clock, self.sampler.next_online(self.clock.now())):
                    return  # stopping
                continue
            await registry.dispatch(
                client_id, edges.snapshot_for(client_id) or registry.current, reply_to=edges.address_of(client_id)
            )

    def note(self, message: object, *, accepted: bool) -> None:
        """Nothing to learn: slots are refilled by :meth:`fill`."""

    def step_due(self) -> bool:
        """Ask the aggregator."""
        return self.ready()

    def close_step(self) -> None:
        """Nothing to close: tasks keep running across versions."""

    def published(self, snapshot: ModelSnapshot) -> None:
        """Send the model down to the top edges (they relay it further)."""
        if self.edges is not None:
            self.accounting.egress(self.edges.publish(snapshot))

    def resumed(self) -> None:
        """Restart the edges' timers."""
        if self.edges is not None:
            self.edges.resumed()

    def answered(self) -> set[int]:
        """Tasks whose uploads edges were relaying when the state was taken."""
        return self.edges.answered() if self.edges is not None else set()

    def state_dict(self) -> dict[str, Any]:
        """Return the edges' state (a flat run has none)."""
        return {"edges": None if self.edges is None else self.edges.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if self.edges is not None:
            self.edges.load_state_dict(state["edges"])


@dataclass(slots=True)
class _Round:
    """The sync round in progress."""

    version: int
    target: int
    started_s: float
    deadline_s: float | None
    accepted: int = 0
    deadline_passed: bool = False


class SyncRounds:
    """Synchronous rounds with a quorum, a deadline and over-selection.

    Args:
        clients_per_round: ``K``, the clients a round wants.
        over_selection: Sample ``ceil((1 + x) K)`` clients (at most the population).
        quorum: The round closes once ``ceil(quorum K)`` answered.
        deadline_s: The round closes this long after it started (None: no deadline).
        registry: Dispatches and abandons tasks.
        sampler: Draws cohorts.
        clock: Times the deadline.
        bus: Carries the deadline notice to the loop.
        accounting: Counts abandoned tasks.
        log: The run's logger.
        min_clients: Open a round only once this many clients are online (None: once one is).
        min_clients_wait_s: Longest wait for ``min_clients``; then the round opens with the clients online.
    """

    rounds = True
    interruptible = True

    def __init__(
        self,
        *,
        clients_per_round: int,
        over_selection: float,
        quorum: float,
        deadline_s: float | None,
        registry: TaskRegistry,
        sampler: ClientSampler,
        clock: Timer,
        bus: EventBus,
        accounting: Accounting,
        log: Any,
        min_clients: int | None = None,
        min_clients_wait_s: float = 60.0,
    ) -> None:
        """Start with no round open."""
        self.min_clients = min_clients
        self.min_clients_wait_s = min_clients_wait_s
        self.cohort_size = min(len(sampler.population), math.ceil((1.0 + over_selection) * clients_per_round - 1e-9))
        self.target = max(1, math.ceil(quorum * clients_per_round - 1e-9))
        self.deadline_s = deadline_s
        self.abandons = self.target < self.cohort_size or deadline_s is not None
        self.registry = registry
        self.sampler = sampler
        self.idle = IdleWait()
        """Its wait for clients to come online (a stop request ends it)."""
        self.clock = clock
        self.bus = bus
        self.accounting = accounting
        self.log = log
        self._round: _Round | None = None
        self._deadline: Any = None

    def start(self) -> None:
        """Nothing runs beside the loop."""

    async def fill(self) -> None:
        """Open a round if none is open: draw a cohort of online clients and dispatch it."""
        if self._round is not None:
            return
        clock = self.clock
        await self._wait_for_clients()
        while True:
            cohort = self.sampler.cohort(self.cohort_size, clock.now())
            if cohort is not None:
                break
            if not await self.idle.until(clock, self.sampler.next_online(clock.now())):
                return  # stopping: no round opens
        now = clock.now()
        current = self.registry.current
        assert current is not None
        deadline = None if self.deadline_s is None else now + self.deadline_s
        self._round = _Round(version=int(current.version), target=self.target, started_s=now, deadline_s=deadline)
        self._start_deadline()
        await self.registry.dispatch_many(cohort)

    async def _wait_for_clients(self) -> None:
        """Wait until ``min_clients`` clients are online, at most ``min_clients_wait_s`` (then say so and go on)."""
        wanted, clock = self.min_clients, self.clock
        if wanted is None:
            return
        start = clock.now()
        while (online := self.sampler.online_count(clock.now())) < wanted and not self.idle.stopping:
            waited = clock.now() - start
            if waited >= self.min_clients_wait_s:
                self.log.warning(
                    "round.min_clients_not_reached",
                    message=f"{online} of the {wanted} clients server.min_clients asks for were online after "
                    f"{waited:.0f} s: the round opens with them",
                    online=online,
                    wanted=wanted,
                    metrics=False,
                )
                return
            await clock.sleep(min(_MIN_CLIENTS_POLL_S, self.min_clients_wait_s - waited))

    def _start_deadline(self) -> None:
        round_ = self._round
        if round_ is None or round_.deadline_s is None or round_.deadline_passed:
            return
        self._deadline = self.registry.spawn(self._deadline_timer(round_), "flasync-round-deadline")

    async def _deadline_timer(self, round_: _Round) -> None:
        assert round_.deadline_s is not None
        await self.clock.sleep_until(round_.deadline_s)
        if self._round is round_:
            await self.bus.publish(RoundDeadlinePassed(version=Version(round_.version), simulated_s=self.clock.now()))

    def note(self, message: object, *, accepted: bool) -> None:
        """Count an accepted member; mark the deadline passed."""
        round_ = self._round
        if round_ is None:
            return
        if accepted:
            round_.accepted += 1
        elif isinstance(message, RoundDeadlinePassed) and message.version == round_.version:
            round_.deadline_passed = True

    def step_due(self) -> bool:
        """Tell whether the open round is over (quorum, deadline, or nothing left in flight)."""
        round_ = self._round
        if round_ is None:
            return False
        return not len(self.registry) or round_.accepted >= round_.target or round_.deadline_passed

    def close_step(self) -> None:
        """End the round: abandon the tasks still in flight (over-selected, late or hanging clients)."""
        round_ = self._round
        self._round = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        abandoned = self.registry.release_all()
        self.accounting.abandoned(abandoned)
        if round_ is not None:
            self.log.debug(
                "server.round",
                step=round_.version,
                accepted=round_.accepted,
                abandoned=abandoned,
                deadline_passed=int(round_.deadline_passed),
                simulated_s=self.clock.now(),
            )

    def published(self, snapshot: ModelSnapshot) -> None:
        """Nothing to do: rounds dispatch from the current model."""

    def resumed(self) -> None:
        """Restart the open round's deadline timer."""
        self._start_deadline()

    def answered(self) -> set[int]:
        """Return nothing: answers go straight to the cloud."""
        return set()

    def state_dict(self) -> dict[str, Any]:
        """Return the open round."""
        return {"round": None if self._round is None else asdict(self._round)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        round_ = state["round"]
        self._round = None if round_ is None else _Round(**round_)


class TreeRounds:
    """HierFAVG cloud rounds: the top edges with cohort members run their edge rounds and forward one partial each.

    Args:
        clients_per_round: The cloud cohort's size.
        edges: The edges.
        registry: Holds the current model.
        sampler: Draws cohorts.
        clock: Waits for clients to come online.
        accounting: Counts the model bytes sent to the edges.
    """

    rounds = True
    interruptible = False
    abandons = True  # edges close rounds of their own

    def __init__(
        self,
        *,
        clients_per_round: int,
        edges: EdgeNetwork,
        registry: TaskRegistry,
        sampler: ClientSampler,
        clock: Timer,
        accounting: Accounting,
    ) -> None:
        """Start with no round open."""
        self.clients_per_round = clients_per_round
        self.edges = edges
        self.registry = registry
        self.sampler = sampler
        self.idle = IdleWait()
        """Its wait for clients to come online (a stop request ends it)."""
        self.clock = clock
        self.accounting = accounting
        self._pending: int | None = None

    def start(self) -> None:
        """Nothing runs beside the loop: edges run their rounds when asked."""

    async def fill(self) -> None:
        """Open a cloud round if none is open."""
        if self._pending is not None:
            return
        clock = self.clock
        while True:
            cohort = self.sampler.cohort(self.clients_per_round, clock.now())
            if cohort is not None:
                break
            if not await self.idle.until(clock, self.sampler.next_online(clock.now())):
                return  # stopping: no round opens
        snapshot = self.registry.current
        assert snapshot is not None
        self._pending = self.edges.sync_round(snapshot, set(cohort.tolist()))
        self.accounting.egress(self._pending * snapshot.download_bytes)

    def note(self, message: object, *, accepted: bool) -> None:
        """Count a top edge's partial."""
        if isinstance(message, EdgeForwarded) and self._pending is not None:
            self._pending -= 1

    def step_due(self) -> bool:
        """Tell whether every active top edge forwarded its partial."""
        return self._pending == 0

    def close_step(self) -> None:
        """Close the cloud round."""
        self._pending = None

    def published(self, snapshot: ModelSnapshot) -> None:
        """Nothing to do: each round sends the current model down."""

    def resumed(self) -> None:
        """Nothing to restart: checkpoints are taken between rounds."""

    def answered(self) -> set[int]:
        """Return nothing: no task is in flight between rounds."""
        return set()

    def state_dict(self) -> dict[str, Any]:
        """Return the edges' counters (no round is open between rounds)."""
        return {"edges": self.edges.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.edges.load_state_dict(state["edges"])
