"""The server loop: receive -> route -> intake -> aggregator -> new version (publish, evaluate, checkpoint, stop).

The loop knows nothing of the aggregation mode: a :class:`~flasync.server.policies.Policy` decides when tasks
start and when a version is due, an :class:`~flasync.aggregation.Aggregator` how updates combine, the
:class:`~flasync.server.intake.Intake` which updates are admitted, the
:class:`~flasync.server.registry.TaskRegistry` which tasks are in flight, and
:class:`~flasync.server.accounting.Accounting` what every outcome and byte counts for. :meth:`Server.state_dict`
composes the components' states into one checkpoint; :meth:`Server.load_state_dict` continues a run exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flasync.aggregation import Aggregator
from flasync.codecs import Pipeline
from flasync.core.bus import EventBus
from flasync.core.clock import Clock
from flasync.core.errors import BusClosed, BusFull, CheckpointError, TrainingError
from flasync.core.events import (
    CLOUD,
    Aggregated,
    ClientFailed,
    ClientTimedOut,
    EdgeForwarded,
    Evaluated,
    ModelPublished,
    RoundDeadlinePassed,
    RunFinished,
    StopRequested,
    TaskClosed,
    UpdateReceived,
    UpdatesReceived,
    UpdatesUploaded,
    UpdateUploaded,
    Version,
)
from flasync.core.instruments import debug_many, logs_debug
from flasync.core.snapshots import ModelSnapshot
from flasync.server.accounting import Accounting, ServerStats
from flasync.server.edges import message_from_state, message_state, relayed
from flasync.server.intake import Decoded, Intake, Refused
from flasync.server.node import AggregationNode
from flasync.server.policies import Policy
from flasync.server.registry import TaskRegistry
from flasync.server.sampler import ClientSampler
from flasync.training.local import EvalResult
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
)
INTERRUPTED = "interrupted"


Evaluator = Callable[[torch.Tensor], Awaitable[EvalResult | None]]
"""Evaluate flat weights off the event loop (None: there is nothing to evaluate on)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRules:
    """When the run ends (the first limit reached wins) and how often it evaluates and checkpoints."""

    max_versions: int
    target_accuracy: float | None = None
    max_simulated_s: float | None = None
    max_wall_s: float | None = None
    eval_every: int = 1
    checkpoint_every: int | None = None


def eta_seconds(rules: StopRules, done: int, version: int, wall_s: float) -> float:
    """Wall seconds left until ``max_versions`` (or ``max_wall_s``, if sooner) at the pace so far: ``done`` versions
    made by this process in ``wall_s`` (NaN before the first); a run may end sooner on its other stop rules."""
    if done <= 0 or wall_s <= 0.0:
        return math.nan
    left = wall_s * max(rules.max_versions - version, 0) / done
    if rules.max_wall_s is not None:
        left = min(left, max(rules.max_wall_s - wall_s, 0.0))
    return left


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
        self.log = log
        self._log_updates = logs_debug(log)  # each accepted update's debug line reaches something
        self.aggregator = aggregator
        self.policy = policy
        self.registry = registry
        self.intake = intake
        self.accounting = accounting
        self.sampler = sampler
        self.download_codec = download_codec
        self.edge_codec = edge_codec
        self.evaluate = evaluate
        self.rules = rules
        self.download_generator = download_generator
        self.components = dict(components or {})
        self.plugins = tuple(plugins)
        for plugin in self.plugins:
            self.components.setdefault(plugin.name, plugin)
        self._node = AggregationNode(
            where=CLOUD,
            intake=intake,
            bus=bus,
            wall=wall,
            edge_codec=edge_codec,
            num_params=weights.numel(),
            device=weights.device,
            plugins=self.plugins,
        )
        self.version = Version(0)
        self.on_checkpoint: Callable[[dict[str, Any]], None] | None = None
        self.interrupted_state: dict[str, Any] | None = None
        self._stop_requested = ""
        self._restored = False
        self._answered: set[int] = set()
        self._queued: list[EdgeForwarded | TaskClosed | UpdateUploaded] = []
        # The uploads of a batch not handled yet, each with its delta decoded ahead: handled in order (one per
        # message, or all at once in a round that closes on its last answer) before the inbox is read again.
        self._batch: deque[tuple[UpdateUploaded, Decoded | None]] = deque()
        self._start_wall = 0.0
        self._first_version = 0  # the version this process started from (a resumed run's pace counts from it)
        self._inbox = bus.subscribe(
            UpdateUploaded,
            UpdatesUploaded,
            ClientFailed,
            EdgeForwarded,
            TaskClosed,
            ClientTimedOut,
            RoundDeadlinePassed,
            StopRequested,
            capacity=inbox_capacity,
            name="server",
            address=CLOUD,
        )

    @property
    def stats(self) -> ServerStats:
        """The run's counters."""
        return self.accounting.stats

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
        with contextlib.suppress(BusFull, BusClosed):  # a full inbox is being drained: the flag is seen anyway
            self.bus.publish_nowait(StopRequested(reason=self._stop_requested))

    @property
    def stop_requested(self) -> str:
        """What asked the run to stop (empty if nothing did)."""
        return self._stop_requested

    def _stop_reason(self) -> str:
        stats, rules = self.stats, self.rules
        reason = ""
        if self._stop_requested:
            reason = INTERRUPTED
        elif stats.versions >= rules.max_versions:
            reason = "max_versions"
        elif rules.target_accuracy is not None and stats.accuracy >= rules.target_accuracy:
            reason = "target_accuracy"
        elif rules.max_simulated_s is not None and self.clock.now() >= rules.max_simulated_s:
            reason = "max_simulated_s"
        elif rules.max_wall_s is not None and self.wall() - self._start_wall >= rules.max_wall_s:
            reason = "max_wall_s"
        if reason:
            stats.stop_reason = reason
        return reason

    # ------------------------------------------------------------------------------------------------ run
    async def run(self) -> ServerStats:
        """Run until a stop condition holds; return the final counters (the final model is :attr:`weights`)."""
        self._start_wall = self.wall()
        self._first_version = int(self.version)
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
                        await self._publish()
                        await self._evaluate()
                    await self._drive()
                    if self._stop_requested and self.sampler.checkpointable:
                        self.interrupted_state = self.state_dict()
                finally:
                    self.registry.cancel_all()
        finally:
            self._inbox.close()
        if self.stats.evaluated_version != self.version and not self._stop_requested:
            await self._evaluate()
        stats = self.stats
        await self.bus.publish(
            RunFinished(
                reason=stats.stop_reason,
                versions=stats.versions,
                updates_accepted=stats.updates_accepted,
                simulated_s=self.clock.now(),
                wall_s=self.wall() - self._start_wall,
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
            if not policy.step_due():
                message, decoded = await self._next()
                if self._batch and isinstance(message, UpdateUploaded) and policy.rounds and not policy.abandons:
                    batch = [(message, decoded), *self._batch]
                    self._batch.clear()
                    await self._receive(batch)
                else:
                    await self._handle(message, decoded)
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
        :meth:`_drive` hands the rest of the batch to :meth:`_receive` where nothing can come between them.
        """
        while not self._batch:
            message = await self._inbox.receive()
            if not isinstance(message, UpdatesUploaded):
                return message, None
            uploads = message.uploads
            self._batch.extend(zip(uploads, self.intake.decode(uploads), strict=True))
        return self._batch.popleft()

    async def _handle(self, message: ServerMessage, decoded: Decoded | None = None) -> None:
        if isinstance(message, StopRequested | RoundDeadlinePassed):
            pass  # a stop request's flag is already set; the policy reads the deadline
        elif isinstance(message, TaskClosed):
            self._task_closed(message)
        elif isinstance(message, ClientTimedOut):
            if self.registry.release(message):
                self._timed_out(message.task_id, int(message.client_id))
        elif isinstance(message, ClientFailed):
            if self.registry.release(message):
                self._failed(message.kind, message.error, message.task_id, int(message.client_id))
        elif isinstance(message, EdgeForwarded):
            self.accounting.ingress(len(message.payload))
            self.stats.partials_received += 1
            self._fold_partial(message)
        elif isinstance(message, UpdateUploaded):
            await self._receive([(message, decoded)], now=self.clock.now())
            return
        self.policy.note(message, accepted=False)

    def _timed_out(self, task_id: int, client_id: int) -> None:
        self.accounting.timed_out()
        timed_out = self.stats.tasks_timed_out
        self.log.debug("server.timeout", step=timed_out, task_id=task_id, client_id=client_id, timed_out=timed_out)

    def _failed(self, kind: str, error: str, task_id: int, client_id: int) -> None:
        stats = self.stats
        failed = stats.updates_failed + 1
        self.log.debug("server.failure", step=failed, kind=kind, task_id=task_id, client_id=client_id, failed=failed)
        self.accounting.failed(kind, error)

    def _accepted(self, staleness: int) -> None:
        """Count one update folded in (by the cloud or an edge); the first one's time is the run's start-up."""
        self.accounting.accepted(staleness)
        if math.isnan(self.stats.first_update_s):
            self.stats.first_update_s = self.wall() - self._start_wall

    def _task_closed(self, message: TaskClosed) -> None:
        """An edge took a task's answer (it released the task itself): count the outcome."""
        self.accounting.uploaded(message.upload_bytes)
        if message.outcome == "accepted":
            self._accepted(message.staleness)
        elif message.outcome == "rejected":
            self.accounting.rejected(message.reason)
        elif message.outcome == "timed_out":
            self._timed_out(message.task_id, int(message.client_id))
        else:
            self._failed(message.kind, message.reason, message.task_id, int(message.client_id))

    async def _receive(
        self, batch: Sequence[tuple[UpdateUploaded, Decoded | None]], *, now: float | None = None
    ) -> None:
        """Take uploads in order; one upload is a batch of one.

        Each upload is counted, admitted, folded in and logged as it would be alone, in order. An upload is received
        at ``now`` when given (one that arrived alone, at the clock's time), else at the time it was sent (the
        uploads of a round that closes on its last answer, between which nothing can happen, handed over together
        at the last of their times: see :class:`~flasync.clients.simulated.client.CohortClients`). The updates
        accepted are published as one :class:`UpdatesReceived` where every observer takes batches (a refusal's event
        keeps its place between them), and the policy learns of each.
        """
        received: list[UpdateReceived] = []
        lines: list[dict[str, Any]] = []  # the accepted updates' debug lines, logged together before their events
        try:
            for message, decoded in batch:
                received_s = message.simulated_s if now is None else now
                size = message.upload_bytes
                self.accounting.ingress(size)
                outcome = self._take(message, decoded, size, received_s, lines)
                if isinstance(outcome, Refused):
                    debug_many(self.log, "server.update", lines)
                    lines = []
                    await self.bus.publish_together(UpdatesReceived, received)
                    received = []
                    await self._reject(message, outcome, received_s)
                    self.policy.note(message, accepted=False)
                else:
                    received.append(outcome)
                    self.policy.note(message, accepted=True)
        finally:  # also those of updates folded in before an error
            debug_many(self.log, "server.update", lines)
        await self.bus.publish_together(UpdatesReceived, received)

    def _take(
        self,
        message: UpdateUploaded,
        decoded: Decoded | None,
        size: int,
        received_s: float,
        lines: list[dict[str, Any]],
    ) -> UpdateReceived | Refused:
        """Admit an upload (of ``size`` bytes, received at virtual time ``received_s``) and, if it passes, fold it in
        and count it; return its event or the refusal. Its debug line's fields are appended to ``lines`` for the
        caller to log."""
        self.accounting.uploaded(size)
        folded = self._node.admit(message, version=int(self.version), into=self.aggregator, decoded=decoded)
        if isinstance(folded, Refused):
            return folded
        verdict, stats = folded.admitted, self.stats
        stats.cloud_aggregate_s += folded.aggregate_s
        self._accepted(verdict.staleness)
        queue_wait_s = verdict.received_wall - message.sent_wall_s
        if self._log_updates:
            line = {
                "step": stats.updates_accepted,
                "staleness": verdict.staleness,
                "staleness_weight": folded.weight,
                "queue_wait_s": queue_wait_s,
                "decode_s": verdict.decode_s,
                "norm": verdict.norm,
            }
            lines.append(line)
        return UpdateReceived(
            task_id=message.task_id,
            client_id=message.client_id,
            base_version=message.base_version,
            version=self.version,
            staleness=verdict.staleness,
            upload_bytes=size,
            simulated_s=received_s,
            tier=message.tier,
            decode_s=verdict.decode_s,
            queue_wait_s=queue_wait_s,
        )

    def _fold_partial(self, message: EdgeForwarded) -> None:
        """Fold an edge's partial aggregate, discounted by how many versions passed since the edge folded it."""
        folded = self._node.fold_partial(message, version=int(self.version), into=self.aggregator)
        if folded is None:
            return
        self.stats.cloud_aggregate_s += folded.aggregate_s
        self.log.debug(
            "server.partial",
            step=self.stats.partials_received,
            updates=message.count,
            bytes=len(message.payload),
            staleness=folded.staleness,
            staleness_weight=folded.weight,
            queue_wait_s=folded.received_wall - message.sent_wall_s,
            decode_s=folded.aggregate_s,
        )

    async def _reject(self, message: UpdateUploaded, refused: Refused, received_s: float) -> None:
        """Count and log a refusal, then publish it."""
        self.accounting.rejected(refused.reason)
        dropped = self.stats.updates_dropped
        # A second update of a client in one version is a plug-in's rule at work (one per client): not worth a line.
        emit = self.log.debug if refused.reason == "repeat" else self.log.info
        emit(
            "server.rejected",
            step=dropped,
            reason=refused.reason,
            detail=refused.detail,
            task_id=message.task_id,
            client_id=int(message.client_id),
            dropped=dropped,
        )
        await self._node.reject(message, refused, simulated_s=received_s)

    # ------------------------------------------------------------------------------------------- versions
    async def _new_version(self) -> None:
        stats = self.stats
        start = self.wall()
        self.aggregator.step()
        for plugin in self.plugins:
            plugin.stepped(int(self.version))
        aggregate_s = self.wall() - start
        if not bool(torch.isfinite(self.weights).all()):
            # Nothing a later version does can repair it, and every client would train from it.
            raise TrainingError(
                f"the global model has NaN or Inf after the server step to version {int(self.version) + 1}: "
                "lower the server learning rate or bound updates (resilience.max_update_norm, clip_update_norm)"
            )
        stats.cloud_aggregate_s += aggregate_s
        self.version = Version(self.version + 1)
        stats.versions = int(self.version)
        await self._publish()
        figures = self.accounting.close_version(int(self.version))
        wall_s = self.wall() - self._start_wall
        self.log.debug(
            "server.version",
            step=int(self.version),
            aggregate_s=aggregate_s,
            updates=figures.updates,
            staleness_mean=figures.staleness_mean,
            in_flight=len(self.registry),
            ingress_bytes=figures.ingress_bytes,
            egress_bytes=figures.egress_bytes,
            simulated_s=self.clock.now(),
            wall_s=wall_s,
            versions_per_s=int(self.version) / wall_s if wall_s > 0 else 0.0,
        )
        for plugin in self.plugins:
            plugin.version_made(int(self.version), self.log)
        await self.bus.publish(
            Aggregated(
                version=self.version,
                num_updates=figures.updates,
                mean_staleness=figures.staleness_mean,
                aggregate_s=aggregate_s,
                simulated_s=self.clock.now(),
                wall_s=wall_s,
            )
        )
        if int(self.version) % self.rules.eval_every == 0:
            await self._evaluate()
        every = self.rules.checkpoint_every
        # The last version is the run's result, not a point to restart from.
        if (
            every is not None
            and self.on_checkpoint is not None
            and int(self.version) % every == 0
            and stats.versions < self.rules.max_versions
        ):
            self.on_checkpoint(self.state_dict())

    async def _publish(self) -> None:
        start = self.wall()
        exact = self.weights.detach().clone()
        codec = self.download_codec
        payload = codec.encode(exact, generator=self._download_generator()).payload
        # One download is encoded (and, if lossy, decoded) per version, not per client.
        weights = exact if codec.lossless else codec.decode(payload, expected_elements=exact.numel()).to(exact.device)
        size, extra = len(payload), None
        for plugin in self.plugins:  # what a plug-in sends with the model goes through the same codec
            sent = plugin.published(int(self.version), codec, self._download_generator(extra=True))
            size += sent.nbytes
            if sent.value is not None:
                extra = sent.value
        snapshot = ModelSnapshot(version=self.version, weights=weights, exact=exact, download_bytes=size, extra=extra)
        self.registry.publish(snapshot)
        self.policy.published(snapshot)
        await self.bus.publish(
            ModelPublished(
                version=self.version,
                simulated_s=self.clock.now(),
                download_bytes=snapshot.download_bytes,
                encode_s=self.wall() - start,
            )
        )

    def _download_generator(self, *, extra: bool = False) -> torch.Generator | None:
        if self.download_generator is None:
            return None
        # The model of version v draws from key v; a plug-in's extra sent with it from key -(v + 1).
        version = int(self.version)
        return self.download_generator(-(version + 1) if extra else version)

    async def _evaluate(self) -> None:
        snapshot = self.registry.current
        assert snapshot is not None
        stats = self.stats
        start = self.wall()
        result = await self.evaluate(snapshot.weights)
        if result is None:
            return
        stats.accuracy, stats.loss, stats.evaluated_version = result.accuracy, result.loss, int(snapshot.version)
        wall_s = self.wall() - self._start_wall
        self.log.info(
            "server.eval",
            step=int(snapshot.version),
            version=int(snapshot.version),
            of=self.rules.max_versions,
            accuracy=result.accuracy,
            loss=result.loss,
            updates=stats.updates_accepted,
            simulated_s=self.clock.now(),
            wall_s=wall_s,
            eta_s=eta_seconds(self.rules, int(snapshot.version) - self._first_version, int(snapshot.version), wall_s),
        )
        await self.bus.publish(
            Evaluated(
                version=snapshot.version,
                accuracy=result.accuracy,
                loss=result.loss,
                simulated_s=self.clock.now(),
                wall_s=wall_s,
                eval_s=self.wall() - start,
            )
        )

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
        self.version = Version(int(state["version"]))
        self.aggregator.load_state_dict(state["aggregator"])
        self.accounting.load_state_dict(state["accounting"])
        self.sampler.load_state_dict(state["sampler"])
        self.intake.load_state_dict(state["intake"])
        self.policy.load_state_dict(state["policy"])
        for name, component in self.components.items():
            component.load_state_dict(state[name])
        self._answered = {int(t) for t in state.get("answered", [])}
        self._queued = [message_from_state(m) for m in state.get("queued", [])]
        self._restored = True
