"""The server loop: receive -> route -> admit and fold -> new version (publish, evaluate, checkpoint, stop).

The loop knows nothing of the aggregation mode: a :class:`~flasync.server.policies.Policy` decides when tasks
start and when a version is due, an :class:`~flasync.aggregation.Aggregator` how updates combine, the
:class:`~flasync.server.receiver.CloudReceiver` (over an :class:`~flasync.server.node.AggregationNode` and the
:class:`~flasync.server.intake.Intake`) which updates are admitted, folded in and counted, the
:class:`~flasync.server.versions.VersionMaker` how a version is made, published and evaluated,
:class:`~flasync.server.stopping.StopRules` when the run ends, the :class:`~flasync.server.registry.TaskRegistry`
which tasks are in flight, and :class:`~flasync.server.accounting.Accounting` what every outcome and byte counts
for. :meth:`Server.state_dict` composes the components' states into one checkpoint; :meth:`Server.load_state_dict`
continues a run exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from flasync.aggregation import Aggregator
from flasync.codecs import Pipeline
from flasync.core.bus import EventBus
from flasync.core.clock import Clock
from flasync.core.errors import BusClosed, BusFull, CheckpointError
from flasync.core.events import (
    CLOUD,
    ClientConnected,
    ClientFailed,
    ClientTimedOut,
    EdgeForwarded,
    RoundDeadlinePassed,
    RunFinished,
    SecureGroupClosed,
    StopRequested,
    TaskClosed,
    UpdatesUploaded,
    UpdateUploaded,
    Version,
)
from flasync.server.accounting import Accounting, ServerStats
from flasync.server.edges import message_from_state, message_state, relayed
from flasync.server.intake import Decoded, Intake
from flasync.server.node import AggregationNode
from flasync.server.policies import AsyncSlots, Policy
from flasync.server.receiver import CloudReceiver
from flasync.server.registry import TaskRegistry
from flasync.server.sampler import ClientSampler
from flasync.server.stopping import INTERRUPTED, StopRules
from flasync.server.versions import Evaluator, VersionMaker
from flasync.training.plugins import ServerPlugin

__all__ = ["INTERRUPTED", "Evaluator", "Server", "ServerMessage", "Stateful", "StopRules"]

ServerMessage = (
    UpdateUploaded
    | UpdatesUploaded
    | ClientFailed
    | EdgeForwarded
    | TaskClosed
    | ClientTimedOut
    | RoundDeadlinePassed
    | StopRequested
    | ClientConnected
    | SecureGroupClosed
)
_RECEIVES = (
    UpdateUploaded,
    UpdatesUploaded,
    ClientFailed,
    EdgeForwarded,
    TaskClosed,
    ClientTimedOut,
    RoundDeadlinePassed,
    StopRequested,
    ClientConnected,
    SecureGroupClosed,
)  # the types of ServerMessage, which the cloud's inbox takes


class Stateful(Protocol):
    """A component whose state a checkpoint holds."""

    def state_dict(self) -> dict[str, Any]:
        """Return the state (plain values and tensors, copied)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


class Server:
    """The cloud of one run.

    Args:
        weights: Initial flat global weights; the server owns and updates this tensor.
        bus: The run's event bus (the server subscribes at the cloud's address).
        clock: The run's clock.
        wall: Monotonic real seconds.
        log: The run's logger.
        aggregator: Folds updates and steps ``weights``.
        policy: Starts tasks and says when a version is due.
        registry: The tasks in flight and their base models.
        intake: Admits updates.
        accounting: Counts outcomes and bytes.
        sampler: Draws clients (its random state is checkpointed here).
        download_codec: Encodes each published model once.
        edge_codec: Decodes the partials edges send up.
        evaluate: Evaluates a model off the loop.
        rules: Stop conditions, evaluation and checkpoint periods.
        inbox_capacity: Bound of the server's inbox.
        download_generator: The download codec's random stream for a version (stochastic stages draw from it).
        components: Further state a checkpoint holds by name (e.g. the clients' residuals).
        plugins: The run's server-side algorithm state (:class:`~flasync.training.plugins.ServerPlugin`): each
            sends what it has with every model, learns of every update folded in and of every version made, and is
            a checkpoint component under its name.

    Attributes:
        on_checkpoint: Called with :meth:`state_dict` every ``rules.checkpoint_every`` versions (it must not
            block: hand the writing to a thread).
        interrupted_state: The state captured when a stop request ended the run, else None.
    """

    def __init__(
        self,
        weights: torch.Tensor,
        *,
        bus: EventBus,
        clock: Clock,
        wall: Callable[[], float],
        log: Any,
        aggregator: Aggregator,
        policy: Policy,
        registry: TaskRegistry,
        intake: Intake,
        accounting: Accounting,
        sampler: ClientSampler,
        download_codec: Pipeline,
        edge_codec: Pipeline,
        evaluate: Evaluator,
        rules: StopRules,
        inbox_capacity: int,
        download_generator: Callable[[int], torch.Generator] | None = None,
        components: Mapping[str, Stateful] | None = None,
        plugins: Sequence[ServerPlugin] = (),
    ) -> None:
        """Subscribe to what reaches the cloud."""
        self.weights = weights
        self.bus = bus
        self.clock = clock
        self.wall = wall
        self._last_checkpoint = wall()
        self.log = log
        self.aggregator = aggregator
        self.policy = policy
        self.registry = registry
        self.intake = intake
        self.accounting = accounting
        self.sampler = sampler
        self.components = dict(components or {})
        self.plugins = tuple(plugins)
        for plugin in self.plugins:
            self.components.setdefault(plugin.name, plugin)
        self._versions = VersionMaker(
            weights,
            aggregator=aggregator,
            registry=registry,
            policy=policy,
            accounting=accounting,
            bus=bus,
            clock=clock,
            wall=wall,
            log=log,
            download_codec=download_codec,
            evaluate=evaluate,
            rules=rules,
            download_generator=download_generator,
            plugins=self.plugins,
        )
        node = AggregationNode(
            where=CLOUD,
            intake=intake,
            bus=bus,
            wall=wall,
            edge_codec=edge_codec,
            num_params=weights.numel(),
            device=weights.device,
            plugins=self.plugins,
        )
        self._receiver = CloudReceiver(
            node, aggregator=aggregator, versions=self._versions, policy=policy, accounting=accounting, bus=bus, log=log
        )
        self.on_checkpoint: Callable[[dict[str, Any]], None] | None = None
        self.interrupted_state: dict[str, Any] | None = None
        self._stop_requested = ""
        self._restored = False
        self._answered: set[int] = set()
        self._queued: list[EdgeForwarded | TaskClosed | UpdateUploaded] = []
        # The uploads of a batch not handled yet, each with its delta decoded ahead: handled in order (one per
        # message, or all at once in a round that closes on its last answer) before the inbox is read again.
        self._batch: deque[tuple[UpdateUploaded, Decoded | None]] = deque()
        self._inbox = bus.subscribe(*_RECEIVES, capacity=inbox_capacity, name="server", address=CLOUD)

    @property
    def stats(self) -> ServerStats:
        """The run's counters."""
        return self.accounting.stats

    @property
    def version(self) -> Version:
        """The newest version of the global model (0: the initial model)."""
        return self._versions.version

    @property
    def rules(self) -> StopRules:
        """Stop conditions, evaluation and checkpoint periods."""
        return self._versions.rules

    @rules.setter
    def rules(self, rules: StopRules) -> None:
        self._versions.rules = rules

    # ------------------------------------------------------------------------------------------- stopping
    def request_stop(self, reason: str) -> None:
        """Ask the run to stop at its next consistent point (call from the loop's thread, e.g. a signal handler).

        The server finishes handling the message at hand (a policy without mid-round checkpoints finishes the
        round), captures :attr:`interrupted_state`, cancels the client tasks and returns with
        ``stop_reason == "interrupted"``.
        """
        if self._stop_requested:
            return
        self._stop_requested = reason or INTERRUPTED
        self.policy.idle.wake()  # a policy waiting for clients to come online stops waiting
        with contextlib.suppress(BusFull, BusClosed):  # a full inbox is being drained: the flag is seen anyway
            self.bus.publish_nowait(StopRequested(reason=self._stop_requested))

    @property
    def stop_requested(self) -> str:
        """What asked the run to stop (empty if nothing did)."""
        return self._stop_requested

    def _stop_reason(self) -> str:
        versions, stats = self._versions, self.accounting.stats  # asked after every update: no property calls
        reason = versions.rules.reason(
            stats, requested=bool(self._stop_requested), now=self.clock.now, elapsed_s=versions.elapsed_s
        )
        if reason:
            stats.stop_reason = reason
        return reason

    # ------------------------------------------------------------------------------------------------ run
    async def run(self) -> ServerStats:
        """Run until a stop condition holds; return the final counters (the final model is :attr:`weights`)."""
        versions = self._versions
        versions.begin()
        try:
            async with asyncio.TaskGroup() as tg:
                self.registry.attach(tg)
                try:
                    self.policy.start()
                    if self._restored:
                        self.registry.redispatch(self._answered)
                        self.policy.resumed()
                        for message in self._queued:
                            self.bus.publish_nowait(message)
                        self._queued = []
                    else:
                        await versions.publish()
                        await versions.evaluate()
                    await self._drive()
                    if self._stop_requested and self.sampler.checkpointable:
                        self.interrupted_state = self.state_dict()
                finally:
                    self.registry.cancel_all()
        finally:
            self._inbox.close()
        if self.stats.evaluated_version != self.version and not self._stop_requested:
            await versions.evaluate()
        stats = self.stats
        await self.bus.publish(
            RunFinished(
                reason=stats.stop_reason,
                versions=stats.versions,
                updates_accepted=stats.updates_accepted,
                simulated_s=self.clock.now(),
                wall_s=versions.elapsed_s(),
            )
        )
        return stats

    async def _drive(self) -> None:
        # A checkpoint is taken after a message was handled and before tasks are started again, so a resumed run
        # starts here: fill, then wait for the next message.
        policy = self.policy
        if self._stop_reason():
            return
        while True:
            await policy.fill()
            if self._stop_requested and not len(self.registry) and not policy.step_due():
                self._stop_reason()
                return  # stopped while no client was online: nothing in flight to wait for
            if not policy.step_due():
                # The next upload of a batch being handled is taken here, without a coroutine for it.
                message, decoded = self._batch.popleft() if self._batch else await self._next()
                if not isinstance(message, UpdateUploaded):
                    self._handle(message)
                elif self._batch and policy.rounds and not policy.abandons:
                    batch = [(message, decoded), *self._batch]
                    self._batch.clear()
                    await self._receiver.receive(batch)
                elif (
                    self._batch
                    and isinstance(policy, AsyncSlots)
                    and policy.refills_at_once
                    and not self._stop_reason()
                ):
                    # The uploads up to the next version, each slot refilled as it would be after each alone.
                    batch = [(message, decoded), *self._batch]
                    self._batch.clear()
                    taken = await self._receiver.receive(batch, now=self.clock.now(), refill=policy.refill)
                    self._batch.extend(batch[taken:])
                    await policy.start_refilled()
                else:  # one upload, as it would come alone
                    await self._receiver.receive([(message, decoded)], now=self.clock.now())
                if policy.rounds and policy.interruptible and self._stop_requested:
                    self._stop_reason()
                    return  # mid-round: the checkpoint keeps the round and its tasks in flight
                if not policy.step_due():
                    if not policy.rounds and self._stop_reason():
                        return
                    continue
            if policy.rounds and self._stop_reason():  # a time limit may end a round without its step
                return
            policy.close_step()
            if self.aggregator.count():
                await self._new_version()
            else:
                self.log.warning("server.round_empty", step=int(self.version), metrics=False)
            if self._stop_reason():
                return

    # ------------------------------------------------------------------------------------------- receive
    async def _next(self) -> tuple[ServerMessage, Decoded | None]:
        """Return the next message: the next upload of a batch being handled, else the next one of the inbox.

        A batch's uploads are handled one at a time, exactly as if each had come alone (the policy fills and
        versions step between them), but their deltas are decoded and measured together when the batch arrives;
        :meth:`_drive` hands the rest of the batch to the receiver (:meth:`CloudReceiver.receive`) where nothing can
        come between them, or, with asynchronous slots every client of which is always online, up to the next
        version, each free slot refilled between two uploads (:meth:`AsyncSlots.refill`) and the new tasks announced
        once the receiver is done: the same tasks, draws and weights, each task's event after the receipts.
        """
        while not self._batch:
            message = await self._inbox.receive()
            if not isinstance(message, UpdatesUploaded):
                return message, None
            uploads = message.uploads
            self._batch.extend(zip(uploads, self.intake.decode(uploads, message.prepared), strict=True))
        return self._batch.popleft()

    def _handle(self, message: ServerMessage) -> None:
        """Handle a message other than an upload (:meth:`_drive` hands uploads to the receiver)."""
        if isinstance(message, StopRequested | RoundDeadlinePassed | ClientConnected):
            pass  # a stop request's flag is already set; the policy reads the deadline; the loop fills next
        elif isinstance(message, TaskClosed):
            self._receiver.task_closed(message)
        elif isinstance(message, ClientTimedOut):
            if self.registry.release(message):
                self._receiver.timed_out(message.task_id, int(message.client_id))
        elif isinstance(message, ClientFailed):
            if self.registry.release(message):
                self._receiver.failed(message.kind, message.error, message.task_id, int(message.client_id))
        elif isinstance(message, EdgeForwarded):
            self._receiver.partial(message)
        elif isinstance(message, SecureGroupClosed):
            for task in message.members:
                self.registry.release(task)
            self._receiver.secure_group(message)
            return
        self.policy.note(message, accepted=False)

    # ------------------------------------------------------------------------------------------- versions
    async def _new_version(self) -> None:
        """Make the next version; evaluate it and offer a checkpoint when the rules say so."""
        await self._versions.step()
        version = int(self.version)
        if self.rules.evaluates(version):
            await self._versions.evaluate()
        if self.on_checkpoint is not None and self.rules.checkpoints(version, self._since_checkpoint):
            self._last_checkpoint = self.wall()
            self.on_checkpoint(self.state_dict())

    def _since_checkpoint(self) -> float:
        """Wall seconds since the last checkpoint (since the loop was made, before the first)."""
        return self.wall() - self._last_checkpoint

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return everything needed to continue this run exactly: plain values and tensors, copied.

        The server takes it between messages (after one was handled, before tasks start again). In-flight tasks
        are kept as their :class:`~flasync.core.events.TaskAssigned` records with the models they started from; a
        resumed run starts them again on their original timelines, and since every random draw of a task is keyed
        by client and participation, they replay exactly.
        """
        # What waits in the inbox and no task replays: edges' partials and outcomes, uploads edges relayed.
        queued = [m for m in self._inbox.queued() if isinstance(m, EdgeForwarded | TaskClosed) or relayed(m)]
        answered = self.policy.answered() | {m.task_id for m in queued if isinstance(m, UpdateUploaded)}
        return {
            "version": int(self.version),
            "weights": self.weights.detach().clone(),
            "queued": [message_state(m) for m in queued],
            "answered": sorted(answered),
            "aggregator": self.aggregator.state_dict(),
            "accounting": self.accounting.state_dict(),
            "sampler": self.sampler.state_dict(),
            "registry": self.registry.state_dict(),
            "intake": self.intake.state_dict(),
            "policy": self.policy.state_dict(),
            **{name: component.state_dict() for name, component in self.components.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` before :meth:`run`; the run then continues where that state was taken.

        Raises:
            CheckpointError: If the state does not fit this run (another model size, aggregator or population).
        """
        weights = state["weights"]
        if not isinstance(weights, torch.Tensor) or weights.shape != self.weights.shape:
            shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise CheckpointError(f"checkpoint weights have shape {shape}, this model {tuple(self.weights.shape)}")
        self.registry.load_state_dict(state["registry"], device=self.weights.device)
        with torch.no_grad():
            self.weights.copy_(weights)
        self._versions.version = Version(int(state["version"]))
        self.aggregator.load_state_dict(state["aggregator"])
        self.accounting.load_state_dict(state["accounting"])
        self.sampler.load_state_dict(state["sampler"])
        self.intake.load_state_dict(state["intake"])
        self.policy.load_state_dict(state["policy"])
        for name, component in self.components.items():
            # A component a checkpoint lacks (one written before it had that component) restores an empty state.
            component.load_state_dict(state.get(name, {}))
        self._answered = {int(t) for t in state.get("answered", [])}
        self._queued = [message_from_state(m) for m in state.get("queued", [])]
        self._restored = True
