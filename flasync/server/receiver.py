"""What the cloud does with what arrives from below: updates, edges' partials and the outcomes of tasks.

:class:`CloudReceiver` admits each upload and folds it into the cloud's :class:`~flasync.aggregation.Aggregator`
through the cloud's :class:`~flasync.server.node.AggregationNode` (staleness counted from the cloud's version),
folds edges' partials the same way, and counts and logs every outcome in the run's
:class:`~flasync.server.accounting.Accounting`: accepted, refused (published as
:class:`~flasync.core.events.UpdateRejected`), failed, timed out, or closed by an edge.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch

from flasync.aggregation import Aggregator, BufferedAggregator
from flasync.core.bus import EventBus
from flasync.core.events import (
    EdgeForwarded,
    SecureGroupClosed,
    TaskClosed,
    UpdateReceived,
    UpdatesReceived,
    UpdateUploaded,
    Version,
    positional,
)
from flasync.core.instruments import debug_many, logs_debug
from flasync.server.accounting import Accounting, ServerStats
from flasync.server.intake import Decoded, Refused
from flasync.server.node import AggregationNode, RunFolded
from flasync.server.policies import Policy
from flasync.server.versions import VersionMaker

__all__ = ["REFUSAL_LINES", "CloudReceiver"]

REFUSAL_LINES = 3
"""Refusals of one reason logged as info lines in a run; the rest of them at debug level (all counted)."""


_ABANDONED_PRINTED = 3
"""Abandoned secure-aggregation groups printed as warnings; the rest are debug lines (the metric counts each)."""

_MAKE_RECEIVED = positional(UpdateReceived)
"""An :class:`UpdateReceived` from its fields in order (one made per accepted update of a run)."""


def _refills(refill: Callable[[], object], room: int) -> Callable[[bool], None]:
    """Return the hook of a run taken into a buffer with ``room`` updates left: ``refill`` after each upload's outcome,
    but the acceptance that fills the buffer (its slot is filled after the version it makes due)."""
    left = room

    def after(accepted: bool) -> None:
        nonlocal left
        if accepted:
            left -= 1
            if not left:
                return
        refill()

    return after


class CloudReceiver:
    """Fold what reaches the cloud into its aggregator and count every task's outcome.

    Args:
        node: The cloud's admission and fold (its intake, the edge codec, the run's server plug-ins).
        aggregator: Where admitted updates and partials are folded.
        versions: The cloud's versions (staleness counts from the newest; the run's start times the first update).
        policy: Learns of each upload and its outcome.
        accounting: Counts outcomes and bytes.
        bus: The run's event bus.
        log: The run's logger.
    """

    def __init__(
        self,
        node: AggregationNode,
        *,
        aggregator: Aggregator,
        versions: VersionMaker,
        policy: Policy,
        accounting: Accounting,
        bus: EventBus,
        log: Any,
    ) -> None:
        """Bind the node and the counters."""
        self.node = node
        self.aggregator = aggregator
        self.versions = versions
        self.policy = policy
        self.accounting = accounting
        self.bus = bus
        self.log = log
        self._log_updates = logs_debug(log)  # each accepted update's debug line reaches something
        self._abandoned = 0  # secure-aggregation groups abandoned: the first few are warnings, the rest debug lines
        self._told: Counter[str] = Counter()  # refusals of each reason logged at info level
        # Where runs of plain uploads are settled together (AggregationNode.admit_run): flasync's buffered aggregator
        # itself (a subclass may fold otherwise) with no server plug-in (None: each upload is taken alone).
        self._runs: BufferedAggregator | None = None
        if type(aggregator) is BufferedAggregator and not node.plugins and not node.intake.plugins:
            self._runs = aggregator

    @property
    def stats(self) -> ServerStats:
        """The run's counters."""
        return self.accounting.stats

    # --------------------------------------------------------------------------------------------- outcomes
    def timed_out(self, task_id: int, client_id: int) -> None:
        """Count a task whose time limit passed before its answer (its task was released)."""
        self.accounting.timed_out(client_id=client_id)
        timed_out = self.stats.tasks_timed_out
        self.log.debug("server.timeout", step=timed_out, task_id=task_id, client_id=client_id, timed_out=timed_out)

    def failed(self, kind: str, error: str, task_id: int, client_id: int) -> None:
        """Count a task whose client reported a failure of ``kind`` (its task was released)."""
        stats = self.stats
        failed = stats.updates_failed + 1
        self.log.debug("server.failure", step=failed, kind=kind, task_id=task_id, client_id=client_id, failed=failed)
        self.accounting.failed(kind, error, client_id=client_id)

    def _accepted(self, staleness: int, client_id: int) -> None:
        """Count one update folded in (by the cloud or an edge); the first one's time is the run's start-up."""
        self.accounting.accepted(staleness, client_id=client_id)
        self._started()

    def _started(self) -> None:
        """Time the run's start-up at its first update folded in (later ones change nothing)."""
        stats = self.accounting.stats
        if math.isnan(stats.first_update_s):
            stats.first_update_s = self.versions.elapsed_s()

    def task_closed(self, message: TaskClosed) -> None:
        """An edge took a task's answer (it released the task itself): count the outcome."""
        client_id = int(message.client_id)
        self.accounting.uploaded(message.upload_bytes, client_id=client_id)
        if message.outcome == "accepted":
            self._accepted(message.staleness, client_id)
        elif message.outcome == "rejected":
            self.accounting.rejected(message.reason, client_id=client_id)
        elif message.outcome == "timed_out":
            self.timed_out(message.task_id, int(message.client_id))
        else:
            self.failed(message.kind, message.reason, message.task_id, int(message.client_id))

    # ---------------------------------------------------------------------------------------------- updates
    async def receive(
        self,
        batch: Sequence[tuple[UpdateUploaded, Decoded | None]],
        *,
        now: float | None = None,
        refill: Callable[[], object] | None = None,
    ) -> int:
        """Take uploads in order; one upload is a batch of one. Return how many were taken.

        Each upload is counted, admitted, folded in and logged as it would be alone, in order. An upload is received
        at ``now`` when given (one that arrived alone, at the clock's time), else at the time it was sent (the
        uploads of a round that closes on its last answer, between which nothing can happen, handed over together
        at the last of their times: see :class:`~flasync.clients.simulated.client.CohortClients`). The updates
        accepted are published as one :class:`UpdatesReceived` where every observer takes batches (a refusal's event
        keeps its place between them), and the policy learns of each.

        Into a :class:`~flasync.aggregation.BufferedAggregator` with no server plug-in, each run of two or more plain
        uploads (:meth:`~flasync.server.intake.Intake.plain`) is admitted, folded and counted together
        (:meth:`AggregationNode.admit_run`): the same events, logs, refusals, counts and weights, bit for bit, with
        what is the same for all of them settled once.

        With ``refill`` (an asynchronous policy's :meth:`~flasync.server.policies.AsyncSlots.refill`), the uploads are
        taken up to the one that makes a version due, and ``refill`` is called after each other one's outcome, before
        the next task is released: the free slots are filled in the same state as they would be between uploads
        that came alone. The rest of ``batch`` is left to the caller.
        """
        received: list[UpdateReceived] = []
        lines: list[dict[str, Any]] = []  # the accepted updates' debug lines, logged together before their events
        take, note, runs = self._take, self.policy.note, self._runs
        version = self.versions.version  # only the loop steps it (an int), and it is here until the batch is taken
        index, count = 0, len(batch)
        try:
            while index < count:
                message, decoded = batch[index]
                outcome: UpdateReceived | Refused | None = None
                # Two or more uploads left: a run of plain ones settled together, up to the first refused (one alone
                # is taken the quicker way, without a run's lists).
                if runs is not None and count - index > 1:
                    room = runs.room() if refill is not None else count
                    after = None if refill is None else _refills(refill, room)
                    run = self.node.admit_run(batch, index, version=version, into=runs, end=index + room, after=after)
                    if run is not None:
                        self._took(run, version, now, lines, received)
                        if run.failure is not None:
                            raise run.failure
                        index += len(run.uploads)
                        if run.refused is None:
                            if refill is not None and runs.ready():
                                break  # the rest are taken after the version
                            continue
                        message, decoded = batch[index]
                        self.accounting.arrived(message.upload_bytes, client_id=int(message.client_id))
                        outcome = run.refused
                received_s = message.simulated_s if now is None else now
                refilled = outcome is not None  # a run's refusal: refilled after it already
                if outcome is None:
                    outcome = take(message, decoded, version, received_s, lines)
                index += 1
                if isinstance(outcome, Refused):
                    if lines:
                        debug_many(self.log, "server.update", lines)
                        lines = []
                    await self.bus.publish_together(UpdatesReceived, received)
                    received = []
                    await self._reject(message, outcome, received_s)
                    note(message, accepted=False)
                else:
                    received.append(outcome)
                    note(message, accepted=True)
                    if refill is not None and self.policy.step_due():
                        break  # the rest are taken after the version
                if refill is not None and not refilled:
                    refill()
        finally:  # also those of updates folded in before an error
            if lines:
                debug_many(self.log, "server.update", lines)
        if received:
            await self.bus.publish_together(UpdatesReceived, received)
        return index

    def _took(
        self,
        run: RunFolded,
        version: Version,
        now: float | None,
        lines: list[dict[str, Any]],
        received: list[UpdateReceived],
    ) -> None:
        """Count, log and tell the policy of the updates of ``run``, as :meth:`_take` and :meth:`receive` would one
        by one: their events are appended to ``received``, their debug lines' fields to ``lines``."""
        uploads, staleness = run.uploads, run.staleness
        if not uploads:
            return
        accounting, note, log_updates = self.accounting, self.policy.note, self._log_updates
        stats = accounting.stats
        sizes, decode = [message.upload_bytes for message in uploads], run.decode_s
        if not len(staleness) == len(decode) == len(run.weights) == len(run.norms) == len(uploads):
            raise ValueError("every column of a run needs one value per upload")
        accounting.took(sizes, staleness, [int(m.client_id) for m in uploads])
        stats.cloud_aggregate_s += run.aggregate_s
        self._started()
        received_wall = run.received_wall
        queue_wait = [received_wall - message.sent_wall_s for message in uploads]
        if log_updates:
            step = stats.updates_accepted - len(uploads)
            for tau, weight, wait_s, decode_s, norm in zip(
                staleness, run.weights, queue_wait, decode, run.norms, strict=True
            ):
                step += 1
                lines.append(
                    {
                        "step": step,
                        "staleness": tau,
                        "staleness_weight": weight,
                        "queue_wait_s": wait_s,
                        "decode_s": decode_s,
                        "norm": norm,
                    }
                )
        # The events made column by column (their fields in order), then the policy told of each in turn.
        received += map(
            _MAKE_RECEIVED,
            [message.task_id for message in uploads],
            [message.client_id for message in uploads],
            [message.base_version for message in uploads],
            repeat(version),
            staleness,
            sizes,
            [message.simulated_s for message in uploads] if now is None else repeat(now),
            [message.tier for message in uploads],
            decode,
            queue_wait,
        )
        for message in uploads:
            note(message, accepted=True)

    def _take(
        self,
        message: UpdateUploaded,
        decoded: Decoded | None,
        version: Version,
        received_s: float,
        lines: list[dict[str, Any]],
    ) -> UpdateReceived | Refused:
        """Count an upload's arrival, admit it against ``version`` (received at virtual time ``received_s``) and, if
        it passes, fold it in and count it; return its event or the refusal. Its debug line's fields are appended to
        ``lines`` for the caller to log."""
        size, client, accounting = message.upload_bytes, int(message.client_id), self.accounting
        accounting.arrived(size, client_id=client)
        folded = self.node.admit(message, version=version, into=self.aggregator, decoded=decoded)
        if isinstance(folded, Refused):
            return folded
        verdict, stats = folded.admitted, accounting.stats
        stats.cloud_aggregate_s += folded.aggregate_s
        staleness = verdict.staleness
        self._accepted(staleness, client)
        queue_wait_s = verdict.received_wall - message.sent_wall_s
        if self._log_updates:
            line = {
                "step": stats.updates_accepted,
                "staleness": staleness,
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
            version=version,
            staleness=staleness,
            upload_bytes=size,
            simulated_s=received_s,
            tier=message.tier,
            decode_s=verdict.decode_s,
            queue_wait_s=queue_wait_s,
        )

    async def _reject(self, message: UpdateUploaded, refused: Refused, received_s: float) -> None:
        """Count and log a refusal, then publish it."""
        self.accounting.rejected(refused.reason, client_id=int(message.client_id))
        dropped = self.stats.updates_dropped
        # A second update of a client in one version is a plug-in's rule at work (one per client): not worth a line.
        # Of each other reason the first REFUSAL_LINES are info lines, the rest debug lines: a run whose every
        # update is refused alike says so a few times before its one error, not once per update.
        told = self._told
        if refused.reason != "repeat" and told[refused.reason] < REFUSAL_LINES:
            told[refused.reason] += 1
            emit, more = self.log.info, {}
            if told[refused.reason] == REFUSAL_LINES:
                more = {"then": "further refusals for this reason are logged at debug level"}
        else:
            emit, more = self.log.debug, {}
        emit(
            "server.rejected",
            step=dropped,
            reason=refused.reason,
            detail=refused.detail,
            task_id=message.task_id,
            client_id=int(message.client_id),
            dropped=dropped,
            **more,
        )
        await self.node.reject(message, refused, simulated_s=received_s)

    def partial(self, message: EdgeForwarded) -> None:
        """Count an edge's partial aggregate and fold it in, discounted by the versions made since the edge folded."""
        self.accounting.ingress(len(message.payload))
        self.stats.partials_received += 1
        folded = self.node.fold_partial(message, version=int(self.versions.version), into=self.aggregator)
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

    def secure_group(self, message: SecureGroupClosed) -> None:
        """Fold a secure-aggregation group's unmasked weighted sum in (its members weighted themselves: the sum
        joins at full weight) and count its members: each survivor's update accepted, each member that dropped out
        of the protocol failed, the others of an abandoned group refused (``secagg_abandoned``); the protocol's
        bytes both ways are counted as each member's upload and download."""
        accounting, stats = self.accounting, self.stats
        for client, nbytes in message.upload_bytes.items():
            accounting.uploaded(nbytes, client_id=client)
            accounting.ingress(nbytes)
        for nbytes in message.download_bytes.values():
            stats.download_bytes += nbytes
            accounting.egress(nbytes)
        version = int(message.version)
        if not message.abandoned:
            start = self.node.wall()
            weighted = torch.frombuffer(bytearray(message.weighted_sum), dtype=torch.float32)
            self.aggregator.add_partial(
                weighted.to(self.node.device), example_weight=message.example_weight, staleness=0
            )
            stats.cloud_aggregate_s += self.node.wall() - start
        for task in message.members:
            client = int(task.client_id)
            if client in message.dropped:
                accounting.failed("dropout", "dropped out of secure aggregation", client_id=client)
            elif message.abandoned:
                accounting.rejected("secagg_abandoned", client_id=client)
            else:
                self._accepted(version - int(task.base_version), client)
                self.policy.note(message, accepted=True)
        figures = {key.removeprefix("secagg."): value for key, value in message.figures.items()}
        self.log.debug("secagg", step=version, **figures)
        if message.abandoned:
            self._abandoned += 1
            text = (
                f"secure aggregation group {message.group} was abandoned ({message.reason}): its sum is not revealed "
                "and the model does not step on it"
            )
            if self._abandoned == _ABANDONED_PRINTED:
                text += " (further abandoned groups at debug level; secagg/abandoned counts them all)"
            emit = self.log.warning if self._abandoned <= _ABANDONED_PRINTED else self.log.debug
            emit(
                "secagg.abandoned",
                step=version,
                group=message.group,
                reason=message.reason,
                message=text,
                metrics=False,
            )
