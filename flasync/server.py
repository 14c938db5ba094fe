"""The server coroutine: dispatch client tasks, receive updates from the bus, aggregate, publish versions.

Two modes share one loop body:

* **async** (FedBuff, FedAsync): ``concurrency`` tasks are always in flight; every arriving update is checked,
  weighted by its staleness ``tau = version_now - base_version`` and folded in; each arrival frees a slot that is
  refilled at once with a newly sampled idle client.
* **sync** (FedAvg): each round samples a cohort, waits for its members (a barrier that closes early once
  ``resilience.round_quorum`` of them answered or ``resilience.round_deadline_s`` passed), and takes one server step.

Failed clients (:class:`ClientFailed`) and tasks not answered within ``resilience.task_timeout_s``
(:class:`ClientTimedOut`) are counted and their slots refilled; every decoded update is validated
(:mod:`flasync.validation`) before it may touch the aggregator. :meth:`Server.checkpoint_state` captures
everything needed to continue the run exactly (see :mod:`flasync.checkpoint`).

The maths lives in :mod:`flasync.aggregation`; this module only orchestrates.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np
import torch

from flasync import seeding
from flasync.aggregation import (
    ConstantStaleness,
    HingeStaleness,
    PolynomialStaleness,
    ServerOptimizer,
    StalenessWeight,
    UpdateBuffer,
    coordinate_median,
    fedasync_mix_,
    trimmed_mean,
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
from flasync.errors import BusClosed, BusFull, CheckpointError, DecodeError, TrainingError
from flasync.events import (
    CLOUD,
    Aggregated,
    ClientFailed,
    ClientId,
    ClientTimedOut,
    EdgeForwarded,
    Evaluated,
    ModelPublished,
    RoundDeadlinePassed,
    RunFinished,
    StopRequested,
    TaskAssigned,
    TaskClosed,
    UpdateReceived,
    UpdateRejected,
    UpdateUploaded,
    Version,
)
from flasync.training import evaluate
from flasync.validation import UpdateValidator, clip_to_norm

ServerMessage = (
    UpdateUploaded | ClientFailed | EdgeForwarded | TaskClosed | ClientTimedOut | RoundDeadlinePassed | StopRequested
)
INTERRUPTED = "interrupted"

__all__ = ["INTERRUPTED", "Server", "ServerStats", "make_server_optimizer", "make_staleness_weight"]


def ctx_sampling(ctx: RunContext) -> str:
    """Return the run's client sampling strategy."""
    return str(ctx.config.population.sampling)


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
    return ServerOptimizer.sgd(weights, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov)


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
    tasks_timed_out: int = 0
    tasks_abandoned: int = 0
    drop_reasons: Counter[str] = field(default_factory=Counter)
    failure_kinds: Counter[str] = field(default_factory=Counter)

    def to_state(self) -> dict[str, Any]:
        """Return the counters as plain values (for a checkpoint)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = dict(value) if isinstance(value, Counter) else value
        return out

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> ServerStats:
        """Rebuild counters from :meth:`to_state`."""
        stats = cls()
        for f in fields(stats):
            if f.name in state:
                value = state[f.name]
                setattr(stats, f.name, Counter(value) if isinstance(getattr(stats, f.name), Counter) else value)
        return stats


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

    def count(self) -> int:
        """Count the updates waiting for the next step."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Return the strategy's state (buffer, optimizer) for a checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
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

    def count(self) -> int:
        return self.buffer.count

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "buffered", "buffer": self.buffer.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "buffered":
            raise CheckpointError(f"checkpoint holds a {state.get('kind')!r} aggregator, this run a buffered one")
        self.buffer.load_state_dict(state["buffer"])
        self.optimizer.load_state_dict(state["optimizer"])


class _Robust:
    """Sync rounds with a robust rule: keep the round's deltas, combine them coordinate-wise, one server step."""

    def __init__(
        self, weights: torch.Tensor, *, rule: str, trim_fraction: float, optimizer: ServerOptimizerConfig
    ) -> None:
        self.optimizer = make_server_optimizer(weights, optimizer)
        self.rule = rule
        self.trim_fraction = trim_fraction
        self.deltas: list[torch.Tensor] = []

    def add(self, delta: torch.Tensor, *, staleness: int, num_samples: int, base: torch.Tensor) -> float:
        self.deltas.append(delta.detach().clone())
        return 1.0

    def add_partial(self, weighted_sum: torch.Tensor, *, example_weight: float, staleness: int) -> float:
        raise ValueError("robust aggregation combines client updates, not edge partial aggregates")

    def ready(self) -> bool:
        return False  # the sync loop decides when a round is over

    def step(self) -> None:
        if self.rule == "median":
            aggregate = coordinate_median(self.deltas)
        else:
            aggregate = trimmed_mean(self.deltas, self.trim_fraction)
        self.optimizer.step(aggregate)
        self.deltas.clear()

    def count(self) -> int:
        return len(self.deltas)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "robust", "deltas": [d.clone() for d in self.deltas], "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "robust":
            raise CheckpointError(f"checkpoint holds a {state.get('kind')!r} aggregator, this run a robust one")
        self.deltas = [d.clone() for d in state["deltas"]]
        self.optimizer.load_state_dict(state["optimizer"])


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

    def count(self) -> int:
        return int(self._pending)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixing", "pending": self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "mixing":
            raise CheckpointError(f"checkpoint holds a {state.get('kind')!r} aggregator, this run a mixing one")
        self._pending = bool(state["pending"])


@dataclass(slots=True)
class _Round:
    """The sync round in progress."""

    version: int
    target: int
    started_s: float
    deadline_s: float | None
    accepted: int = 0
    deadline_passed: bool = False


class Server:
    """The server of one run.

    Args:
        ctx: The run's shared wiring.
        weights: Initial flat global weights; the server owns and updates this tensor.

    Attributes:
        on_checkpoint: Called with :meth:`checkpoint_state` every ``checkpoint.every_versions`` versions (it must
            not block: hand the writing to a thread).
        interrupted_state: The state captured when a stop request ended the run, else None.
    """

    def __init__(self, ctx: RunContext, weights: torch.Tensor) -> None:
        """Subscribe to client results and build the aggregation strategy."""
        self.ctx = ctx
        self.cfg = ctx.config.server
        self.res = ctx.config.resilience
        self.weights = weights
        self.version = Version(0)
        self.stats = ServerStats()
        self.on_checkpoint: Callable[[dict[str, Any]], None] | None = None
        self.interrupted_state: dict[str, Any] | None = None
        self._rng = seeding.numpy_stream(ctx.config.seed, seeding.SERVER)
        self._snapshot: ModelSnapshot | None = None
        self._bases: dict[Version, ModelSnapshot] = {}
        self._base_refs: Counter[Version] = Counter()
        self._in_flight: dict[ClientId, TaskAssigned] = {}
        self._handles: dict[int, asyncio.Task[None]] = {}
        self._watchdogs: dict[int, asyncio.Task[None]] = {}
        self._participations = np.zeros(len(ctx.population), dtype=np.int64)
        self._failure_streak = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._start_wall = 0.0
        self._round_staleness: list[int] = []
        self._round: _Round | None = None
        self._deadline: asyncio.Task[None] | None = None
        self._stop_requested = ""
        self._restored = False
        res = self.res
        self._validator = UpdateValidator(
            ctx.num_params,
            max_norm=res.max_update_norm,
            zscore_threshold=res.zscore_threshold,
            window=res.zscore_window,
            min_history=res.zscore_min_history,
        )
        cfg = self.cfg
        in_flight = cfg.clients_per_round if isinstance(cfg, FedAvgServer) else cfg.concurrency
        if isinstance(cfg, FedAvgServer):
            in_flight = self._cohort_size(cfg)
        capacity = 2 * in_flight + 8
        # Every task of several waves failing means the model or data is broken, not an unlucky client. Only
        # genuine training errors count: injected faults, dropouts and timeouts never do.
        self._failure_limit = max(3 * in_flight, 30)
        self._ingress_since_version = 0
        self._egress_since_version = 0
        # Edges may hold many finished tasks' answers at once: the cloud's inbox must never block them.
        capacity = capacity if ctx.tree is None else max(capacity, 4 * ctx.tree.num_edges + 2 * in_flight + 8)
        self._inbox = ctx.bus.subscribe(
            UpdateUploaded,
            ClientFailed,
            EdgeForwarded,
            TaskClosed,
            ClientTimedOut,
            RoundDeadlinePassed,
            StopRequested,
            capacity=capacity,
            name="server",
            address=CLOUD,
        )
        self.max_staleness = cfg.max_staleness if isinstance(cfg, FedBuffServer | FedAsyncServer) else None
        self.strategy: _Strategy
        if isinstance(cfg, FedAvgServer) and res.aggregation != "mean":
            self.strategy = _Robust(
                weights, rule=res.aggregation, trim_fraction=res.trim_fraction, optimizer=cfg.optimizer
            )
        elif isinstance(cfg, FedAvgServer):
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

    def _cohort_size(self, cfg: FedAvgServer) -> int:
        n = len(self.ctx.population)
        return min(n, math.ceil((1.0 + self.res.over_selection) * cfg.clients_per_round - 1e-9))

    # ------------------------------------------------------------------------------------------- stopping
    def request_stop(self, reason: str) -> None:
        """Ask the run to stop at its next consistent point (call from the loop's thread, e.g. a signal handler).

        The server finishes handling the message at hand, captures :attr:`interrupted_state`, cancels the
        client tasks and returns with ``stop_reason == "interrupted"``.
        """
        if self._stop_requested:
            return
        self._stop_requested = reason or INTERRUPTED
        with contextlib.suppress(BusFull, BusClosed):  # a full inbox is being drained: the flag is seen anyway
            self.ctx.bus.publish_nowait(StopRequested(reason=self._stop_requested))

    @property
    def stop_requested(self) -> str:
        """What asked the run to stop (empty if nothing did)."""
        return self._stop_requested

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
                    if self._restored:
                        self._redispatch()
                    else:
                        await self._publish()
                        await self._evaluate()
                    if isinstance(self.cfg, FedAvgServer):
                        await self._run_sync(self.cfg)
                    else:
                        await self._run_async(self.cfg.concurrency)
                    # Edges and the least-recently-used sampler keep state a checkpoint lacks.
                    if self._stop_requested and self.edges is None and ctx_sampling(self.ctx) != "lru":
                        self.interrupted_state = self.checkpoint_state()
                finally:
                    for task in list(self._tasks):
                        task.cancel()
        finally:
            self._inbox.close()
            if self.edges is not None:
                self.edges.close()
            self._tg = None
        if self.stats.evaluated_version != self.version and not self._stop_requested:
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
        # A checkpoint is taken after a message was handled and before the slots are refilled, so a resumed run
        # starts here: refill, then wait for the next message.
        if self._stop_reason():
            return
        while True:
            await self._refill(concurrency)
            await self._handle(await self._inbox.receive())
            if self.strategy.ready():
                await self._new_version()
            if self._stop_reason():
                return

    async def _refill(self, concurrency: int) -> None:
        while len(self._in_flight) < concurrency:
            client_id = self._sample_idle()
            if client_id is None:
                if self._in_flight:
                    return  # the free slots are filled at the next message
                faults = self.ctx.faults
                assert faults is not None  # without availability windows an idle client always exists
                await self.ctx.clock.sleep_until(faults.next_online(self.ctx.clock.now()))
                continue
            await self.dispatch(client_id)

    async def _run_sync(self, cfg: FedAvgServer) -> None:
        if self.edges is not None:
            await self._run_sync_tree(cfg, self.edges)
            return
        while not self._stop_reason():
            if self._round is None:
                await self._start_round(cfg)
            round_ = self._round
            assert round_ is not None
            while self._in_flight and round_.accepted < round_.target and not round_.deadline_passed:
                await self._handle(await self._inbox.receive())
                if self._stop_requested:
                    self._stop_reason()
                    return  # mid-round: the checkpoint keeps the round and its tasks in flight
            if self._stop_reason():  # a wall-time limit may end a round early
                return
            self._close_round()
            if self.strategy.count():
                await self._new_version()  # with failed members, the ones that answered
            else:
                self.ctx.log.warning("server.round_empty", step=int(self.version), metrics=False)

    async def _run_sync_tree(self, cfg: FedAvgServer, edges: EdgeNetwork) -> None:
        while not self._stop_reason():
            cohort = self._draw_cohort(cfg.clients_per_round)
            await self._sync_tree_round(edges, set(cohort.tolist()))
            if self._stop_reason():  # a wall-time limit may end a round early
                return
            if self.strategy.count():
                await self._new_version()
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

    def _draw_cohort(self, size: int) -> np.ndarray:
        """Sample ``size`` distinct clients by the configured strategy."""
        strategy = self.ctx.config.population.sampling
        if strategy == "uniform":
            return self._rng.choice(len(self.ctx.population), size=size, replace=False)
        return self.ctx.population.sample(size, self._rng, strategy=strategy, now=self.ctx.clock.now())

    async def _start_round(self, cfg: FedAvgServer) -> None:
        ctx = self.ctx
        size = self._cohort_size(cfg)
        faults = ctx.faults
        if faults is None or faults.config.availability is None:
            cohort = self._draw_cohort(size)
        else:
            while True:
                online = np.flatnonzero(faults.online_mask(ctx.clock.now()))
                if len(online):
                    break
                await ctx.clock.sleep_until(faults.next_online(ctx.clock.now()))
            cohort = self._rng.choice(online, size=min(size, len(online)), replace=False)
        now = ctx.clock.now()
        deadline = None if self.res.round_deadline_s is None else now + self.res.round_deadline_s
        target = max(1, math.ceil(self.res.round_quorum * cfg.clients_per_round - 1e-9))
        self._round = _Round(version=int(self.version), target=target, started_s=now, deadline_s=deadline)
        self._start_deadline()
        for client_id in cohort.tolist():
            await self.dispatch(ClientId(client_id))

    def _start_deadline(self) -> None:
        round_ = self._round
        if round_ is None or round_.deadline_s is None or round_.deadline_passed:
            return
        assert self._tg is not None
        self._deadline = self._tg.create_task(self._deadline_timer(round_), name="flasync-round-deadline")
        self._tasks.add(self._deadline)
        self._deadline.add_done_callback(self._tasks.discard)

    async def _deadline_timer(self, round_: _Round) -> None:
        assert round_.deadline_s is not None
        await self.ctx.clock.sleep_until(round_.deadline_s)
        if self._round is round_:
            await self.ctx.bus.publish(
                RoundDeadlinePassed(version=Version(round_.version), simulated_s=self.ctx.clock.now())
            )

    def _close_round(self) -> None:
        """End the round: abandon the tasks still in flight (over-selected, late or hanging clients)."""
        round_ = self._round
        self._round = None
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        abandoned = 0
        for task in sorted(self._in_flight.values(), key=lambda t: t.task_id):
            self.release(task)
            abandoned += 1
        self.stats.tasks_abandoned += abandoned
        if round_ is not None:
            self.ctx.log.debug(
                "server.round",
                step=int(self.version),
                accepted=round_.accepted,
                abandoned=abandoned,
                deadline_passed=int(round_.deadline_passed),
                simulated_s=self.ctx.clock.now(),
            )

    # ------------------------------------------------------------------------------------------- dispatch
    def _sample_idle(self) -> ClientId | None:
        population = self.ctx.population
        strategy = self.ctx.config.population.sampling
        if strategy != "uniform":
            drawn = population.sample(
                1, self._rng, strategy=strategy, now=self.ctx.clock.now(), exclude=self._in_flight
            )
            return ClientId(int(drawn[0]))
        num_clients = len(population)
        faults = self.ctx.faults
        if faults is None or faults.config.availability is None:
            while True:
                candidate = ClientId(int(self._rng.integers(num_clients)))
                if candidate not in self._in_flight:
                    return candidate
        now = self.ctx.clock.now()
        for _ in range(8 * num_clients):
            candidate = ClientId(int(self._rng.integers(num_clients)))
            if candidate not in self._in_flight and faults.online(candidate, now):
                return candidate
        idle = [c for c in np.flatnonzero(faults.online_mask(now)).tolist() if c not in self._in_flight]
        if not idle:
            return None
        return ClientId(idle[int(self._rng.integers(len(idle)))])

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
        self._start_client(task, snapshot)

    def _start_client(self, task: TaskAssigned, snapshot: ModelSnapshot) -> None:
        assert self._tg is not None
        client_id = task.client_id
        handle = self._tg.create_task(
            Client(client_id, self.ctx).run(task, snapshot),
            name=f"flasync-client-{client_id}-task-{task.task_id}",
        )
        self._tasks.add(handle)
        self._handles[task.task_id] = handle
        handle.add_done_callback(self._tasks.discard)
        timeout = self.res.task_timeout_s
        if timeout is not None:
            watchdog = self._tg.create_task(
                self._watch(task, task.simulated_s + timeout, limit_s=timeout), name=f"flasync-timeout-{task.task_id}"
            )
            self._tasks.add(watchdog)
            self._watchdogs[task.task_id] = watchdog
            watchdog.add_done_callback(self._tasks.discard)

    async def _watch(self, task: TaskAssigned, when: float, *, limit_s: float) -> None:
        await self.ctx.clock.sleep_until(when)
        current = self._in_flight.get(task.client_id)
        if current is not None and current.task_id == task.task_id:
            await self.ctx.bus.publish(
                ClientTimedOut(
                    task_id=task.task_id,
                    client_id=task.client_id,
                    base_version=task.base_version,
                    timeout_s=limit_s,
                    simulated_s=self.ctx.clock.now(),
                )
            )

    def _redispatch(self) -> None:
        """Start again the tasks a checkpoint had in flight, on their original timelines."""
        for task in sorted(self._in_flight.values(), key=lambda t: t.task_id):
            self._start_client(task, self._bases[task.base_version])
        self._start_deadline()

    def release(
        self, message: UpdateUploaded | ClientFailed | EdgeForwarded | TaskClosed | ClientTimedOut | TaskAssigned
    ) -> bool:
        """Close the task a message answers; False if no such task is in flight (nothing is changed then)."""
        task = self._in_flight.get(message.client_id)
        if task is None or task.task_id != message.task_id or task.base_version != message.base_version:
            return False
        del self._in_flight[message.client_id]
        handle = self._handles.pop(task.task_id, None)
        if handle is not None and not handle.done():
            handle.cancel()  # a timed-out or abandoned client; one that answered has ended already
        watchdog = self._watchdogs.pop(task.task_id, None)
        if watchdog is not None:
            watchdog.cancel()
        if self.ctx.pre_task_residuals is not None:
            self.ctx.pre_task_residuals.pop(task.task_id, None)
        base_version = task.base_version
        self._base_refs[base_version] -= 1
        if self._base_refs[base_version] <= 0:
            del self._base_refs[base_version]
            if self._snapshot is None or base_version != self._snapshot.version:
                self._bases.pop(base_version, None)
        return True

    # ------------------------------------------------------------------------------------------- receive
    async def _handle(self, message: ServerMessage) -> None:
        if isinstance(message, StopRequested):
            return  # the flag is already set; the loop stops after this message
        if isinstance(message, RoundDeadlinePassed):
            if self._round is not None and message.version == self._round.version:
                self._round.deadline_passed = True
            return
        if isinstance(message, TaskClosed):
            self._task_closed(message)
            return
        if isinstance(message, ClientTimedOut):
            if not self.release(message):
                return
            self.stats.tasks_timed_out += 1
            self.ctx.log.debug(
                "server.timeout",
                step=self.stats.tasks_timed_out,
                task_id=message.task_id,
                client_id=int(message.client_id),
                timed_out=self.stats.tasks_timed_out,
            )
            return
        if isinstance(message, ClientFailed):
            if not self.release(message):
                return
            stats = self.stats
            stats.updates_failed += 1
            stats.failure_kinds[message.kind] += 1
            self.ctx.log.debug(
                "server.failure",
                step=stats.updates_failed,
                kind=message.kind,
                task_id=message.task_id,
                client_id=int(message.client_id),
                failed=stats.updates_failed,
            )
            if message.kind == "error":
                self._count_streak(message.error)
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
        if not 0 <= int(message.base_version) <= int(self.version):
            # Refused before it can close a task: a forged or corrupt message must not cost the real answer.
            await self._reject(message, "unknown_version", f"base version {message.base_version} was never published")
            return
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
            delta = ctx.upload_codec.decode(message.payload, expected_elements=ctx.num_params)
        except DecodeError as exc:
            await self._reject(message, "decode", str(exc))
            return
        if delta.device != self.weights.device:
            delta = delta.to(self.weights.device)
        decode_s = ctx.wall() - received_wall
        verdict, norm = self._validator.check(delta)
        if verdict is not None:
            await self._reject(message, verdict.reason, verdict.detail)
            return
        if self.res.clip_update_norm is not None:
            delta, _ = clip_to_norm(delta, self.res.clip_update_norm)
        weight = self.strategy.add(delta, staleness=staleness, num_samples=message.num_samples, base=base.weights)
        stats.cloud_aggregate_s += ctx.wall() - received_wall
        self._validator.accepted(norm)
        self._failure_streak = 0
        if self._round is not None:
            self._round.accepted += 1
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
            norm=norm,
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

    def _count_streak(self, error: str) -> None:
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
            self.stats.updates_failed += 1
            self._count_streak(message.reason)

    def _fold_partial(self, message: EdgeForwarded) -> None:
        """Fold an edge's partial aggregate, discounted by how many versions passed since the edge folded it."""
        if message.count == 0:
            return
        ctx = self.ctx
        start = ctx.wall()
        partial = ctx.edge_codec.decode(message.payload, expected_elements=ctx.num_params).to(self.weights.device)
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
        every = ctx.config.checkpoint.every_versions
        # The last version is the run's result, not a point to restart from.
        if (
            every is not None
            and self.on_checkpoint is not None
            and int(self.version) % every == 0
            and stats.versions < ctx.config.stop.max_versions
        ):
            self.on_checkpoint(self.checkpoint_state())

    # ----------------------------------------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """Return everything needed to continue this run exactly: plain values and tensors, copied.

        Call it between messages (the server does, after a message was handled and before slots are
        refilled). In-flight tasks are kept as their :class:`TaskAssigned` records with the models they started
        from; a resumed run starts them again on their original timelines, and since every random draw of a
        task is keyed by client and participation, they replay exactly.
        """
        ctx = self.ctx
        assert self._snapshot is not None
        in_flight = sorted(self._in_flight.values(), key=lambda t: t.task_id)
        bases = sorted(self._bases)
        state: dict[str, Any] = {
            "version": int(self.version),
            "weights": self.weights.detach().clone(),
            "snapshot_version": int(self._snapshot.version),
            "bases": [
                {
                    "version": int(v),
                    "weights": self._bases[v].weights.clone(),
                    "exact": self._bases[v].exact.clone(),
                    "download_bytes": self._bases[v].download_bytes,
                }
                for v in bases
            ],
            "strategy": self.strategy.state_dict(),
            "stats": self.stats.to_state(),
            "rng": json.dumps(self._rng.bit_generator.state),
            "participations": torch.from_numpy(self._participations.copy()),
            "failure_streak": self._failure_streak,
            "round_staleness": list(self._round_staleness),
            "validator_norms": self._validator.norms,
            "in_flight": [
                {
                    "task_id": t.task_id,
                    "client_id": int(t.client_id),
                    "participation": t.participation,
                    "base_version": int(t.base_version),
                    "simulated_s": t.simulated_s,
                }
                for t in in_flight
            ],
            "round": None
            if self._round is None
            else {
                "version": self._round.version,
                "target": self._round.target,
                "started_s": self._round.started_s,
                "deadline_s": self._round.deadline_s,
                "accepted": self._round.accepted,
                "deadline_passed": self._round.deadline_passed,
            },
            "clock": ctx.clock.state(),
            "residuals": self._residual_state({t.task_id: int(t.client_id) for t in in_flight}),
        }
        return state

    def _residual_state(self, in_flight: dict[int, int]) -> dict[str, Any]:
        ctx = self.ctx
        store = ctx.residuals
        if store is None:
            return {"ids": [], "values": torch.zeros(0)}
        recorded = ctx.pre_task_residuals if ctx.pre_task_residuals is not None else {}
        values: dict[int, torch.Tensor] = {}
        with ctx.residual_lock:
            for client_id in store.client_ids():
                held = store.get(client_id)
                if held is not None:
                    values[client_id] = held
            for task_id, client_id in in_flight.items():
                # A task in flight may have stored its new residual already: keep the one it started from.
                if task_id in recorded:
                    before = recorded[task_id]
                    if before is None:
                        values.pop(client_id, None)
                    else:
                        values[client_id] = before.clone()
        ids = sorted(values)
        stacked = torch.stack([values[i] for i in ids]) if ids else torch.zeros(0)
        return {"ids": ids, "values": stacked}

    def restore(self, state: dict[str, Any]) -> None:
        """Load :meth:`checkpoint_state` before :meth:`run`; the run then continues where that state was taken.

        Raises:
            CheckpointError: If the state does not fit this run (another model size or aggregator).
        """
        ctx = self.ctx
        weights = state["weights"]
        if not isinstance(weights, torch.Tensor) or weights.shape != self.weights.shape:
            shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise CheckpointError(f"checkpoint weights have shape {shape}, this model {tuple(self.weights.shape)}")
        participations = state["participations"]
        if participations.shape != (len(ctx.population),):
            raise CheckpointError(f"checkpoint has {participations.shape[0]} clients, this run {len(ctx.population)}")
        with torch.no_grad():
            self.weights.copy_(weights)
        self.version = Version(int(state["version"]))
        self.strategy.load_state_dict(state["strategy"])
        self.stats = ServerStats.from_state(state["stats"])
        self._rng.bit_generator.state = json.loads(state["rng"])
        self._participations = participations.numpy().astype(np.int64, copy=True)
        self._failure_streak = int(state["failure_streak"])
        self._round_staleness = [int(x) for x in state["round_staleness"]]
        self._validator.load_norms(state["validator_norms"])
        self._bases = {
            Version(int(b["version"])): ModelSnapshot(
                version=Version(int(b["version"])),
                weights=b["weights"].to(self.weights.device),
                exact=b["exact"].to(self.weights.device),
                download_bytes=int(b["download_bytes"]),
            )
            for b in state["bases"]
        }
        self._snapshot = self._bases[Version(int(state["snapshot_version"]))]
        self._in_flight = {}
        self._base_refs = Counter()
        for record in state["in_flight"]:
            task = TaskAssigned(
                task_id=int(record["task_id"]),
                client_id=ClientId(int(record["client_id"])),
                participation=int(record["participation"]),
                base_version=Version(int(record["base_version"])),
                simulated_s=float(record["simulated_s"]),
            )
            self._in_flight[task.client_id] = task
            self._base_refs[task.base_version] += 1
        round_ = state["round"]
        self._round = None if round_ is None else _Round(**round_)
        residuals = state["residuals"]
        if ctx.residuals is not None:
            for i, client_id in enumerate(residuals["ids"]):
                ctx.residuals.put(int(client_id), residuals["values"][i])
        self._restored = True

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
        if self._stop_requested:
            reason = INTERRUPTED
        elif stats.versions >= stop.max_versions:
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
