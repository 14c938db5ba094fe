"""The aggregation node: what the cloud and every edge do with what reaches them from below.

Both admit a client's upload through their :class:`~flasync.server.intake.Intake`, fold an admitted delta or a
sub-edge's partial aggregate (decoded with the edge codec) into where they aggregate, a :class:`Sink` (the cloud's
:class:`~flasync.aggregation.Aggregator`, an edge's :class:`BufferSink`), and publish a refusal as an
:class:`~flasync.core.events.UpdateRejected` naming where it happened. What each does around that stays with it: the
cloud counts and logs every update, an edge counts what its buffer holds and closes each task with a
:class:`~flasync.core.events.TaskClosed`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from flasync.aggregation import BufferedAggregator, ExampleWeight, StalenessWeight, UpdateBuffer
from flasync.codecs import Pipeline
from flasync.core.bus import EventBus
from flasync.core.events import EdgeForwarded, UpdateRejected, UpdateUploaded
from flasync.server.intake import Admitted, Decoded, Intake, Refused
from flasync.training.plugins import ServerPlugin

__all__ = ["AggregationNode", "BufferSink", "Folded", "PartialFolded", "RunFolded", "Sink"]

_new_tuple = tuple.__new__  # builds a named tuple (every field given) in C, without its class's Python constructor


class Sink(Protocol):
    """Where a node folds what it admits: the part of :class:`~flasync.aggregation.Aggregator` a node needs."""

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Fold one client delta in (read, not kept); return the weight its staleness ``tau`` got."""
        ...

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Fold a sub-edge's partial aggregate ``sum_k e_k s_k delta_k`` in; return the staleness weight applied."""
        ...


class BufferSink:
    """Fold into an edge's :class:`~flasync.aggregation.UpdateBuffer`: ``e_k s(tau_k) delta_k`` per client update,
    sub-edges' partials at full weight (their parent discounts the edge's whole partial).

    Args:
        buffer: The edge's buffer.
        example_weight: ``e_k`` of an update.
        staleness: ``s(tau)`` of an update (a sync round weighs none:
            :class:`~flasync.aggregation.ConstantStaleness`).
    """

    def __init__(self, buffer: UpdateBuffer, *, example_weight: ExampleWeight, staleness: StalenessWeight) -> None:
        """Bind the buffer and the weights."""
        self.buffer = buffer
        self.example_weight = example_weight
        self.staleness = staleness

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Add ``e_k s(tau_k) delta_k`` to the buffer; return ``s(tau_k)``."""
        weight = self.staleness(staleness)
        self.buffer.add(delta, example_weight=self.example_weight(num_samples), staleness_weight=weight)
        return weight

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Add a sub-edge's ``S`` and ``E`` undiscounted; return 1."""
        self.buffer.add_sum(weighted_sum, example_weight=example_weight)
        return 1.0


class Folded(NamedTuple):
    """A client update admitted and folded in (a named tuple: one is made per update on the event loop).

    Attributes:
        admitted: What the intake learnt of it (delta, staleness, norm, timings).
        weight: The weight the sink gave its staleness.
        aggregate_s: Wall seconds from its admission's start until it was folded in.
    """

    admitted: Admitted
    weight: float
    aggregate_s: float


class RunFolded(NamedTuple):
    """A run of client updates admitted and folded in (:meth:`AggregationNode.admit_run`), as columns.

    Attributes:
        uploads: The uploads folded in, in order.
        staleness: Each one's staleness.
        weights: The weight the aggregator gave each one's staleness.
        norms: Each one's L2 norm.
        decode_s: Real seconds each one's decoding took.
        received_wall: Wall seconds when the run's admission started.
        aggregate_s: Wall seconds from then until the last of them was folded in.
        refused: The refusal of the upload after the last of them, which ended the run (None: none).
        failure: The error that stopped the fold after the uploads above (None: none): the caller counts and logs
            them, as it would have each folded before the error, then raises it.
    """

    uploads: list[UpdateUploaded]
    staleness: list[int]
    weights: list[float]
    norms: list[float]
    decode_s: list[float]
    received_wall: float
    aggregate_s: float
    refused: Refused | None
    failure: Exception | None = None


@dataclass(frozen=True, slots=True)
class PartialFolded:
    """A sub-edge's partial aggregate folded in.

    Attributes:
        staleness: Versions the receiver made since the edge's base version (never below 0).
        weight: The weight the sink gave that staleness.
        received_wall: Wall seconds when its decoding started.
        aggregate_s: Wall seconds from then until it was folded in.
    """

    staleness: int
    weight: float
    received_wall: float
    aggregate_s: float


class AggregationNode:
    """Admit uploads, fold them or partials into a sink, publish refusals: the cloud's and each edge's common job.

    Args:
        where: The node's address (the cloud's, or the edge's name), named by the refusals it publishes.
        intake: The node's admission path.
        bus: The run's event bus.
        wall: Monotonic real seconds.
        edge_codec: Decodes the partials sub-edges send.
        num_params: Length of the flat model.
        device: Where the sink folds (partials are moved there).
        plugins: Server-side algorithm state that learns of every update folded in (the cloud's; edges have none).
    """

    def __init__(
        self,
        *,
        where: str,
        intake: Intake,
        bus: EventBus,
        wall: Callable[[], float],
        edge_codec: Pipeline,
        num_params: int,
        device: torch.device,
        plugins: Sequence[ServerPlugin] = (),
    ) -> None:
        """Bind the intake, codec and plug-ins."""
        self.where = where
        self.intake = intake
        self.bus = bus
        self.wall = wall
        self.edge_codec = edge_codec
        self.num_params = num_params
        self.device = device
        self.plugins = tuple(plugins)

    def admit(
        self, message: UpdateUploaded, *, version: int, into: Sink, decoded: Decoded | None = None
    ) -> Folded | Refused:
        """Admit ``message`` against the model ``version`` the node holds and, if it passes, fold it ``into`` a sink.

        Args:
            message: The upload (its task is released unless it is forged: see :meth:`Intake.admit`).
            version: The version it would join (its staleness counts from it).
            into: Where it is folded.
            decoded: Its entry of :meth:`Intake.decode` (None: decoded here, as a batch of one).

        Returns:
            The update folded in, or the refusal (nothing folded; publish it with :meth:`reject`).
        """
        wall, intake = self.wall, self.intake
        start = wall()
        verdict = intake.admit(message, version=version, decoded=decoded)
        if isinstance(verdict, Refused):
            return verdict
        delta, staleness, _, base, _, _, extra = verdict
        weight = into.add(delta, staleness=staleness, num_samples=message.num_samples, base=base.weights)
        for plugin in self.plugins:
            plugin.folded(extra)
        intake.accepted(verdict)
        return _new_tuple(Folded, (verdict, weight, wall() - start))

    def admit_run(
        self,
        batch: Sequence[tuple[UpdateUploaded, Decoded | None]],
        start: int,
        *,
        version: int,
        into: BufferedAggregator,
        end: int | None = None,
        after: Callable[[bool], None] | None = None,
    ) -> RunFolded | None:
        """Admit and fold the longest run of plain uploads from ``batch[start]`` on (see :meth:`Intake.plain`), as
        :meth:`admit` would each in turn: the same releases, refusals, weights and folds, in order.

        What is the same for every upload of the run is settled once (the version, the arguments of the fold); what
        one depends on the last stays per upload and in order (the checks against the norms seen before, the fold of
        each delta). The run ends before the first upload that is not plain, or at the first refused.

        Args:
            batch: Uploads and their entries of :meth:`Intake.decode`, in order.
            start: Where the run begins.
            version: The version they would join.
            into: Where they are folded (a buffered aggregator: its weights are asked for first).
            end: Where the run ends at the latest (None: the end of ``batch``).
            after: Called with each upload's outcome as it is known, before the next task is released (see
                :meth:`Intake.take_run`).

        Returns:
            What was folded and the refusal that ended the run, or None where the upload at ``start`` is not plain
            or the node has server plug-ins (nothing done: :meth:`admit` takes it).
        """
        if self.plugins:  # each learns of every update folded in: admit tells them
            return None
        wall, intake = self.wall, self.intake
        begin = wall()
        uploads, staleness, deltas, norms, decode_s = intake.plain(batch, start, version, end)
        if not uploads:
            return None
        example_weights, staleness_weights = into.weigh(staleness, [message.num_samples for message in uploads])
        count = len(example_weights)
        if not count:
            return None  # its weights are refused: admit raises as it would
        if count < len(uploads):
            del uploads[count:], deltas[count:], norms[count:]
        refused = intake.take_run(uploads, deltas, norms, after)
        taken = len(deltas)
        if taken < len(staleness):
            del uploads[taken:], staleness[taken:], example_weights[taken:], staleness_weights[taken:]
            del norms[taken:], decode_s[taken:]
        before, failure = into.count(), None
        try:
            into.add_rows(deltas, example_weights=example_weights, staleness_weights=staleness_weights)
        except Exception as error:  # the updates folded before it stay counted and logged
            failure, refused, folded = error, None, into.count() - before
            del uploads[folded:], staleness[folded:], staleness_weights[folded:], norms[folded:], decode_s[folded:]
        return RunFolded(
            uploads, staleness, staleness_weights, norms, decode_s, begin, wall() - begin, refused, failure
        )

    def fold_partial(self, message: EdgeForwarded, *, version: int, into: Sink) -> PartialFolded | None:
        """Decode a sub-edge's partial and fold it ``into`` a sink, its staleness counted against ``version``.

        Returns:
            What was folded, or None if the partial held no update (then nothing is decoded or folded).
        """
        if message.count == 0:
            return None
        start = self.wall()
        partial = self.edge_codec.decode(message.payload, expected_elements=self.num_params).to(self.device)
        staleness = max(version - int(message.base_version), 0)
        weight = into.add_partial(partial, example_weight=message.example_weight, staleness=staleness)
        return PartialFolded(staleness, weight, start, self.wall() - start)

    async def reject(self, message: UpdateUploaded, refused: Refused, *, simulated_s: float) -> None:
        """Publish the refusal of ``message`` as an :class:`~flasync.core.events.UpdateRejected` at virtual time
        ``simulated_s``."""
        await self.bus.publish(
            UpdateRejected(
                task_id=message.task_id,
                client_id=message.client_id,
                base_version=message.base_version,
                reason=refused.reason,
                detail=refused.detail,
                simulated_s=simulated_s,
                where=self.where,
            )
        )
