"""The server coroutine: dispatch client tasks, receive updates from the bus, aggregate, publish versions.

Two modes share one loop body:

* **async** (FedBuff, FedAsync): ``concurrency`` tasks are always in flight; every arriving update is checked,
  weighted by its staleness ``tau = version_now - base_version`` and folded in; each arrival frees a slot that is
  refilled at once with a newly sampled idle client.
* **sync** (FedAvg): each round samples a cohort, waits for every member (a barrier), and takes one server step.

The maths lives in :mod:`flasync.aggregation`; this module only orchestrates.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from flasync import codecs, seeding
from flasync.aggregation import (
    ConstantStaleness,
    HingeStaleness,
    PolynomialStaleness,
    ServerOptimizer,
    StalenessWeight,
    UpdateBuffer,
    fedasync_mix_,
)
from flasync.client import Client, ModelSnapshot
from flasync.config import (
    AdamServerOptimizer,
    ConstantStalenessConfig,
    FedAsyncServer,
    FedAvgServer,
    FedBuffServer,
    HingeStalenessConfig,
    ServerOptimizerConfig,
    StalenessConfig,
    TreeTopology,
)
from flasync.context import RunContext
from flasync.edge import EdgeNetwork
from flasync.errors import DecodeError, TrainingError
from flasync.events import (
    CLOUD,
    Aggregated,
    ClientFailed,
    ClientId,
    EdgeForwarded,
    Evaluated,
    ModelPublished,
    RunFinished,
    TaskAssigned,
    TaskClosed,
    UpdateReceived,
    UpdateRejected,
    UpdateUploaded,
    Version,
)
from flasync.training import evaluate

_DENSE = codecs.Pipeline()

__all__ = ["Server", "ServerStats", "make_server_optimizer", "make_staleness_weight", "warm_up"]


def make_staleness_weight(config: StalenessConfig) -> StalenessWeight:
    """Build the staleness weight function a config names."""
    if isinstance(config, ConstantStalenessConfig):
        return ConstantStaleness()
    if isinstance(config, HingeStalenessConfig):
        return HingeStaleness(a=config.a, b=config.b)
    return PolynomialStaleness(a=config.a)


def make_server_optimizer(weights: torch.Tensor, config: ServerOptimizerConfig) -> ServerOptimizer:
    """Build the server optimizer a config names, stepping ``weights`` in place."""
    if isinstance(config, AdamServerOptimizer):
        return ServerOptimizer.adam(weights, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
    return ServerOptimizer.sgd(weights, lr=config.lr, momentum=config.momentum)


def warm_up(config: ServerOptimizerConfig | None) -> None:
    """Build and step a throwaway server optimizer, off the event loop.

    ``torch.optim`` imports ``torch._dynamo`` (over a second) the first time an optimizer is built; the runtime calls
    this from its preparation thread so that import never stalls the event loop.
    """
    if config is not None:
        make_server_optimizer(torch.zeros(1), config).step(torch.zeros(1))


@dataclass(slots=True)
class ServerStats:
    """Counters and last figures of a server run."""

    updates_accepted: int = 0
    updates_dropped: int = 0
    updates_failed: int = 0
    tasks_dispatched: int = 0
    upload_bytes: int = 0
    download_bytes: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    cloud_ingress_bytes: int = 0
    cloud_egress_bytes: int = 0
    cloud_aggregate_s: float = 0.0
    partials_received: int = 0
    versions: int = 0
    accuracy: float = math.nan
    loss: float = math.nan
    evaluated_version: int = -1
    stop_reason: str = ""
    drop_reasons: Counter[str] = field(default_factory=Counter)


class _Strategy(Protocol):
    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        """Fold one update in; return its staleness weight."""
        ...

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        """Fold an edge's partial aggregate ``sum_k e_k s_k delta_k`` in; return its staleness weight."""
        ...

    def ready(self) -> bool:
        """Tell whether a new version should be produced now."""
        ...

    def step(self) -> None:
        """Apply the pending aggregate to the server weights (in place)."""
        ...


class _Buffered:
    """FedBuff and FedAvg: accumulate weighted deltas, then one server-optimizer step."""

    def __init__(
        self,
        weights: torch.Tensor,
        *,
        size: int,
        staleness: StalenessWeight,
        by_samples: bool,
        optimizer: ServerOptimizerConfig,
    ) -> None:
        self.buffer = UpdateBuffer(weights.numel(), device=weights.device)
        self.optimizer = make_server_optimizer(weights, optimizer)
        self.size = size
        self.staleness = staleness
        self.by_samples = by_samples

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        weight = self.staleness(staleness)
        example = float(num_samples) if self.by_samples else 1.0
        self.buffer.add(delta, example_weight=example, staleness_weight=weight)
        return weight

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        weight = self.staleness(staleness)
        self.buffer.add_sum(weighted_sum, example_weight=example_weight, staleness_weight=weight)
        return weight

    def ready(self) -> bool:
        return self.buffer.count >= self.size

    def step(self) -> None:
        self.optimizer.step(self.buffer.pseudo_gradient())
        self.buffer.reset()


class _Mixing:
    """FedAsync: every update is mixed into the weights at once."""

    def __init__(self, weights: torch.Tensor, *, alpha: float, staleness: StalenessWeight) -> None:
        self.weights = weights
        self.alpha = alpha
        self.staleness = staleness
        self._pending = False

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        weight = self.staleness(staleness)
        local = base - delta
        fedasync_mix_(self.weights, local, self.alpha * weight)
        self._pending = True
        return weight

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        # The edge's mean delta applied at rate alpha * s: w <- (1 - a) w + a (w - mean delta).
        weight = self.staleness(staleness)
        self.weights.sub_(weighted_sum, alpha=self.alpha * weight / example_weight)
        self._pending = True
        return weight

    def ready(self) -> bool:
        return self._pending

    def step(self) -> None:
        self._pending = False


class Server:
    """The server of one run.

    Args:
        ctx: The run's shared wiring.
        weights: Initial flat global weights; the server owns and updates this tensor.
    """

    def __init__(self, ctx: RunContext, weights: torch.Tensor) -> None:
        """Subscribe to client results and build the aggregation strategy."""
        self.ctx = ctx
        self.cfg = ctx.config.server
        self.weights = weights
        self.version = Version(0)
        self.stats = ServerStats()
        self._rng = seeding.numpy_stream(ctx.config.seed, seeding.SERVER)
        self._snapshot: ModelSnapshot | None = None
        self._bases: dict[Version, ModelSnapshot] = {}
        self._base_refs: Counter[Version] = Counter()
        self._in_flight: dict[ClientId, TaskAssigned] = {}
        self._participations = np.zeros(len(ctx.population), dtype=np.int64)
        self._failure_streak = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._start_wall = 0.0
        self._round_staleness: list[int] = []
        cfg = self.cfg
        in_flight = cfg.clients_per_round if isinstance(cfg, FedAvgServer) else cfg.concurrency
        capacity = 2 * in_flight + 8
        # Every task of several waves failing means the model or data is broken, not an unlucky client.
        self._failure_limit = max(3 * in_flight, 30)
        self._ingress_since_version = 0
        self._egress_since_version = 0
        # Edges may hold many finished tasks' answers at once: the cloud's inbox must never block them.
        capacity = capacity if ctx.tree is None else max(capacity, 4 * ctx.tree.num_edges + 2 * in_flight + 8)
        self._inbox = ctx.bus.subscribe(
            UpdateUploaded, ClientFailed, EdgeForwarded, TaskClosed, capacity=capacity, name="server", address=CLOUD
        )
        self.max_staleness = cfg.max_staleness if isinstance(cfg, FedBuffServer | FedAsyncServer) else None
        self.strategy: _Strategy
        if isinstance(cfg, FedAvgServer):
            self.strategy = _Buffered(
                weights,
                size=cfg.clients_per_round,
                staleness=ConstantStaleness(),
                by_samples=True,
                optimizer=cfg.optimizer,
            )
        elif isinstance(cfg, FedBuffServer):
            self.strategy = _Buffered(
                weights,
                size=cfg.buffer_size,
                staleness=make_staleness_weight(cfg.staleness),
                by_samples=cfg.example_weight == "samples",
                optimizer=cfg.optimizer,
            )
        else:
            self.strategy = _Mixing(weights, alpha=cfg.alpha, staleness=make_staleness_weight(cfg.staleness))
        self.edges: EdgeNetwork | None = None
        if ctx.tree is not None:
            assert isinstance(ctx.config.topology, TreeTopology)
            self.edges = EdgeNetwork(
                ctx.tree,
                ctx.config.topology,
                ctx,
                self,
                staleness=make_staleness_weight(cfg.staleness)
                if isinstance(cfg, FedBuffServer | FedAsyncServer)
                else ConstantStaleness(),
                by_samples=isinstance(cfg, FedBuffServer) and cfg.example_weight == "samples",
                spawn=self._spawn,
            )

    # ------------------------------------------------------------------------------------------------ run
    async def run(self) -> ServerStats:
        """Run until a stop condition holds; return the final counters (the final model is :attr:`weights`)."""
        self._start_wall = self.ctx.wall()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                try:
                    if self.edges is not None and not isinstance(self.cfg, FedAvgServer):
                        for node in self.edges.nodes:
                            self._spawn(node.run_async(), f"flasync-edge-{node.name}")
                    await self._publish()
                    await self._evaluate()
                    if isinstance(self.cfg, FedAvgServer):
                        await self._run_sync(self.cfg)
                    else:
                        await self._run_async(self.cfg.concurrency)
                finally:
                    for task in list(self._tasks):
                        task.cancel()
        finally:
            self._inbox.close()
            if self.edges is not None:
                self.edges.close()
            self._tg = None
        if self.stats.evaluated_version != self.version:
            await self._evaluate()
        ctx, stats = self.ctx, self.stats
        await ctx.bus.publish(
            RunFinished(
                reason=stats.stop_reason,
                versions=stats.versions,
                updates_accepted=stats.updates_accepted,
                simulated_s=ctx.clock.now(),
                wall_s=ctx.wall() - self._start_wall,
            )
        )
        return stats

    async def _run_async(self, concurrency: int) -> None:
        while len(self._in_flight) < concurrency:
            await self.dispatch(self._sample_idle())
        async for message in self._inbox:
            await self._handle(message)
            if self.strategy.ready():
                await self._new_version()
            if self._stop_reason():
                return
            while len(self._in_flight) < concurrency:
                await self.dispatch(self._sample_idle())

    async def _run_sync(self, cfg: FedAvgServer) -> None:
        num_clients = len(self.ctx.population)
        strategy = self.ctx.config.population.sampling
        while not self._stop_reason():
            if strategy == "uniform":
                cohort = self._rng.choice(num_clients, size=cfg.clients_per_round, replace=False)
            else:
                cohort = self.ctx.population.sample(
                    cfg.clients_per_round, self._rng, strategy=strategy, now=self.ctx.clock.now()
                )
            if self.edges is not None:
                await self._sync_tree_round(self.edges, set(cohort.tolist()))
            else:
                for client_id in cohort.tolist():
                    await self.dispatch(ClientId(client_id))
                while self._in_flight:
                    await self._handle(await self._inbox.receive())
            if self._stop_reason():  # a wall-time limit may end a round early
                return
            if isinstance(self.strategy, _Buffered) and self.strategy.buffer.count:
                await self._new_version()  # with failed members, the ones that answered
            else:
                self.ctx.log.warning("server.round_empty", step=int(self.version), metrics=False)

    async def _sync_tree_round(self, edges: EdgeNetwork, cohort: set[int]) -> None:
        """One HierFAVG cloud round: every top edge with cohort members runs its rounds and forwards a partial."""
        assert self._snapshot is not None
        active = [edge for edge in edges.tree.top if edges.subtree_has(edge, cohort)]
        self.stats.cloud_egress_bytes += len(active) * self._snapshot.download_bytes
        self._egress_since_version += len(active) * self._snapshot.download_bytes
        for edge in active:
            self._spawn(edges.nodes[edge].sync_round(self._snapshot, cohort), f"flasync-edge-{edge}-round")
        pending = len(active)
        while pending:
            message = await self._inbox.receive()
            pending -= isinstance(message, EdgeForwarded)
            await self._handle(message)

    def _spawn(self, coro: Any, name: str) -> None:
        """Start a background task of this run (cancelled when the server stops)."""
        assert self._tg is not None
        handle = self._tg.create_task(coro, name=name)
        self._tasks.add(handle)
        handle.add_done_callback(self._tasks.discard)

    def count_accepted(self, staleness: int) -> None:
        """Count one client update an edge folded in."""
        stats = self.stats
        self._failure_streak = 0
        stats.updates_accepted += 1
        stats.staleness_sum += staleness
        stats.staleness_max = max(stats.staleness_max, staleness)
        self._round_staleness.append(staleness)

    def count_rejected(self, reason: str) -> None:
        """Count one client update an edge refused."""
        self.stats.updates_dropped += 1
        self.stats.drop_reasons[reason] += 1

    # ------------------------------------------------------------------------------------------- dispatch
    def _sample_idle(self) -> ClientId:
        population = self.ctx.population
        strategy = self.ctx.config.population.sampling
        if strategy != "uniform":
            drawn = population.sample(
                1, self._rng, strategy=strategy, now=self.ctx.clock.now(), exclude=self._in_flight
            )
            return ClientId(int(drawn[0]))
        num_clients = len(population)
        while True:
            candidate = ClientId(int(self._rng.integers(num_clients)))
            if candidate not in self._in_flight:
                return candidate

    async def dispatch(
        self, client_id: ClientId | int, snapshot: ModelSnapshot | None = None, *, reply_to: str | None = None
    ) -> None:
        """Start a task for ``client_id`` on ``snapshot`` (default: the model its edge, or the cloud, holds).

        Args:
            client_id: The client.
            snapshot: The model to train from (a sync edge passes its edge model).
            reply_to: Where the client uploads (default: its edge, or the cloud).
        """
        assert self._tg is not None and self._snapshot is not None
        client_id = ClientId(int(client_id))
        edges = self.edges
        if snapshot is None:
            snapshot = (edges.snapshot_for(client_id) if edges is not None else None) or self._snapshot
        if reply_to is None:
            reply_to = edges.address_of(client_id) if edges is not None else CLOUD
        # An edge may still serve a version the cloud has moved past: keep its weights while tasks use it.
        self._bases.setdefault(snapshot.version, snapshot)
        participation = int(self._participations[client_id])
        self._participations[client_id] = participation + 1
        self.ctx.population.mark_used([client_id])
        task = TaskAssigned(
            task_id=self.stats.tasks_dispatched,
            client_id=client_id,
            participation=participation,
            base_version=snapshot.version,
            simulated_s=self.ctx.clock.now(),
            reply_to=reply_to,
        )
        self.stats.tasks_dispatched += 1
        self.stats.download_bytes += snapshot.download_bytes
        if edges is None:
            self.stats.cloud_egress_bytes += snapshot.download_bytes
            self._egress_since_version += snapshot.download_bytes
        self._in_flight[client_id] = task
        self._base_refs[snapshot.version] += 1
        await self.ctx.bus.publish(task)
        handle = self._tg.create_task(
            Client(client_id, self.ctx).run(task, snapshot),
            name=f"flasync-client-{client_id}-task-{task.task_id}",
        )
        self._tasks.add(handle)
        handle.add_done_callback(self._tasks.discard)

    def release(self, message: UpdateUploaded | ClientFailed | EdgeForwarded | TaskClosed) -> bool:
        """Close the task a message answers; False if no such task is in flight (nothing is changed then)."""
        task = self._in_flight.get(message.client_id)
        if task is None or task.task_id != message.task_id or task.base_version != message.base_version:
            return False
        del self._in_flight[message.client_id]
        base_version = task.base_version
        self._base_refs[base_version] -= 1
        if self._base_refs[base_version] <= 0:
            del self._base_refs[base_version]
            if self._snapshot is None or base_version != self._snapshot.version:
                self._bases.pop(base_version, None)
        return True

    # ------------------------------------------------------------------------------------------- receive
    async def _handle(self, message: UpdateUploaded | ClientFailed | EdgeForwarded | TaskClosed) -> None:
        if isinstance(message, TaskClosed):
            self._task_closed(message)
            return
        if isinstance(message, ClientFailed):
            if self.release(message):
                self._count_failure(message.error)
            return
        self.stats.cloud_ingress_bytes += len(message.payload)
        self._ingress_since_version += len(message.payload)
        if isinstance(message, EdgeForwarded):
            self.stats.partials_received += 1
            if not message.raw:
                self._fold_partial(message)
                return
        base = self._bases.get(message.base_version)
        ctx, stats = self.ctx, self.stats
        received_wall = ctx.wall()
        stats.upload_bytes += len(message.payload)
        if not self.release(message):
            await self._reject(message, "unexpected", f"client {message.client_id} has no task {message.task_id}")
            return
        staleness = int(self.version) - int(message.base_version)
        if base is None or staleness < 0:
            await self._reject(message, "unknown_version", f"base version {message.base_version} was never published")
            return
        limit = self.cfg.max_staleness if isinstance(self.cfg, FedBuffServer | FedAsyncServer) else None
        if limit is not None and staleness > limit:
            await self._reject(message, "stale", f"staleness {staleness} > max_staleness {limit}")
            return
        try:
            delta = ctx.upload_codec.decode(message.payload, expected_elements=ctx.num_params).to(self.weights.device)
        except DecodeError as exc:
            await self._reject(message, "decode", str(exc))
            return
        decode_s = ctx.wall() - received_wall
        if not bool(torch.isfinite(delta).all()):
            await self._reject(message, "non_finite", "update contains NaN or Inf")
            return
        weight = self.strategy.add(delta, staleness=staleness, num_samples=message.num_samples, base=base.weights)
        stats.cloud_aggregate_s += ctx.wall() - received_wall
        self._failure_streak = 0
        stats.updates_accepted += 1
        stats.staleness_sum += staleness
        stats.staleness_max = max(stats.staleness_max, staleness)
        self._round_staleness.append(staleness)
        ctx.log.debug(
            "server.update",
            step=stats.updates_accepted,
            staleness=staleness,
            staleness_weight=weight,
            queue_wait_s=received_wall - message.sent_wall_s,
            decode_s=decode_s,
        )
        await ctx.bus.publish(
            UpdateReceived(
                task_id=message.task_id,
                client_id=message.client_id,
                base_version=message.base_version,
                version=self.version,
                staleness=staleness,
                upload_bytes=len(message.payload),
                simulated_s=ctx.clock.now(),
                tier=message.tier,
                decode_s=decode_s,
                queue_wait_s=received_wall - message.sent_wall_s,
            )
        )

    def _count_failure(self, error: str) -> None:
        self.stats.updates_failed += 1
        self._failure_streak += 1
        if self._failure_streak >= self._failure_limit:
            raise TrainingError(f"the last {self._failure_streak} client tasks all failed; the last error: {error}")

    def _task_closed(self, message: TaskClosed) -> None:
        """An edge took a client's answer (it released the task itself): count the outcome."""
        self.stats.upload_bytes += message.upload_bytes
        if message.outcome == "accepted":
            self.count_accepted(message.staleness)
        elif message.outcome == "rejected":
            self.count_rejected(message.reason)
        else:
            self._count_failure(message.reason)

    def _fold_partial(self, message: EdgeForwarded) -> None:
        """Fold an edge's partial aggregate, discounted by how many versions passed since the edge folded it."""
        if message.count == 0:
            return
        ctx = self.ctx
        start = ctx.wall()
        partial = _DENSE.decode(message.payload, expected_elements=ctx.num_params).to(self.weights.device)
        staleness = max(int(self.version) - int(message.base_version), 0)
        weight = self.strategy.add_partial(partial, example_weight=message.example_weight, staleness=staleness)
        self.stats.cloud_aggregate_s += ctx.wall() - start
        ctx.log.debug(
            "server.partial",
            step=self.stats.partials_received,
            updates=message.count,
            bytes=len(message.payload),
            staleness=staleness,
            staleness_weight=weight,
            queue_wait_s=start - message.sent_wall_s,
            decode_s=ctx.wall() - start,
        )

    async def _reject(self, message: UpdateUploaded | EdgeForwarded, reason: str, detail: str) -> None:
        self.stats.updates_dropped += 1
        self.stats.drop_reasons[reason] += 1
        self.ctx.log.info(
            "server.rejected",
            step=self.stats.updates_dropped,
            reason=reason,
            detail=detail,
            task_id=message.task_id,
            client_id=int(message.client_id),
            dropped=self.stats.updates_dropped,
        )
        await self.ctx.bus.publish(
            UpdateRejected(
                task_id=message.task_id,
                client_id=message.client_id,
                base_version=message.base_version,
                reason=reason,
                detail=detail,
                simulated_s=self.ctx.clock.now(),
            )
        )

    # ------------------------------------------------------------------------------------------- versions
    async def _new_version(self) -> None:
        ctx, stats = self.ctx, self.stats
        start = ctx.wall()
        num_updates = len(self._round_staleness)
        self.strategy.step()
        aggregate_s = ctx.wall() - start
        stats.cloud_aggregate_s += aggregate_s
        self.version = Version(self.version + 1)
        stats.versions = int(self.version)
        mean_staleness = sum(self._round_staleness) / max(num_updates, 1)
        self._round_staleness.clear()
        await self._publish()
        wall_s = ctx.wall() - self._start_wall
        ctx.log.debug(
            "server.version",
            step=int(self.version),
            aggregate_s=aggregate_s,
            updates=num_updates,
            staleness_mean=mean_staleness,
            in_flight=len(self._in_flight),
            ingress_bytes=self._ingress_since_version,
            egress_bytes=self._egress_since_version,
            simulated_s=ctx.clock.now(),
            wall_s=wall_s,
            versions_per_s=int(self.version) / wall_s if wall_s > 0 else 0.0,
        )
        self._ingress_since_version = self._egress_since_version = 0
        await ctx.bus.publish(
            Aggregated(
                version=self.version,
                num_updates=num_updates,
                mean_staleness=mean_staleness,
                aggregate_s=aggregate_s,
                simulated_s=ctx.clock.now(),
                wall_s=wall_s,
            )
        )
        if int(self.version) % ctx.config.eval.every_versions == 0:
            await self._evaluate()

    async def _publish(self) -> None:
        start = self.ctx.wall()
        exact = self.weights.detach().clone()
        codec = self.ctx.download_codec
        payload = codec.encode(exact).payload
        # One download is encoded (and, if lossy, decoded) per version, not per client.
        weights = exact if codec.lossless else codec.decode(payload, expected_elements=exact.numel()).to(exact.device)
        snapshot = ModelSnapshot(version=self.version, weights=weights, exact=exact, download_bytes=len(payload))
        previous = self._snapshot
        self._snapshot = snapshot
        self._bases[snapshot.version] = snapshot
        if previous is not None and previous.version not in self._base_refs:
            self._bases.pop(previous.version, None)
        if self.edges is not None and not isinstance(self.cfg, FedAvgServer):
            sent = self.edges.publish(snapshot)
            self.stats.cloud_egress_bytes += sent
            self._egress_since_version += sent
        await self.ctx.bus.publish(
            ModelPublished(
                version=self.version,
                simulated_s=self.ctx.clock.now(),
                download_bytes=snapshot.download_bytes,
                encode_s=self.ctx.wall() - start,
            )
        )

    async def _evaluate(self) -> None:
        ctx, stats = self.ctx, self.stats
        snapshot = self._snapshot
        assert snapshot is not None
        if ctx.test_y.numel() == 0:
            return
        models, x, y, batch = ctx.executor.models, ctx.test_x, ctx.test_y, ctx.config.eval.batch_size
        weights = snapshot.weights
        start = ctx.wall()
        result = await ctx.clock.run(
            ctx.executor.pool,
            lambda: evaluate(models.get(), weights, x, y, batch_size=batch),
            simulated_s=0.0,
        )
        stats.accuracy, stats.loss, stats.evaluated_version = (
            result.accuracy,
            result.loss,
            int(snapshot.version),
        )
        wall_s = ctx.wall() - self._start_wall
        ctx.log.info(
            "server.eval",
            step=int(snapshot.version),
            version=int(snapshot.version),
            accuracy=result.accuracy,
            loss=result.loss,
            updates=stats.updates_accepted,
            simulated_s=ctx.clock.now(),
            wall_s=wall_s,
        )
        await ctx.bus.publish(
            Evaluated(
                version=snapshot.version,
                accuracy=result.accuracy,
                loss=result.loss,
                simulated_s=ctx.clock.now(),
                wall_s=wall_s,
                eval_s=ctx.wall() - start,
            )
        )

    def _stop_reason(self) -> str:
        ctx, stats, stop = self.ctx, self.stats, self.ctx.config.stop
        reason = ""
        if stats.versions >= stop.max_versions:
            reason = "max_versions"
        elif stop.target_accuracy is not None and stats.accuracy >= stop.target_accuracy:
            reason = "target_accuracy"
        elif stop.max_simulated_s is not None and ctx.clock.now() >= stop.max_simulated_s:
            reason = "max_simulated_s"
        elif stop.max_wall_s is not None and ctx.wall() - self._start_wall >= stop.max_wall_s:
            reason = "max_wall_s"
        if reason:
            stats.stop_reason = reason
        return reason
