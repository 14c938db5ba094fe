"""Assembly: a run's configuration becomes its components. The one module that switches on config unions.

Everything else receives built objects: an :class:`~flasync.aggregation.Aggregator`, a
:class:`~flasync.server.policies.Policy`, codecs, staleness and example weights, a server optimizer. Adding a
component kind means a config model and one branch here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flasync import codecs, seeding
from flasync.aggregation import (
    Aggregator,
    BufferedAggregator,
    ConstantStaleness,
    EqualExampleWeight,
    ExampleWeight,
    HingeStaleness,
    MixingAggregator,
    PolynomialStaleness,
    RobustAggregator,
    SampleExampleWeight,
    ServerOptimizer,
    StalenessWeight,
)
from flasync.bus import EventBus
from flasync.client import Client, ClientResiduals, ClientWorld
from flasync.clock import Clock
from flasync.config import (
    AdamServerOptimizer,
    BFloat16Stage,
    CodecStage,
    ConstantStalenessConfig,
    FedAsyncServer,
    FedAvgServer,
    FedBuffServer,
    Float16Stage,
    HingeStalenessConfig,
    Int8Stage,
    RandomKStage,
    RunConfig,
    ServerConfig,
    ServerOptimizerConfig,
    StalenessConfig,
    TopKStage,
    TreeTopology,
)
from flasync.population import Population
from flasync.server import (
    Accounting,
    AsyncSlots,
    ClientSampler,
    EdgeNetwork,
    EdgeSettings,
    Intake,
    Policy,
    Server,
    StopRules,
    SyncRounds,
    TaskRegistry,
    TreeRounds,
)
from flasync.server.loop import Evaluator
from flasync.topology import Tree
from flasync.validation import UpdateValidator

__all__ = [
    "ServerParts",
    "build_server",
    "make_aggregator",
    "make_example_weight",
    "make_server_optimizer",
    "make_staleness_weight",
    "pipeline",
]


def pipeline(stages: Sequence[CodecStage]) -> codecs.Pipeline:
    """Build the codec pipeline a config's stages describe."""
    built: list[codecs.Stage] = []
    for stage in stages:
        if isinstance(stage, Float16Stage):
            built.append(codecs.Float16())
        elif isinstance(stage, BFloat16Stage):
            built.append(codecs.BFloat16())
        elif isinstance(stage, Int8Stage):
            built.append(codecs.Int8(chunk=stage.chunk, stochastic=stage.stochastic))
        elif isinstance(stage, TopKStage):
            built.append(codecs.TopK(ratio=stage.ratio, error_feedback=stage.error_feedback))
        elif isinstance(stage, RandomKStage):
            built.append(codecs.RandomK(ratio=stage.ratio, error_feedback=stage.error_feedback))
        else:  # pragma: no cover - the config's union is closed
            raise TypeError(f"unknown codec stage {stage!r}")
    return codecs.Pipeline(built)


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


def make_example_weight(config: ServerConfig) -> ExampleWeight:
    """Return how much an update's samples count: by samples for FedAvg and FedBuff's ``samples``, else equally."""
    if isinstance(config, FedAvgServer) or (isinstance(config, FedBuffServer) and config.example_weight == "samples"):
        return SampleExampleWeight()
    return EqualExampleWeight()


def _staleness_of(config: ServerConfig) -> StalenessWeight:
    return (
        make_staleness_weight(config.staleness)
        if isinstance(config, FedBuffServer | FedAsyncServer)
        else (ConstantStaleness())
    )


def make_aggregator(weights: torch.Tensor, config: ServerConfig) -> Aggregator:
    """Build the aggregation rule of a server config over ``weights``."""
    if isinstance(config, FedAvgServer):
        optimizer = make_server_optimizer(weights, config.optimizer)
        if config.aggregation != "mean":
            return RobustAggregator(
                weights, rule=config.aggregation, trim_fraction=config.trim_fraction, optimizer=optimizer
            )
        return BufferedAggregator(
            weights,
            size=config.clients_per_round,
            optimizer=optimizer,
            staleness=ConstantStaleness(),
            example_weight=SampleExampleWeight(),
        )
    if isinstance(config, FedBuffServer):
        return BufferedAggregator(
            weights,
            size=config.buffer_size,
            optimizer=make_server_optimizer(weights, config.optimizer),
            staleness=make_staleness_weight(config.staleness),
            example_weight=make_example_weight(config),
        )
    return MixingAggregator(weights, alpha=config.alpha, staleness=make_staleness_weight(config.staleness))


def _in_flight(config: RunConfig, num_clients: int) -> int:
    server = config.server
    if isinstance(server, FedAvgServer):
        over = config.resilience.over_selection
        return min(num_clients, math.ceil((1.0 + over) * server.clients_per_round - 1e-9))
    return server.concurrency


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerParts:
    """The server and the components a runtime reads after a run."""

    server: Server
    registry: TaskRegistry
    edges: EdgeNetwork | None


def build_server(
    config: RunConfig,
    weights: torch.Tensor,
    *,
    bus: EventBus,
    clock: Clock,
    wall: Callable[[], float],
    log: Any,
    population: Population,
    world: ClientWorld,
    tree: Tree | None,
    evaluate: Evaluator,
) -> ServerParts:
    """Assemble the cloud of a run: registry, accounting, sampler, intake, aggregator, policy, edges.

    Args:
        config: The run's configuration.
        weights: Initial flat global weights (the server steps them in place).
        bus: The run's event bus.
        clock: The run's clock.
        wall: Monotonic real seconds.
        log: The run's logger.
        population: The clients.
        world: What simulated clients run in (their tasks start through it).
        tree: The aggregation tree (None: a flat run).
        evaluate: Evaluates a model off the event loop.
    """
    server_cfg, res = config.server, config.resilience
    num_params = weights.numel()
    in_flight = _in_flight(config, len(population))
    # Every task of several waves failing means the model or data is broken, not an unlucky client. Only
    # genuine training errors count: injected faults, dropouts and timeouts never do.
    accounting = Accounting(failure_limit=max(3 * in_flight, 30))
    registry = TaskRegistry(
        bus=bus,
        clock=clock,
        accounting=accounting,
        num_clients=len(population),
        start_task=lambda task, snapshot: Client(task.client_id, world).run(task, snapshot),
        timeout_s=res.task_timeout_s,
        mark_used=population.mark_used,
        on_release=world.forget,
    )
    sampler = ClientSampler(
        population,
        config.population.sampling,
        seeding.numpy_stream(config.seed, seeding.SERVER),
        world.faults,
    )
    max_staleness = server_cfg.max_staleness if isinstance(server_cfg, FedBuffServer | FedAsyncServer) else None
    upload_codec = world.job.upload_codec

    def make_intake() -> Intake:
        return Intake(
            registry=registry,
            codec=upload_codec,
            num_params=num_params,
            device=weights.device,
            validator=UpdateValidator(
                num_params,
                max_norm=res.max_update_norm,
                zscore_threshold=res.zscore_threshold,
                window=res.zscore_window,
                min_history=res.zscore_min_history,
            ),
            max_staleness=max_staleness,
            clip_norm=res.clip_update_norm,
            wall=wall,
        )

    edge_codec = pipeline(config.topology.codec if isinstance(config.topology, TreeTopology) else ())
    edges: EdgeNetwork | None = None
    topology = config.topology
    if tree is not None and isinstance(topology, TreeTopology):
        edges = EdgeNetwork(
            tree,
            EdgeSettings(
                buffer_size=topology.buffer_size,
                max_wait_s=topology.max_wait_s,
                kappa2=topology.kappa2,
                link=topology.link,
                per_edge_metrics=topology.per_edge_metrics,
                staleness=_staleness_of(server_cfg),
                example_weight=make_example_weight(server_cfg),
                seed=config.seed,
            ),
            registry=registry,
            make_intake=make_intake,
            bus=bus,
            clock=clock,
            wall=wall,
            log=log,
            edge_codec=edge_codec,
            num_params=num_params,
            device=weights.device,
        )
    aggregator = make_aggregator(weights, server_cfg)
    policy: Policy
    if isinstance(server_cfg, FedAvgServer) and edges is not None:
        policy = TreeRounds(
            clients_per_round=server_cfg.clients_per_round,
            edges=edges,
            registry=registry,
            sampler=sampler,
            clock=clock,
            accounting=accounting,
        )
    elif isinstance(server_cfg, FedAvgServer):
        policy = SyncRounds(
            clients_per_round=server_cfg.clients_per_round,
            over_selection=res.over_selection,
            quorum=res.round_quorum,
            deadline_s=res.round_deadline_s,
            registry=registry,
            sampler=sampler,
            clock=clock,
            bus=bus,
            accounting=accounting,
            log=log,
        )
    else:
        policy = AsyncSlots(
            concurrency=server_cfg.concurrency,
            registry=registry,
            sampler=sampler,
            clock=clock,
            ready=aggregator.ready,
            accounting=accounting,
            edges=edges,
        )
    capacity = 2 * in_flight + 8
    if tree is not None:
        # Edges may hold many finished tasks' answers at once: the cloud's inbox must never block them.
        capacity = max(capacity, 4 * tree.num_edges + 2 * in_flight + 8)
    stop, seed = config.stop, config.seed
    server = Server(
        weights,
        bus=bus,
        clock=clock,
        wall=wall,
        log=log,
        aggregator=aggregator,
        policy=policy,
        registry=registry,
        intake=make_intake(),
        accounting=accounting,
        sampler=sampler,
        download_codec=pipeline(config.codec.download),
        edge_codec=edge_codec,
        evaluate=evaluate,
        rules=StopRules(
            max_versions=stop.max_versions,
            target_accuracy=stop.target_accuracy,
            max_simulated_s=stop.max_simulated_s,
            max_wall_s=stop.max_wall_s,
            eval_every=config.eval.every_versions,
            checkpoint_every=config.checkpoint.every_versions,
        ),
        inbox_capacity=capacity,
        download_generator=lambda version: seeding.torch_stream(seed, seeding.DOWNLOAD_CODEC, version),
        components={"residuals": ClientResiduals(world, lambda: iter(registry))},
    )
    return ServerParts(server=server, registry=registry, edges=edges)
