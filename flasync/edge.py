"""Edge coroutines: an aggregator for the clients (or sub-edges) below, a client of the parent above.

An edge folds what reaches it into one accumulator, ``sum_k e_k s_k delta_k`` and ``sum_k e_k``, and forwards that
partial aggregate to its parent as one dense message; a parent adds partials, so the cloud ends with exactly the
sums it would have built from the clients' updates (in floating point: up to the order of the additions). Edges
relay each new global model down, one download per edge per version, and clients download from their edge.

* **async** (the cloud runs FedBuff or FedAsync): the cloud dispatches clients as in a flat run; an edge folds
  each update with the staleness weight ``s(tau)``, ``tau`` counted against the cloud version the client started
  from, and forwards after ``buffer_size`` folds or ``max_wait_s`` after its first. With ``buffer_size = 1`` an
  edge relays each update unchanged (a *raw* partial), and the cloud treats it exactly as a flat server would.
* **sync** (HierFAVG, Liu et al., ICC 2020): per cloud round each edge runs ``kappa2`` edge rounds over its
  members of the cloud's cohort (each ``client.epochs``/``max_steps`` local training, kappa1), averages them into
  its edge model between rounds, and forwards ``E (w_cloud - w_edge)`` with ``E`` its members' samples.

Simulated links between an edge and its parent cost ``latency + bytes / bandwidth`` on the run's clock.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flasync import seeding
from flasync.aggregation import StalenessWeight
from flasync.client import ModelSnapshot
from flasync.config import EdgeLinkConfig, TreeTopology
from flasync.context import RunContext
from flasync.errors import DecodeError
from flasync.events import (
    ClientFailed,
    EdgeForwarded,
    TaskClosed,
    UpdateRejected,
    UpdateUploaded,
    Version,
)
from flasync.topology import Tree

if TYPE_CHECKING:
    from flasync.server import Server

__all__ = ["EdgeNetwork", "EdgeNode", "TierStats", "link_seconds"]


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


class EdgeNode:
    """One edge of the tree.

    Args:
        index: The edge's number in ``tree``.
        network: The edges of the run (shared counters, the tree, the server).
    """

    def __init__(self, index: int, network: EdgeNetwork) -> None:
        """Subscribe to what the edge's children send it."""
        self.index = index
        self.net = network
        tree = network.tree
        self.name = tree.names[index]
        self.tier = tree.tier(index)
        self.parent = tree.parent_address(index)
        self.children = tree.children[index]
        self.members = tree.members[index]
        ctx = network.ctx
        self.snapshot: ModelSnapshot | None = None
        self._acc = torch.zeros(ctx.num_params)
        self._weight = 0.0
        self._count = 0  # client updates in the accumulator
        self._round_updates = 0  # client updates folded since the last recorded aggregation
        self._folds = 0  # messages folded since the last forward
        self._samples = 0
        self._bytes_in = 0
        self._aggregate_s = 0.0
        self._generation = 0
        self.inbox = ctx.bus.subscribe(
            UpdateUploaded, ClientFailed, EdgeForwarded, capacity=1_000_000, name=f"edge:{self.name}", address=self.name
        )

    # ------------------------------------------------------------------------------------------ model relay
    def offer(self, snapshot: ModelSnapshot) -> None:
        """Start downloading a new global model from the parent; children get it once this edge has it."""
        seconds = link_seconds(self.net.config.link, snapshot.download_bytes, up=False)
        self.net.tiers[self.tier].model_bytes_in += snapshot.download_bytes
        if seconds <= 0.0:
            self._install(snapshot)
        else:
            self.net.spawn(self._install_later(snapshot, seconds), f"flasync-edge-{self.name}-model")

    async def _install_later(self, snapshot: ModelSnapshot, seconds: float) -> None:
        await self.net.ctx.clock.sleep(seconds)
        self._install(snapshot)

    def _install(self, snapshot: ModelSnapshot) -> None:
        if self.snapshot is not None and self.snapshot.version >= snapshot.version:
            return
        self.snapshot = snapshot
        for child in self.children:
            self.net.nodes[child].offer(snapshot)

    # ------------------------------------------------------------------------------------------- async mode
    async def run_async(self) -> None:
        """Fold and forward what arrives, until the run ends."""
        async for message in self.inbox:
            await self._receive_async(message)

    async def _receive_async(self, message: UpdateUploaded | ClientFailed | EdgeForwarded) -> None:
        """Handle one message: fold it, and forward when the buffer is full."""
        net = self.net
        server = net.server
        if isinstance(message, ClientFailed):
            if server.release(message):
                await self._close(
                    message.task_id, message.client_id, message.base_version, "failed", message.error, 0, 0
                )
            return
        if isinstance(message, EdgeForwarded) and not message.raw:
            if self._fold_partial(message):
                await self._folded()
            return
        # A client's update, directly or relayed unchanged by a sub-edge.
        self._bytes_in += len(message.payload)
        if net.config.buffer_size == 1:
            await self._relay_raw(message)
            return
        # The edge closes the task in the cloud's registry itself, so a duplicate is refused here.
        if not server.release(message):
            await self._reject(message, "unexpected", f"client {message.client_id} has no task {message.task_id}")
            return
        start = time.perf_counter()
        known = self.snapshot.version if self.snapshot is not None else Version(0)
        staleness = int(known) - int(message.base_version)
        limit = server.max_staleness
        if staleness < 0:
            await self._reject(message, "unknown_version", f"base version {message.base_version} is not known here")
            return
        if limit is not None and staleness > limit:
            await self._reject(message, "stale", f"staleness {staleness} > max_staleness {limit}")
            return
        delta = await self._decode(message)
        if delta is None:
            return
        example = float(message.num_samples) if net.by_samples else 1.0
        self._fold(delta, message.num_samples, example, net.staleness(staleness))
        self._aggregate_s += time.perf_counter() - start
        await self._close(
            message.task_id,
            message.client_id,
            message.base_version,
            "accepted",
            "",
            staleness,
            len(message.payload),
        )
        await self._folded()

    async def _decode(self, message: UpdateUploaded | EdgeForwarded) -> torch.Tensor | None:
        """Decode a client's update with full validation; None (and the update rejected) if it is unusable."""
        ctx = self.net.ctx
        try:
            delta = ctx.upload_codec.decode(message.payload, expected_elements=ctx.num_params)
        except DecodeError as exc:
            await self._reject(message, "decode", str(exc))
            return None
        if not bool(torch.isfinite(delta).all()):
            await self._reject(message, "non_finite", "update contains NaN or Inf")
            return None
        return delta

    def _fold(self, delta: torch.Tensor, num_samples: int, example: float, staleness_weight: float) -> None:
        """Add one client's delta with weight ``e * s(tau)``."""
        self._acc.add_(delta, alpha=example * staleness_weight)
        self._weight += example
        self._count += 1
        self._round_updates += 1
        self._samples += num_samples

    def _fold_partial(self, message: EdgeForwarded) -> bool:
        """Add a sub-edge's partial aggregate; False if it held no update."""
        self._bytes_in += len(message.payload)
        if message.count == 0:
            return False
        try:
            partial = self.net.ctx.edge_codec.decode(message.payload, expected_elements=self.net.ctx.num_params)
        except DecodeError as exc:  # pragma: no cover - edges encode these themselves
            raise AssertionError(f"edge {message.edge} sent an undecodable partial: {exc}") from exc
        self._acc.add_(partial)
        self._weight += message.example_weight
        self._count += message.count
        self._round_updates += message.count
        self._samples += message.num_samples
        return True

    async def _folded(self) -> None:
        self._folds += 1
        if self._folds >= self.net.config.buffer_size:
            await self._forward()
        elif self._folds == 1 and self.net.config.max_wait_s is not None:
            self.net.spawn(self._deadline(self._generation), f"flasync-edge-{self.name}-deadline")

    async def _deadline(self, generation: int) -> None:
        assert self.net.config.max_wait_s is not None
        await self.net.ctx.clock.sleep(self.net.config.max_wait_s)
        if generation == self._generation and self._folds:
            await self._forward()

    async def _relay_raw(self, message: UpdateUploaded | EdgeForwarded) -> None:
        """Pass one client's update up unchanged (``buffer_size = 1``)."""
        payload = message.payload
        raw = EdgeForwarded(
            to=self.parent,
            edge=self.name,
            tier=self.tier,
            raw=True,
            count=1,
            num_samples=message.num_samples,
            example_weight=float(message.num_samples),
            base_version=message.base_version,
            task_id=message.task_id,
            client_id=message.client_id,
            payload=payload,
            simulated_s=self.net.ctx.clock.now(),
            sent_wall_s=message.sent_wall_s,
        )
        self._record(1, len(payload), len(payload))
        await self._send(raw)

    async def _forward(self) -> None:
        """Encode the accumulator, reset it, and send it to the parent over the simulated link."""
        start = time.perf_counter()
        ctx = self.net.ctx
        generator = seeding.torch_stream(ctx.config.seed, seeding.EDGE_CODEC, self.index, self._generation)
        payload = ctx.edge_codec.encode(self._acc, generator=generator).payload
        known = self.snapshot.version if self.snapshot is not None else Version(0)
        partial = EdgeForwarded(
            to=self.parent,
            edge=self.name,
            tier=self.tier,
            raw=False,
            count=self._count,
            num_samples=self._samples,
            example_weight=self._weight,
            base_version=known,
            payload=payload,
            simulated_s=self.net.ctx.clock.now(),
            sent_wall_s=self.net.ctx.wall(),
        )
        self._aggregate_s += time.perf_counter() - start
        self._record(self._round_updates, self._bytes_in, len(payload))
        self._acc.zero_()
        self._weight, self._count, self._folds, self._samples, self._bytes_in = 0.0, 0, 0, 0, 0
        self._generation += 1
        await self._send(partial)

    async def _send(self, message: EdgeForwarded) -> None:
        seconds = link_seconds(self.net.config.link, len(message.payload), up=True)
        if seconds > 0.0:
            await self.net.ctx.clock.sleep(seconds)
        await self.net.ctx.bus.publish(message)

    def _record(self, updates: int, bytes_in: int, bytes_out: int) -> None:
        """Count one edge aggregation in its tier and log it (per tier; per edge when configured)."""
        net = self.net
        tier = net.tiers[self.tier]
        tier.aggregations += 1
        tier.updates_folded += updates
        tier.bytes_in += bytes_in
        tier.bytes_out += bytes_out
        tier.aggregate_s += self._aggregate_s
        self._round_updates = 0
        figures = {
            "updates": updates,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "aggregate_s": self._aggregate_s,
            "queue_depth": self.inbox.statistics().queued,
        }
        self._aggregate_s = 0.0
        net.ctx.log.debug(f"tier.{self.tier}", step=tier.aggregations, **figures)
        if net.config.per_edge_metrics:
            net.edge_steps[self.name] += 1
            net.ctx.log.debug(f"edge.{self.name}", step=net.edge_steps[self.name], **figures)

    async def _close(
        self,
        task_id: int,
        client_id: Any,
        base_version: Version,
        outcome: str,
        reason: str,
        staleness: int,
        upload_bytes: int,
    ) -> None:
        """Tell the cloud a task it dispatched is over (it counts the outcome and refills the slot)."""
        await self.net.ctx.bus.publish(
            TaskClosed(
                edge=self.name,
                task_id=task_id,
                client_id=client_id,
                base_version=base_version,
                outcome=outcome,
                reason=reason,
                staleness=staleness,
                upload_bytes=upload_bytes,
                simulated_s=self.net.ctx.clock.now(),
            )
        )

    async def _reject(self, message: UpdateUploaded | EdgeForwarded, reason: str, detail: str) -> None:
        await self.net.ctx.bus.publish(
            UpdateRejected(
                task_id=message.task_id,
                client_id=message.client_id,
                base_version=message.base_version,
                reason=reason,
                detail=detail,
                simulated_s=self.net.ctx.clock.now(),
                where=self.name,
            )
        )
        await self._close(
            message.task_id, message.client_id, message.base_version, "rejected", reason, 0, len(message.payload)
        )

    # -------------------------------------------------------------------------------------------- sync mode
    async def sync_round(self, snapshot: ModelSnapshot, cohort: set[int]) -> None:
        """Run one cloud round of HierFAVG below this edge and forward the result to the parent.

        Args:
            snapshot: The cloud's model for this round (as the parent sent it).
            cohort: The clients the cloud sampled for this round.
        """
        net = self.net
        seconds = link_seconds(net.config.link, snapshot.download_bytes, up=False)
        net.tiers[self.tier].model_bytes_in += snapshot.download_bytes
        if seconds > 0.0:
            await net.ctx.clock.sleep(seconds)
        if self.children:
            await self._sync_children(snapshot, cohort)
        else:
            await self._sync_leaf(snapshot, [int(c) for c in self.members if int(c) in cohort])
        await self._forward()

    async def _sync_children(self, snapshot: ModelSnapshot, cohort: set[int]) -> None:
        net = self.net
        active = [child for child in self.children if net.subtree_has(child, cohort)]
        async with asyncio.TaskGroup() as tg:
            for child in active:
                tg.create_task(net.nodes[child].sync_round(snapshot, cohort), name=f"flasync-edge-{child}")
            for _ in active:
                message = await self.inbox.receive()
                assert isinstance(message, EdgeForwarded) and not message.raw
                start = time.perf_counter()
                self._fold_partial(message)
                self._aggregate_s += time.perf_counter() - start

    async def _sync_leaf(self, snapshot: ModelSnapshot, members: list[int]) -> None:
        net, server = self.net, self.net.server
        kappa2 = net.config.kappa2
        weights = snapshot.weights
        total = 0
        for edge_round in range(kappa2):
            model = ModelSnapshot(
                version=snapshot.version, weights=weights, exact=weights, download_bytes=snapshot.download_bytes
            )
            for client in members:
                await server.dispatch(client, model, reply_to=self.name)
            self._acc.zero_()
            self._weight, self._count, self._samples = 0.0, 0, 0
            for _ in members:
                message = await self.inbox.receive()
                await self._fold_sync(message)
            total += self._count
            if edge_round < kappa2 - 1:
                if self._count:
                    # Edge aggregation: the edge model becomes its members' sample-weighted mean.
                    weights = weights - self._acc / self._weight
                self._record(self._round_updates, self._bytes_in, 0)
                self._bytes_in = 0
        if kappa2 > 1 and self._count:
            # Forward E * (w_cloud - w_edge), the edge's whole progress this cloud round, weighted by its data.
            weights = weights - self._acc / self._weight
            self._acc = (snapshot.weights - weights).mul_(self._weight)
        self._count = total

    async def _fold_sync(self, message: UpdateUploaded | ClientFailed | EdgeForwarded) -> None:
        server = self.net.server
        if isinstance(message, EdgeForwarded):  # pragma: no cover - leaves have no sub-edges
            raise AssertionError("a leaf edge received a partial")
        if not server.release(message):
            return
        if isinstance(message, ClientFailed):
            await self._close(message.task_id, message.client_id, message.base_version, "failed", message.error, 0, 0)
            return
        self._bytes_in += len(message.payload)
        start = time.perf_counter()
        delta = await self._decode(message)
        if delta is None:
            return
        self._fold(delta, message.num_samples, float(message.num_samples), 1.0)
        self._aggregate_s += time.perf_counter() - start
        await self._close(
            message.task_id, message.client_id, message.base_version, "accepted", "", 0, len(message.payload)
        )


class EdgeNetwork:
    """All the edges of a run, their shared counters, and the link to the server.

    Args:
        tree: The aggregation tree.
        config: The topology section.
        ctx: The run's shared wiring.
        server: The cloud (dispatches clients, holds the task registry).
        staleness: The staleness weight async edges apply.
        by_samples: Weigh updates by their samples (else equally).
        spawn: Starts a background task in the server's task group.
    """

    def __init__(
        self,
        tree: Tree,
        config: TreeTopology,
        ctx: RunContext,
        server: Server,
        *,
        staleness: StalenessWeight,
        by_samples: bool,
        spawn: Callable[[Any, str], None],
    ) -> None:
        """Create every edge (each subscribes to its address on the bus)."""
        self.tree = tree
        self.config = config
        self.ctx = ctx
        self.server = server
        self.staleness = staleness
        self.by_samples = by_samples
        self.spawn = spawn
        self.tiers = {f"edge{d}": TierStats() for d in sorted(set(tree.depths))}
        self.edge_steps: Counter[str] = Counter()
        self.nodes = [EdgeNode(i, self) for i in range(tree.num_edges)]
        # For each edge, the clients below it (to tell which subtrees a sync cohort touches).
        below: list[np.ndarray] = [np.asarray(m, dtype=np.int64) for m in tree.members]
        for edge in reversed(range(tree.num_edges)):
            parent = tree.parents[edge]
            if parent >= 0:
                below[parent] = np.concatenate([below[parent], below[edge]])
        self._below = [frozenset(int(c) for c in b) for b in below]

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

    def close(self) -> None:
        """Unsubscribe every edge."""
        for node in self.nodes:
            node.inbox.close()

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
