"""Edge coroutines: an aggregator for the clients (or sub-edges) below, a client of the parent above.

An edge is built from the server's own mechanisms: it closes the tasks of its clients in the run's
:class:`~flasync.server.registry.TaskRegistry`, admits their updates with the cloud's
:class:`~flasync.server.node.AggregationNode` over its own :class:`~flasync.server.intake.Intake` (version,
staleness limit, decoding, validation, clipping), and folds them into an :class:`~flasync.aggregation.UpdateBuffer`
on the run's device: ``sum_k e_k s_k delta_k`` and ``sum_k e_k``. It forwards that partial aggregate to its parent
as one dense message; a parent adds partials, so the cloud ends with the sums it would have built from the clients'
updates (in floating point: up to the order of the additions). Edges relay each new global model down, one download
per edge per version, and clients download from their edge. Each task's outcome goes to the cloud as a
:class:`~flasync.core.events.TaskClosed`, counted there once.

* **async** (the cloud runs FedBuff or FedAsync): the cloud dispatches clients as in a flat run; an edge folds
  each update with the staleness weight ``s(tau)``, ``tau`` counted against the cloud version the edge knows, and
  forwards after ``buffer_size`` folds or ``max_wait_s`` after its first. With ``buffer_size = 1`` an edge relays
  each client's upload unchanged to its parent, and the cloud admits it exactly as a flat server would.
* **sync** (HierFAVG, Liu et al., ICC 2020): per cloud round each edge runs ``kappa2`` edge rounds over its
  members of the cloud's cohort (each ``client.epochs``/``max_steps`` local training, kappa1), averages them into
  its edge model between rounds (:func:`~flasync.aggregation.edge_model`), and forwards
  ``E (w_cloud - w_edge)`` (:func:`~flasync.aggregation.edge_progress`) with ``E`` its members' samples.

Simulated links between an edge and its parent (:class:`EdgeLink`) cost ``latency + bytes / bandwidth`` on the run's
clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flasync.aggregation import (
    ConstantStaleness,
    ExampleWeight,
    StalenessWeight,
    UpdateBuffer,
    edge_model,
    edge_progress,
)
from flasync.codecs import Pipeline
from flasync.config import EdgeLinkConfig
from flasync.core import seeding
from flasync.core.bus import EventBus
from flasync.core.events import (
    ClientFailed,
    ClientTimedOut,
    EdgeForwarded,
    FailureKind,
    TaskAssigned,
    TaskClosed,
    TaskDiagnosis,
    TaskOutcome,
    UpdateUploaded,
    Version,
)
from flasync.core.snapshots import ModelSnapshot
from flasync.server.intake import Intake, Refused
from flasync.server.node import AggregationNode, BufferSink, PartialFolded, Sink
from flasync.server.registry import TaskRegistry, Timer
from flasync.server.topology import Tree

__all__ = ["EdgeLink", "EdgeNetwork", "EdgeNode", "EdgeSettings", "TierStats", "link_seconds"]

EdgeMessage = UpdateUploaded | ClientFailed | ClientTimedOut | EdgeForwarded


_MESSAGES: dict[str, type[Any]] = {
    "EdgeForwarded": EdgeForwarded,
    "TaskClosed": TaskClosed,
    "UpdateUploaded": UpdateUploaded,
}


def message_state(message: EdgeForwarded | TaskClosed | UpdateUploaded) -> dict[str, Any]:
    """Return a message on its way between edges and the cloud as checkpoint state (plain values and tensors)."""
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
    for name in ("payload", "extra"):
        data = fields.get(name)
        if isinstance(data, bytes):
            fields[name] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0)
    diagnosis = fields.get("diagnosis")
    if diagnosis is not None:
        fields["diagnosis"] = dataclasses.asdict(diagnosis)
    return {"type": type(message).__name__, "fields": fields}


def message_from_state(state: dict[str, Any]) -> EdgeForwarded | TaskClosed | UpdateUploaded:
    """Rebuild a message from :func:`message_state`."""
    kind = _MESSAGES[state["type"]]
    fields = dict(state["fields"])
    if "control" in fields:  # written before the field's name was ``extra``
        fields["extra"] = fields.pop("control")
    for name in ("payload", "extra"):
        if name in fields:
            fields[name] = bytes(fields[name].to(torch.uint8).numpy().tobytes())
    if fields.get("diagnosis") is not None:
        diagnosis: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in fields["diagnosis"].items()}
        fields["diagnosis"] = TaskDiagnosis(**diagnosis)
    message: EdgeForwarded | TaskClosed | UpdateUploaded = kind(**fields)
    return message


def link_seconds(link: EdgeLinkConfig, num_bytes: int, *, up: bool) -> float:
    """Return simulated seconds to move ``num_bytes`` over an edge's link (``up``: towards the cloud)."""
    rate = link.upload_bytes_per_s if up else link.download_bytes_per_s
    return link.latency_s + num_bytes / rate


@dataclass(slots=True)
class TierStats:
    """Totals of one tier (``edge1``, ``edge2``, ...)."""

    aggregations: int = 0
    updates_folded: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    model_bytes_in: int = 0
    aggregate_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeSettings:
    """How the edges of a run aggregate and talk to their parents.

    Attributes:
        buffer_size: Async: folds before a forward (1: relay each upload unchanged).
        max_wait_s: Async: forward what is held this long after the first fold (None: never).
        kappa2: Sync: edge aggregations per cloud round.
        link: The simulated link to the parent.
        per_edge_metrics: Also log figures per edge name.
        staleness: Async: ``s(tau)`` of an update at an edge.
        example_weight: ``e_k`` of an update at an edge.
        seed: The run's seed (partials' codec streams).
    """

    buffer_size: int
    max_wait_s: float | None
    kappa2: int
    link: EdgeLinkConfig
    per_edge_metrics: bool
    staleness: StalenessWeight
    example_weight: ExampleWeight
    seed: int


def relayed(message: object) -> bool:
    """Tell whether ``message`` is a client upload an edge relays unchanged (not the client's own send)."""
    return isinstance(message, UpdateUploaded) and message.tier != "client"


class EdgeLink:
    """The simulated link between an edge and its parent: models on their way down and partials or relayed uploads
    on their way up, each with the virtual time it arrives (what a checkpoint must start again).

    Args:
        name: The edge's name (its tasks are named after it).
        network: The edges of the run (the link's settings, the clock, the bus, the registry owning the tasks).
        install: Takes a model once it has reached the edge.

    Attributes:
        installs: The models on their way down, each with the time it arrives.
        sends: The messages on their way up, each with the time it arrives and whether the edge's receive loop waits
            for it.
    """

    def __init__(self, name: str, network: EdgeNetwork, install: Callable[[ModelSnapshot], None]) -> None:
        """Start with nothing on the way."""
        self.name = name
        self.net = network
        self.install = install
        self.installs: dict[int, tuple[ModelSnapshot, float]] = {}
        self.sends: dict[int, tuple[EdgeForwarded | UpdateUploaded, float, bool]] = {}
        self._keys = 0

    def download(self, snapshot: ModelSnapshot) -> None:
        """Move a model down to the edge: installed at once over a link that takes no time, else when it arrives."""
        net = self.net
        seconds = link_seconds(net.settings.link, snapshot.download_bytes, up=False)
        if seconds <= 0.0:
            self.install(snapshot)
        else:
            self.install_at(snapshot, net.clock.now() + seconds)

    def install_at(self, snapshot: ModelSnapshot, at: float) -> None:
        """Install ``snapshot`` at virtual time ``at`` (in a task of the registry's group)."""
        key = self._key()
        self.installs[key] = (snapshot, at)
        self.net.registry.spawn(self._install_later(key, snapshot, at), f"flasync-edge-{self.name}-model")

    async def _install_later(self, key: int, snapshot: ModelSnapshot, at: float) -> None:
        await self.net.clock.sleep_until(at)
        del self.installs[key]
        self.install(snapshot)

    def _key(self) -> int:
        self._keys += 1
        return self._keys

    async def send(self, message: EdgeForwarded | UpdateUploaded, *, loop: bool) -> None:
        """Send ``message`` to the parent over the link (``loop``: the edge's receive loop waits for it)."""
        net = self.net
        seconds = link_seconds(net.settings.link, len(message.payload), up=True)
        if seconds > 0.0:
            await self.send_until(message, net.clock.now() + seconds, loop=loop)
        else:
            await net.bus.publish(message)

    async def send_until(self, message: EdgeForwarded | UpdateUploaded, at: float, *, loop: bool) -> None:
        """Publish ``message`` at virtual time ``at``, held on the link until then."""
        key = self._key()
        self.sends[key] = (message, at, loop)
        try:
            await self.net.clock.sleep_until(at)
        finally:
            del self.sends[key]
        await self.net.bus.publish(message)


class EdgeNode:
    """One edge of the tree.

    Args:
        index: The edge's number in the tree.
        network: The edges of the run (shared counters, the tree, the registry).
        intake: This edge's admission of its clients' updates.
    """

    def __init__(self, index: int, network: EdgeNetwork, intake: Intake) -> None:
        """Subscribe to what the edge's children send it."""
        self.index = index
        self.net = network
        self.intake = intake
        tree = network.tree
        self.name = tree.names[index]
        self.tier = tree.tier(index)
        self.parent = tree.parent_address(index)
        self.children = tree.children[index]
        self.members = tree.members[index]
        self.snapshot: ModelSnapshot | None = None
        self.buffer = UpdateBuffer(network.num_params, device=network.device)
        self._node = AggregationNode(
            where=self.name,
            intake=intake,
            bus=network.bus,
            wall=network.wall,
            edge_codec=network.edge_codec,
            num_params=network.num_params,
            device=network.device,
        )
        settings = network.settings
        # Async edges discount each update by s(tau); a sync round's updates all start from the round's model.
        example_weight = settings.example_weight
        self._sink = BufferSink(self.buffer, example_weight=example_weight, staleness=settings.staleness)
        self._round_sink = BufferSink(self.buffer, example_weight=example_weight, staleness=ConstantStaleness())
        self._updates = 0  # client updates in the buffer
        self._round_updates = 0  # client updates folded since the last recorded aggregation
        self._samples = 0
        self._bytes_in = 0
        self._aggregate_s = 0.0
        self._generation = 0
        self.link = EdgeLink(self.name, network, self._install)
        # What a checkpoint must start again besides what is on the link: max_wait_s deadlines, each with its time,
        # and the send the receive loop was waiting for.
        self._deadlines: dict[int, float] = {}
        self._loop_send: tuple[EdgeForwarded | UpdateUploaded, float] | None = None
        self._restored: dict[str, Any] | None = None
        self.inbox = network.bus.subscribe(
            UpdateUploaded,
            ClientFailed,
            ClientTimedOut,
            EdgeForwarded,
            capacity=1_000_000,
            name=f"edge:{self.name}",
            address=self.name,
        )

    @property
    def known_version(self) -> Version:
        """The newest cloud version this edge holds (0 before the first arrives)."""
        return self.snapshot.version if self.snapshot is not None else Version(0)

    # ------------------------------------------------------------------------------------------ model relay
    def offer(self, snapshot: ModelSnapshot) -> None:
        """Start downloading a new global model from the parent; children get it once this edge has it."""
        self.net.tiers[self.tier].model_bytes_in += snapshot.download_bytes
        self.link.download(snapshot)

    def _install(self, snapshot: ModelSnapshot) -> None:
        if self.snapshot is not None and self.snapshot.version >= snapshot.version:
            return
        self.snapshot = snapshot
        for child in self.children:
            self.net.nodes[child].offer(snapshot)

    # ------------------------------------------------------------------------------------------- async mode
    async def run_async(self) -> None:
        """Fold and forward what arrives, until the run ends (after finishing a send a checkpoint caught)."""
        if self._loop_send is not None:
            message, at = self._loop_send
            self._loop_send = None
            await self.link.send_until(message, at, loop=True)
        async for message in self.inbox:
            await self._receive_async(message)

    async def _receive_async(self, message: EdgeMessage) -> None:
        """Handle one message: fold it, and forward when the buffer is full."""
        if isinstance(message, ClientFailed | ClientTimedOut):
            await self._ended(message)
            return
        if isinstance(message, EdgeForwarded):
            if self._fold_partial(message) is not None:
                await self._folded()
            return
        self._bytes_in += len(message.payload)
        if self.net.settings.buffer_size == 1:
            await self._relay(message)
            return
        if await self._admit(message, version=int(self.known_version), into=self._sink):
            await self._folded()

    async def _ended(self, message: ClientFailed | ClientTimedOut) -> None:
        """Close a task whose client failed or timed out (if it is still in flight)."""
        if not self.net.registry.release(message):
            return
        if isinstance(message, ClientFailed):
            await self._close(message, "failed", message.error, kind=message.kind)
        else:
            await self._close(message, "timed_out", f"no answer within {message.timeout_s:g} s")

    async def _admit(self, message: UpdateUploaded, *, version: int, into: Sink) -> bool:
        """Admit a client's update through the intake and fold it; False (and the update refused) if unusable.

        Args:
            message: The upload.
            version: The model version the edge holds (async) or runs its round on (sync).
            into: The buffer, discounting by ``s(tau)`` (async) or not (sync rounds).
        """
        folded = self._node.admit(message, version=version, into=into)
        if isinstance(folded, Refused):
            await self._node.reject(message, folded, simulated_s=self.net.clock.now())
            await self._close(message, "rejected", folded.reason, upload_bytes=len(message.payload))
            return False
        self._updates += 1
        self._round_updates += 1
        self._samples += message.num_samples
        self._aggregate_s += folded.aggregate_s
        staleness = folded.admitted.staleness
        await self._close(message, "accepted", "", staleness=staleness, upload_bytes=len(message.payload))
        return True

    def _fold_partial(self, message: EdgeForwarded) -> PartialFolded | None:
        """Add a sub-edge's partial aggregate; None if it held no update."""
        self._bytes_in += len(message.payload)
        folded = self._node.fold_partial(message, version=int(self.known_version), into=self._sink)
        if folded is not None:
            self._updates += message.count
            self._round_updates += message.count
            self._samples += message.num_samples
        return folded

    async def _folded(self) -> None:
        if self.buffer.count >= self.net.settings.buffer_size:
            await self._forward()
        elif self.buffer.count == 1 and self.net.settings.max_wait_s is not None:
            self._deadline_at(self._generation, self.net.clock.now() + self.net.settings.max_wait_s)

    def _deadline_at(self, generation: int, at: float) -> None:
        self._deadlines[generation] = at
        self.net.registry.spawn(self._deadline(generation, at), f"flasync-edge-{self.name}-deadline")

    async def _deadline(self, generation: int, at: float) -> None:
        await self.net.clock.sleep_until(at)
        self._deadlines.pop(generation, None)
        if generation == self._generation and self.buffer.count:
            await self._forward(loop=False)

    async def _relay(self, message: UpdateUploaded) -> None:
        """Pass one client's upload up unchanged (``buffer_size = 1``)."""
        size = len(message.payload)
        self._record(1, size, size)
        await self.link.send(dataclasses.replace(message, to=self.parent, tier=self.tier), loop=True)

    async def _forward(self, *, loop: bool = True) -> None:
        """Encode the buffer's partial aggregate, empty the buffer, and send it to the parent over the link."""
        net = self.net
        start = net.wall()
        generator = seeding.torch_stream(net.settings.seed, seeding.EDGE_CODEC, self.index, self._generation)
        weighted_sum = self.buffer.weighted_sum
        if weighted_sum.device.type != "cpu":
            weighted_sum = weighted_sum.cpu()  # the codec writes bytes
        payload = net.edge_codec.encode(weighted_sum, generator=generator).payload
        partial = EdgeForwarded(
            to=self.parent,
            edge=self.name,
            tier=self.tier,
            count=self._updates,
            num_samples=self._samples,
            example_weight=self.buffer.total_example_weight,
            base_version=self.known_version,
            payload=payload,
            simulated_s=net.clock.now(),
            sent_wall_s=net.wall(),
        )
        self._aggregate_s += net.wall() - start
        self._record(self._round_updates, self._bytes_in, len(payload))
        self.buffer.reset()
        self._updates, self._samples, self._bytes_in = 0, 0, 0
        self._generation += 1
        await self.link.send(partial, loop=loop)

    def _record(self, updates: int, bytes_in: int, bytes_out: int) -> None:
        """Count one edge aggregation in its tier and start the next one's figures."""
        queue_depth = self.inbox.statistics().queued
        self.net.record(self, updates, bytes_in, bytes_out, aggregate_s=self._aggregate_s, queue_depth=queue_depth)
        self._round_updates = 0
        self._aggregate_s = 0.0

    async def _close(
        self,
        task: UpdateUploaded | ClientFailed | ClientTimedOut,
        outcome: TaskOutcome,
        reason: str,
        *,
        staleness: int = 0,
        upload_bytes: int = 0,
        kind: FailureKind = "error",
    ) -> None:
        """Tell the cloud a task it dispatched is over (it counts the outcome and refills the slot)."""
        await self.net.bus.publish(
            TaskClosed(
                edge=self.name,
                task_id=task.task_id,
                client_id=task.client_id,
                base_version=task.base_version,
                outcome=outcome,
                reason=reason,
                staleness=staleness,
                upload_bytes=upload_bytes,
                simulated_s=self.net.clock.now(),
                kind=kind,
            )
        )

    # -------------------------------------------------------------------------------------------- sync mode
    async def sync_round(self, snapshot: ModelSnapshot, cohort: set[int]) -> None:
        """Run one cloud round of HierFAVG below this edge and forward the result to the parent.

        Args:
            snapshot: The cloud's model for this round (as the parent sent it).
            cohort: The clients the cloud sampled for this round.
        """
        net = self.net
        seconds = link_seconds(net.settings.link, snapshot.download_bytes, up=False)
        net.tiers[self.tier].model_bytes_in += snapshot.download_bytes
        if seconds > 0.0:
            await net.clock.sleep(seconds)
        if self.children:
            await self._sync_children(snapshot, cohort)
        else:
            await self._sync_leaf(snapshot, [int(c) for c in self.members if int(c) in cohort])
        await self._forward(loop=False)

    async def _sync_children(self, snapshot: ModelSnapshot, cohort: set[int]) -> None:
        net = self.net
        active = [child for child in self.children if net.subtree_has(child, cohort)]
        async with asyncio.TaskGroup() as tg:
            for child in active:
                tg.create_task(net.nodes[child].sync_round(snapshot, cohort), name=f"flasync-edge-{child}")
            for _ in active:
                message = await self.inbox.receive()
                assert isinstance(message, EdgeForwarded)
                folded = self._fold_partial(message)
                if folded is not None:
                    self._aggregate_s += folded.aggregate_s

    async def _sync_leaf(self, snapshot: ModelSnapshot, members: list[int]) -> None:
        net = self.net
        kappa2 = net.settings.kappa2
        weights = snapshot.weights
        total = 0
        last_weight = 0.0  # E of the last edge round anybody answered in
        for edge_round in range(kappa2):
            model = ModelSnapshot(
                version=snapshot.version, weights=weights, exact=weights, download_bytes=snapshot.download_bytes
            )
            tasks: list[TaskAssigned] = []
            for client in members:
                tasks.append(await net.registry.dispatch(client, model, reply_to=self.name))
            self.buffer.reset()
            self._updates, self._samples = 0, 0
            # Every task ends once: answered, failed, refused or timed out (a late duplicate finds nothing).
            while any(net.registry.busy.get(t.client_id) is t for t in tasks):
                await self._fold_sync(await self.inbox.receive(), int(snapshot.version))
            total += self._updates
            if self._updates:
                last_weight = self.buffer.total_example_weight
            if edge_round < kappa2 - 1:
                if self._updates:
                    weights = edge_model(weights, self.buffer.weighted_sum, last_weight)
                self._record(self._round_updates, self._bytes_in, 0)
                self._bytes_in = 0
        if kappa2 > 1 and total:
            if self._updates:
                weights = edge_model(weights, self.buffer.weighted_sum, last_weight)
            # The edge's whole progress this cloud round, weighted by the samples of its last answering members.
            progress = edge_progress(snapshot.weights, weights, last_weight)
            self.buffer.reset()
            self.buffer.add_sum(progress, example_weight=last_weight)
        self._updates = total

    async def _fold_sync(self, message: EdgeMessage, version: int) -> None:
        if isinstance(message, EdgeForwarded):  # pragma: no cover - leaves have no sub-edges
            raise AssertionError("a leaf edge received a partial")
        if isinstance(message, ClientFailed | ClientTimedOut):
            await self._ended(message)
            return
        self._bytes_in += len(message.payload)
        await self._admit(message, version=version, into=self._round_sink)

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Return the edge's buffer, counters, intake state, model, and what is on its links or pending.

        Partials queued in the edge's inbox are kept too; client answers queued there are not: their tasks are
        still in flight and replay from the checkpoint.
        """
        queued = [m for m in self.inbox.queued() if isinstance(m, EdgeForwarded) or relayed(m)]
        return {
            "snapshot_version": None if self.snapshot is None else int(self.snapshot.version),
            "installs": [(int(snapshot.version), at) for snapshot, at in self.link.installs.values()],
            "sends": [(message_state(message), at, loop) for message, at, loop in self.link.sends.values()],
            "deadlines": sorted(self._deadlines.items()),
            "queued": [message_state(m) for m in queued],
            "buffer": self.buffer.state_dict(),
            "updates": self._updates,
            "round_updates": self._round_updates,
            "samples": self._samples,
            "bytes_in": self._bytes_in,
            "generation": self._generation,
            "intake": self.intake.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], models: dict[int, ModelSnapshot] | None = None) -> None:
        """Restore :meth:`state_dict` (``models``: the snapshots by version the edge and its links hold)."""
        models = models or {}
        version = state.get("snapshot_version")
        self.snapshot = None if version is None else models[int(version)]
        self._restored = state
        self.buffer.load_state_dict(state["buffer"])
        self._updates = int(state["updates"])
        self._round_updates = int(state["round_updates"])
        self._samples = int(state["samples"])
        self._bytes_in = int(state["bytes_in"])
        self._generation = int(state["generation"])
        self.intake.load_state_dict(state["intake"])

    def resumed(self, models: dict[int, ModelSnapshot]) -> None:
        """Start again what a checkpoint caught on the way: installs, sends, deadlines, queued partials."""
        state = self._restored
        if state is None:
            return
        self._restored = None
        for version, at in state.get("installs", []):
            self.link.install_at(models[int(version)], float(at))
        for generation, at in state.get("deadlines", []):
            self._deadline_at(int(generation), float(at))
        for message_fields, at, loop in state.get("sends", []):
            message = message_from_state(message_fields)
            assert isinstance(message, EdgeForwarded | UpdateUploaded)
            if loop:
                self._loop_send = (message, float(at))  # run_async finishes it before reading the inbox
            else:
                self.net.registry.spawn(
                    self.link.send_until(message, float(at), loop=False), f"flasync-edge-{self.name}-send"
                )
        for message_fields in state.get("queued", []):
            self.net.bus.publish_nowait(message_from_state(message_fields))


class EdgeNetwork:
    """All the edges of a run, their shared counters, and their links.

    Args:
        tree: The aggregation tree.
        settings: How edges aggregate and forward.
        registry: The run's task registry (edges dispatch and close tasks there, and own their tasks by it).
        make_intake: Builds one edge's intake (each edge keeps its own validation history).
        bus: The run's event bus.
        clock: The run's clock.
        wall: Monotonic real seconds.
        log: The run's logger.
        edge_codec: Encodes and decodes partials.
        num_params: Length of the flat model.
        device: Where edge buffers live (the run's device).
    """

    def __init__(
        self,
        tree: Tree,
        settings: EdgeSettings,
        *,
        registry: TaskRegistry,
        make_intake: Callable[[], Intake],
        bus: EventBus,
        clock: Timer,
        wall: Callable[[], float],
        log: Any,
        edge_codec: Pipeline,
        num_params: int,
        device: torch.device,
    ) -> None:
        """Create every edge (each subscribes to its address on the bus)."""
        self.tree = tree
        self.settings = settings
        self.registry = registry
        self.bus = bus
        self.clock = clock
        self.wall = wall
        self.log = log
        self.edge_codec = edge_codec
        self.num_params = num_params
        self.device = device
        self.tiers = {f"edge{d}": TierStats() for d in sorted(set(tree.depths))}
        self.edge_steps: Counter[str] = Counter()
        self.nodes = [EdgeNode(i, self, make_intake()) for i in range(tree.num_edges)]
        self._models: dict[int, ModelSnapshot] = {}
        # For each edge, the clients below it (to tell which subtrees a sync cohort touches).
        below: list[np.ndarray] = [np.asarray(m, dtype=np.int64) for m in tree.members]
        for edge in reversed(range(tree.num_edges)):
            parent = tree.parents[edge]
            if parent >= 0:
                below[parent] = np.concatenate([below[parent], below[edge]])
        self._below = [frozenset(int(c) for c in b) for b in below]

    def start(self) -> None:
        """Start every edge's async receive loop in the registry's task group."""
        for node in self.nodes:
            self.registry.spawn(node.run_async(), f"flasync-edge-{node.name}")

    def subtree_has(self, edge: int, cohort: set[int]) -> bool:
        """Tell whether any client of ``cohort`` is below ``edge``."""
        below = self._below[edge]
        return any(client in below for client in cohort)

    def snapshot_for(self, client_id: int) -> ModelSnapshot | None:
        """Return the model ``client_id``'s edge holds (None before the first one arrives)."""
        return self.nodes[int(self.tree.client_edge[client_id])].snapshot

    def address_of(self, client_id: int) -> str:
        """Return the bus address ``client_id`` uploads to."""
        return self.tree.names[int(self.tree.client_edge[client_id])]

    def publish(self, snapshot: ModelSnapshot) -> int:
        """Send a new global model to the top edges; return the bytes that left the cloud."""
        top = self.tree.top
        for edge in top:
            self.nodes[edge].offer(snapshot)
        return len(top) * snapshot.download_bytes

    def sync_round(self, snapshot: ModelSnapshot, cohort: set[int]) -> int:
        """Start a HierFAVG cloud round in every top edge with cohort members; return how many started."""
        active = [edge for edge in self.tree.top if self.subtree_has(edge, cohort)]
        for edge in active:
            self.registry.spawn(self.nodes[edge].sync_round(snapshot, cohort), f"flasync-edge-{edge}-round")
        return len(active)

    def resumed(self) -> None:
        """Start again what the checkpoint caught on the edges' links and in their inboxes."""
        for node in self.nodes:
            node.resumed(self._models)

    def answered(self) -> set[int]:
        """Tasks whose answer a checkpoint holds on its way up (relayed uploads): they must not be replayed."""
        tasks: set[int] = set()
        for node in self.nodes:
            tasks.update(m.task_id for m, _, _ in node.link.sends.values() if isinstance(m, UpdateUploaded))
            tasks.update(m.task_id for m in node.inbox.queued() if relayed(m))
        return tasks

    def close(self) -> None:
        """Unsubscribe every edge."""
        for node in self.nodes:
            node.inbox.close()

    def state_dict(self) -> dict[str, Any]:
        """Return every edge's state, the models they hold or receive, and the tiers' counters."""
        models: dict[int, ModelSnapshot] = {}
        for node in self.nodes:
            if node.snapshot is not None:
                models[int(node.snapshot.version)] = node.snapshot
            for snapshot, _ in node.link.installs.values():
                models[int(snapshot.version)] = snapshot
        return {
            "models": [
                {
                    "version": v,
                    "weights": m.weights.clone(),
                    "exact": m.exact.clone(),
                    "download_bytes": m.download_bytes,
                }
                for v, m in sorted(models.items())
            ],
            "nodes": [node.state_dict() for node in self.nodes],
            "tiers": {name: dataclasses.asdict(tier) for name, tier in self.tiers.items()},
            "edge_steps": dict(self.edge_steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self._models = {
            int(m["version"]): ModelSnapshot(
                version=Version(int(m["version"])),
                weights=m["weights"].to(self.device),
                exact=m["exact"].to(self.device),
                download_bytes=int(m["download_bytes"]),
            )
            for m in state.get("models", [])
        }
        for node, node_state in zip(self.nodes, state["nodes"], strict=True):
            node.load_state_dict(node_state, self._models)
        self.tiers = {name: TierStats(**values) for name, values in state["tiers"].items()}
        self.edge_steps = Counter(state["edge_steps"])

    def record(
        self, node: EdgeNode, updates: int, bytes_in: int, bytes_out: int, *, aggregate_s: float, queue_depth: int
    ) -> None:
        """Count one aggregation of ``node`` in its tier and log it (per tier; per edge when configured)."""
        tier = self.tiers[node.tier]
        tier.aggregations += 1
        tier.updates_folded += updates
        tier.bytes_in += bytes_in
        tier.bytes_out += bytes_out
        tier.aggregate_s += aggregate_s
        figures = {
            "updates": updates,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "aggregate_s": aggregate_s,
            "queue_depth": queue_depth,
        }
        self.log.debug(f"tier.{node.tier}", step=tier.aggregations, **figures)
        if self.settings.per_edge_metrics:
            self.edge_steps[node.name] += 1
            self.log.debug(f"edge.{node.name}", step=self.edge_steps[node.name], **figures)

    def summary(self) -> dict[str, float]:
        """Return per-tier totals, flattened as ``{tier}.{figure}``."""
        out: dict[str, float] = {}
        for name, tier in self.tiers.items():
            out[f"{name}.aggregations"] = tier.aggregations
            out[f"{name}.updates_folded"] = tier.updates_folded
            out[f"{name}.bytes_in"] = tier.bytes_in
            out[f"{name}.bytes_out"] = tier.bytes_out
            out[f"{name}.model_bytes_in"] = tier.model_bytes_in
            out[f"{name}.aggregate_s"] = tier.aggregate_s
            out[f"{name}.updates_per_aggregation"] = (
                tier.updates_folded / tier.aggregations if tier.aggregations else math.nan
            )
        return out
