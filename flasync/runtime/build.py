"""A run's components from its configuration: the clients' world, the evaluator, the aggregator and the server."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flasync.aggregation import (
    Aggregator,
    BufferedAggregator,
    ConstantStaleness,
    ControlVariate,
    CustomAggregator,
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
from flasync.aggregation.privacy import (
    GaussianMechanism,
    PrivacyPlan,
)
from flasync.algorithms.client_eval import ClientEvaluation, EvaluationSummary, Selection
from flasync.algorithms.error_feedback import ErrorFeedback
from flasync.algorithms.personal import Ditto, FineTune, LocalLayers, local_positions
from flasync.algorithms.privacy import CentralPrivacy
from flasync.algorithms.pruning import PruningClients, PruningServer
from flasync.algorithms.scaffold import ScaffoldClients, ScaffoldServer
from flasync.clients.simulated.client import ClientWorld, CohortClients
from flasync.clients.simulated.faults import FaultModel
from flasync.clients.simulated.population import Network, Population
from flasync.clients.simulated.secure import SecureRoom
from flasync.clients.simulated.trace import DeviceTrace, TraceWindows
from flasync.codecs import Pipeline
from flasync.codecs.build import pipeline
from flasync.codecs.validation import UpdateValidator
from flasync.config import (
    AdagradServerOptimizer,
    AdamServerOptimizer,
    ConstantStalenessConfig,
    FedAsyncServer,
    FedAvgServer,
    FedBuffServer,
    HingeStalenessConfig,
    RunConfig,
    ServerConfig,
    ServerOptimizerConfig,
    StalenessConfig,
    TreeTopology,
    YogiServerOptimizer,
)
from flasync.core import seeding
from flasync.core.bus import EventBus
from flasync.core.client_table import ClientFigures, ClientTable
from flasync.core.clock import Clock, RunClock
from flasync.core.errors import ConfigError
from flasync.core.events import TaskAssigned
from flasync.data import Partition
from flasync.runtime.naming import rule_name
from flasync.runtime.prepare import Prepared, clients_in_flight
from flasync.runtime.secure import RoomState, secure_room
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
from flasync.server.intake import RowDecoder
from flasync.server.loop import Evaluator, Stateful
from flasync.server.registry import PostTask, StartGroup
from flasync.server.sampler import Availability
from flasync.server.topology import Tree
from flasync.training.diagnostics import TrainingDiagnostics
from flasync.training.executors.threads import ModelPool, TrainingExecutor
from flasync.training.jobs import ClientSamples, JobContext
from flasync.training.local import EvalResult, LocalObjective, LocalTraining, evaluate, objective_name
from flasync.training.plugins import ClientPlugin, ServerPlugin
from flasync.training.residuals import ResidualStore
from flasync.training.tasks import task_objective

__all__ = [
    "AggregatorFactory",
    "ServerParts",
    "build_server",
    "build_world",
    "check_aggregator",
    "check_objective",
    "client_table",
    "custom_aggregator",
    "make_aggregator",
    "make_evaluator",
    "make_example_weight",
    "make_server_optimizer",
    "make_staleness_weight",
    "staleness_weight_of",
]


AggregatorFactory = Callable[[torch.Tensor, ServerConfig], Aggregator]
"""Builds a server rule of your own from the global flat weights (to change in place) and the server config."""


def build_world(
    config: RunConfig,
    prepared: Prepared,
    executor: TrainingExecutor,
    *,
    bus: EventBus,
    clock: Clock,
    log: Any,
    wall: Callable[[], float],
    diagnostics: TrainingDiagnostics | None,
    scratch: Callable[[], str],
    objective: LocalObjective | None = None,
    plugins: Sequence[ClientPlugin] = (),
) -> ClientWorld:
    """Assemble the world simulated clients live in: data on the device, population, network, faults, jobs.

    Args:
        config: The run's configuration.
        prepared: The run's data, partition and model.
        executor: Where training jobs run.
        bus: The run's event bus.
        clock: The run's clock.
        log: The run's logger.
        wall: Monotonic real seconds.
        diagnostics: Training diagnostics run in the workers.
        scratch: Returns a scratch folder removed after the run (error-feedback residuals spill there when
            ``codec.residual_dir`` is not set).
        objective: The loss local training minimises (None: cross-entropy).
        plugins: A caller's own per-client algorithm state, after the run's own.
    """
    upload_codec = pipeline(config.codec.upload, sparse=config.model.prune is not None)
    objective = task_objective(config.task, objective)
    training = LocalTraining(**config.client.model_dump(exclude={"personal"}), objective=objective)
    client_plugins = (*_client_plugins(config, prepared, upload_codec, scratch, training, executor.models), *plugins)
    if config.eval.clients.enabled:
        local = next((plugin for plugin in client_plugins if isinstance(plugin, LocalLayers | Ditto)), None)
        client_plugins = (
            client_evaluation(
                config, prepared, executor, bus=bus, clock=clock, wall=wall, local=local, training=training
            ),
            *client_plugins,
        )
    samples = _client_samples(config, prepared)
    job = _job_context(config, prepared, executor, upload_codec, training, diagnostics=diagnostics, wall=wall)
    population = config.population
    trace = prepared.trace
    return ClientWorld(
        clock=clock,
        bus=bus,
        log=log,
        wall=wall,
        seed=config.seed,
        population=Population(
            prepared.sizes,
            population.speed,
            config.seed,
            available_fraction=population.available_fraction,
            availability_period_s=population.availability_period_s,
            slow_clients=population.slow_clients,
            trace_slowdown=None if trace is None else 1.0 / trace.speed,
        ),
        network=Network(config.network, population.num_clients, config.seed, _trace_links(trace)),
        faults=FaultModel(
            config.faults,
            config.seed,
            population.num_clients,
            None if trace is None else TraceWindows(trace, population.num_clients),
        ),
        samples=samples,
        pool=executor.pool,
        job=job,
        plugins=client_plugins,
    )


_TAKEN_NAMES = frozenset(
    {"clock", "residuals", "variates", "controls", "privacy", "version", "weights", "queued", "answered"}
    | {"prune", "prune_mask", "personal", "ditto"}
    | {"client_eval", "client_eval_versions"}
    | {"aggregator", "accounting", "sampler", "registry", "intake", "policy", "secure_aggregation"}
)
"""Names of a checkpoint's entries besides a caller's plug-ins: the server's own state and the run's own plug-ins."""


def _job_context(
    config: RunConfig,
    prepared: Prepared,
    executor: TrainingExecutor,
    upload_codec: Pipeline,
    training: LocalTraining,
    *,
    diagnostics: TrainingDiagnostics | None,
    wall: Callable[[], float],
) -> JobContext:
    """Return what the training jobs need in their worker threads (with the cloud intake's decoder, if any)."""
    num_params = prepared.initial.numel()
    return JobContext(
        models=executor.models,
        local=training,
        upload_codec=upload_codec,
        num_params=num_params,
        diagnostics=diagnostics,
        wall=wall,
        prepare=_row_decoder(config, prepared, upload_codec, num_params, wall),
    )


def _row_decoder(
    config: RunConfig, prepared: Prepared, codec: Pipeline, num_params: int, wall: Callable[[], float]
) -> RowDecoder | None:
    """Return the decoder the training workers run on a cohort's uploads for the cloud's intake, where the uploads go
    straight to it on the CPU (None: edges, secure aggregation or a GPU server decode them themselves)."""
    if isinstance(config.topology, TreeTopology) or config.secure_aggregation.enabled or prepared.device.type != "cpu":
        return None
    return RowDecoder(codec=codec, num_params=num_params, max_norm=config.resilience.max_update_norm, wall=wall)


def _trace_links(trace: DeviceTrace | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Return a device trace's link bandwidths (up, down), None where it gives none."""
    if trace is None or trace.upload_bytes_per_s is None or trace.download_bytes_per_s is None:
        return None
    return trace.upload_bytes_per_s, trace.download_bytes_per_s


def check_plugins(plugins: Sequence[object]) -> None:
    """Refuse a caller's plug-ins that are of neither kind, unnamed, or named like other checkpoint state.

    Raises:
        ConfigError: One line naming the plug-in and what is wrong.
    """
    seen: set[str] = set()
    for plugin in plugins:
        kind = type(plugin).__name__
        if not isinstance(plugin, ClientPlugin | ServerPlugin):
            raise ConfigError(f"plugins: {kind} is neither a flasync.ClientPlugin nor a flasync.ServerPlugin")
        name = plugin.name
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"plugins: {kind}.name must be a non-empty identifier, not {name!r}")
        if name in _TAKEN_NAMES or name in seen:
            raise ConfigError(f"plugins: {kind}.name {name!r} is taken (a checkpoint holds one entry per name)")
        seen.add(name)


def _client_plugins(
    config: RunConfig,
    prepared: Prepared,
    upload_codec: Pipeline,
    scratch: Callable[[], str],
    training: LocalTraining,
    models: ModelPool,
) -> tuple[ClientPlugin, ...]:
    """Return the clients' algorithm state: error-feedback residuals (when the upload codec keeps them) and SCAFFOLD's
    control variates (when it is on), each bounded in memory and spilled to disk, and the pruning mask's gradient
    masking (when pruning is on), and the clients' own local layers or personal models (``client.personal``)."""
    plugins: list[ClientPlugin] = []
    num_params = prepared.initial.numel()
    if upload_codec.error_feedback:
        spill = config.codec.residual_dir or scratch()
        plugins.append(
            ErrorFeedback(
                ResidualStore(num_params, max_in_memory=config.codec.max_residuals_in_memory, spill_dir=spill)
            )
        )
    if config.scaffold.enabled:
        scaffold = config.scaffold
        store = ResidualStore(
            num_params, max_in_memory=scaffold.max_in_memory, spill_dir=scaffold.spill_dir or scratch()
        )
        plugins.append(ScaffoldClients(store, seed=config.seed, lr=config.client.lr))
    if config.model.prune is not None:
        plugins.append(PruningClients())
    personal = _personal(config, prepared, scratch, training, models)
    return (*plugins, personal) if personal is not None else tuple(plugins)


def _personal(
    config: RunConfig, prepared: Prepared, scratch: Callable[[], str], training: LocalTraining, models: ModelPool
) -> LocalLayers | Ditto | None:
    """Return the clients' local layers (FedBN) or personal models (Ditto), bounded in memory and spilled to disk
    (None: neither; fine-tuning keeps nothing)."""
    personal = config.client.personal
    if personal is None or personal.kind == "finetune":
        return None
    spill = personal.spill_dir or scratch()
    if personal.kind == "fedbn":
        positions = local_positions(prepared.factory(), personal.layers)
        return LocalLayers(
            ResidualStore(positions.numel(), max_in_memory=personal.max_in_memory, spill_dir=spill), positions
        )
    tune = FineTune(
        _client_samples(config, prepared), training, models, seed=config.seed, steps=personal.steps, lr=personal.lr
    )
    store = ResidualStore(prepared.initial.numel(), max_in_memory=personal.max_in_memory, spill_dir=spill)
    return Ditto(store, tune, lam=personal.lam)


def _client_samples(config: RunConfig, prepared: Prepared, partition: Partition | None = None) -> ClientSamples:
    """Return the training data where the clients' jobs read it: on the device, or pinned in host memory."""
    device = prepared.device
    # Data, weights and the aggregation buffers (which follow the weights) live on the training device.
    data_device = device if config.executor.data_on_device else torch.device("cpu")
    train_x, train_y = prepared.train.x.to(data_device), prepared.train.y.to(data_device)
    if device.type == "cuda" and not config.executor.data_on_device:
        train_x, train_y = train_x.pin_memory(), train_y.pin_memory()
    rows = prepared.partition if partition is None else partition
    return ClientSamples(
        train_x,
        train_y,
        rows,
        torch.from_numpy(np.array(rows.indices, dtype=np.int64)).to(data_device),
        prepared.lazy,
    )


def client_evaluation(
    config: RunConfig,
    prepared: Prepared,
    executor: TrainingExecutor,
    *,
    bus: EventBus,
    clock: Clock,
    wall: Callable[[], float],
    local: LocalLayers | Ditto | None = None,
    training: LocalTraining | None = None,
) -> ClientEvaluation:
    """Return the clients' side of client-side evaluation (``eval.clients``), on each client's held-out samples,
    with the clients' ``local`` layers (``client.personal``) also evaluated as their personal models, or the downloaded
    model fine-tuned with the run's local ``training``."""
    cfg = config.eval.clients
    personal = config.client.personal
    adapt = None
    if personal is not None and personal.kind == "finetune" and training is not None:
        samples = _client_samples(config, prepared)
        adapt = FineTune(samples, training, executor.models, seed=config.seed, steps=personal.steps, lr=personal.lr)
    assert prepared.held_out is not None  # prepare() splits whenever client-side evaluation is on
    return ClientEvaluation(
        Selection(config.seed, fraction=cfg.fraction, every=cfg.every),
        cfg.when,
        _client_samples(config, prepared, prepared.held_out),
        executor.models,
        prepared.metrics,
        bus.publish_nowait,
        clock.now,
        batch_size=config.eval.batch_size,
        wall=wall,
        regression=config.task == "regression",
        personal=None if local is None else local.personal,
        adapt=adapt,
    )


def evaluation_summary(
    config: RunConfig, *, bus: EventBus, clock: Clock, log: Any, clients: ClientFigures | None = None
) -> EvaluationSummary:
    """Return the server's side of client-side evaluation, watching ``bus`` for the clients' reports (each also
    recorded in ``clients``, the per-client table, where there is one)."""
    cfg = config.eval.clients
    names = config.eval.metric_names
    if config.client.personal is not None:
        names = (*names, *(f"personal/{name}" for name in names))
    summary = EvaluationSummary(
        names if config.task == "classification" else tuple(n for n in names if not n.endswith("accuracy")),
        min_reports=cfg.min_reports,
        deadline_s=cfg.deadline_s,
        now=clock.now,
        log=log,
        publish=bus.publish_nowait,
        clients=clients,
    )
    bus.add_instrument(summary)
    return summary


def make_evaluator(prepared: Prepared, executor: TrainingExecutor, clock: Clock, *, batch_size: int) -> Evaluator:
    """Return the server's evaluator: the held-out split on the device, evaluated in the executor (a language
    model's figures have its perplexity, ``exp`` of the loss)."""
    device = prepared.device
    test_x, test_y = prepared.test.x.to(device), prepared.test.y.to(device)
    perplexity = prepared.config.task == "language_model"

    async def evaluate_weights(flat: torch.Tensor) -> EvalResult | None:
        if test_y.numel() == 0:
            return None
        result = await clock.run(
            executor.pool,
            lambda: evaluate(
                executor.models.get(),
                flat,
                test_x,
                test_y,
                batch_size=batch_size,
                metrics=prepared.metrics,
                regression=prepared.test.regression,
            ),
            simulated_s=0.0,
        )
        if perplexity:  # a language model's: exp of the mean cross-entropy per character
            result = dataclasses.replace(result, metrics={**result.metrics, "perplexity": math.exp(result.loss)})
        return result

    return evaluate_weights


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
    if isinstance(config, AdagradServerOptimizer):
        return ServerOptimizer.adagrad(weights, lr=config.lr, beta1=config.beta1, tau=config.tau)
    if isinstance(config, YogiServerOptimizer):
        return ServerOptimizer.yogi(weights, lr=config.lr, beta1=config.beta1, beta2=config.beta2, tau=config.tau)
    return ServerOptimizer.sgd(weights, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov)


def make_example_weight(config: ServerConfig) -> ExampleWeight:
    """Return how much an update's samples count: by samples for FedAvg and FedBuff's ``samples``, else equally."""
    if isinstance(config, FedAvgServer) or (isinstance(config, FedBuffServer) and config.example_weight == "samples"):
        return SampleExampleWeight()
    return EqualExampleWeight()


def staleness_weight_of(config: ServerConfig) -> StalenessWeight:
    """Return the staleness weight of a server's updates (FedAvg's rounds have none: a constant 1)."""
    return (
        make_staleness_weight(config.staleness)
        if isinstance(config, FedBuffServer | FedAsyncServer)
        else (ConstantStaleness())
    )


def make_aggregator(weights: torch.Tensor, config: ServerConfig, noise: GaussianMechanism | None = None) -> Aggregator:
    """Build the aggregation rule of a server config over ``weights`` (with differential privacy's ``noise``)."""
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
            # Under differential privacy every client counts the same: its share of the sum is bounded by C.
            example_weight=SampleExampleWeight() if noise is None else EqualExampleWeight(),
            release=None if noise is None else noise.privatize,
        )
    if isinstance(config, FedBuffServer):
        return BufferedAggregator(
            weights,
            size=config.buffer_size,
            optimizer=make_server_optimizer(weights, config.optimizer),
            staleness=make_staleness_weight(config.staleness),
            example_weight=make_example_weight(config),
            release=None if noise is None else noise.privatize,
        )
    return MixingAggregator(weights, alpha=config.alpha, staleness=make_staleness_weight(config.staleness))


_AGGREGATOR_MEMBERS = ("add", "add_partial", "ready", "step", "count", "nbytes", "state_dict", "load_state_dict")


def custom_aggregator(factory: AggregatorFactory, weights: torch.Tensor, config: ServerConfig) -> Aggregator:
    """Build a user's aggregation rule over ``weights`` and wrap it for the server (see :class:`CustomAggregator`).

    Raises:
        ConfigError: If what the factory returns lacks a member of :class:`~flasync.aggregation.Aggregator`.
    """
    rule = factory(weights, config)
    missing = [name for name in _AGGREGATOR_MEMBERS if not hasattr(rule, name)]
    if missing:
        raise ConfigError(
            f"the {type(rule).__qualname__} that aggregator {rule_name(factory)} returned lacks "
            f"{', '.join(missing)} of the flasync.Aggregator protocol"
        )
    return CustomAggregator(rule, objective_name(rule))


def check_aggregator(config: RunConfig, factory: AggregatorFactory) -> None:
    """Check that a user's aggregation rule can work under the configuration, before anything runs.

    Under ``[secure_aggregation]`` the server never holds one update: the rule gets each group's unmasked sum
    through ``add_partial`` (its members weighted themselves: ``staleness`` 0) and ``add`` is never called. A rule
    that combines individual updates (a robust rule, a filter on norms) cannot do its job on sums, so a factory runs
    under secure aggregation only when it says it works from sums: ``partial_sums = True`` on the factory (a class
    attribute of a rule class used as its own factory, or an attribute set on a factory function).

    Raises:
        ConfigError: If secure aggregation is on and the factory does not say ``partial_sums = True``.
    """
    if config.secure_aggregation.enabled and getattr(factory, "partial_sums", False) is not True:
        raise ConfigError(
            f"secure_aggregation.enabled: the aggregator {rule_name(factory)} would get only each group's sum "
            "(add_partial), never one update; set partial_sums = True on it if it works from sums"
        )


def check_objective(config: RunConfig, objective: LocalObjective) -> None:
    """Check that a user's local objective has what training needs and fits the executor.

    Raises:
        ConfigError: If it has no callable ``loss`` or ``vectorizable``, or says it is not vectorizable while
            ``executor.kind`` is ``vectorized``.
    """
    name = objective_name(objective)
    if not callable(getattr(objective, "loss", None)) or not hasattr(objective, "vectorizable"):
        raise ConfigError(f"objective {name} needs a loss(outputs, targets) method and a vectorizable attribute")
    if config.executor.kind == "vectorized" and not objective.vectorizable:
        raise ConfigError(
            f"executor.kind: the objective {name} is not vectorizable; use the threads executor or make it so"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerParts:
    """The server and the edges (whose tier totals a runtime reads after a run)."""

    server: Server
    edges: EdgeNetwork | None


def _edge_settings(config: RunConfig, topology: TreeTopology) -> EdgeSettings:
    return EdgeSettings(
        buffer_size=topology.buffer_size,
        max_wait_s=topology.max_wait_s,
        kappa2=topology.kappa2,
        link=topology.link,
        per_edge_metrics=topology.per_edge_metrics,
        staleness=staleness_weight_of(config.server),
        example_weight=make_example_weight(config.server),
        seed=config.seed,
    )


def _make_policy(
    config: RunConfig,
    aggregator: Aggregator,
    registry: TaskRegistry,
    sampler: ClientSampler,
    accounting: Accounting,
    edges: EdgeNetwork | None,
    *,
    bus: EventBus,
    clock: Clock,
    log: Any,
) -> Policy:
    """Return when tasks start and versions are due: HierFAVG rounds, sync rounds, or async slots."""
    server, res = config.server, config.resilience
    if isinstance(server, FedAvgServer) and edges is not None:
        return TreeRounds(
            clients_per_round=server.clients_per_round,
            edges=edges,
            registry=registry,
            sampler=sampler,
            clock=clock,
            accounting=accounting,
        )
    if isinstance(server, FedAvgServer):
        return SyncRounds(
            clients_per_round=server.clients_per_round,
            over_selection=res.over_selection,
            quorum=res.round_quorum,
            deadline_s=res.round_deadline_s,
            registry=registry,
            sampler=sampler,
            clock=clock,
            bus=bus,
            accounting=accounting,
            log=log,
            min_clients=server.min_clients,
            min_clients_wait_s=server.min_clients_wait_s,
        )
    return AsyncSlots(
        concurrency=server.concurrency,
        registry=registry,
        sampler=sampler,
        clock=clock,
        ready=aggregator.ready,
        accounting=accounting,
        edges=edges,
    )


def build_server(
    config: RunConfig,
    weights: torch.Tensor,
    *,
    bus: EventBus,
    clock: RunClock,
    wall: Callable[[], float],
    log: Any,
    population: Population,
    world: ClientWorld,
    tree: Tree | None,
    evaluate: Evaluator,
    privacy: PrivacyPlan | None = None,
    aggregator_factory: AggregatorFactory | None = None,
    start_task: PostTask | None = None,
    availability: Availability | None = None,
    plugins: Sequence[ServerPlugin] = (),
    remote: Stateful | None = None,
    shapes: Sequence[tuple[int, ...]] = (),
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
        privacy: The run's differential privacy (None: off).
        aggregator_factory: Builds the aggregation rule instead of ``config.server`` (which still picks the policy).
        start_task: Posts each task to its client at dispatch (a remote transport's mailbox), instead of coroutines.
        availability: Who can take a task now, instead of the failure model's windows (the remote transport's).
        plugins: A caller's own server-side algorithm state, after the run's own.
        remote: The remote transport's checkpoint component (:class:`~flasync.clients.remote.transport.Incarnations`).
        shapes: The shapes of the tensors of ``weights``, in order (``model.prune`` prunes each on its own).
    """
    in_flight = clients_in_flight(config, len(population))
    accounting, registry, group, sampler, room = _make_dispatch(
        config, population, world, in_flight, bus=bus, clock=clock, start_task=start_task, availability=availability
    )
    clip_norm, noise = _privacy_noise(config, privacy, weights)
    make_intake = _intake_factory(config, registry, world, weights, clip_norm=clip_norm, wall=wall)
    edge_codec = pipeline(config.topology.codec if isinstance(config.topology, TreeTopology) else ())
    edges = _make_edges(
        config, tree, registry, make_intake, edge_codec, weights, bus=bus, clock=clock, wall=wall, log=log
    )
    aggregator = _server_aggregator(config, weights, noise, aggregator_factory)
    server_plugins = _server_plugins(
        config, weights, privacy, world, shapes, plugins, bus=bus, clock=clock, log=log, clients=accounting.clients
    )
    policy = _make_policy(config, aggregator, registry, sampler, accounting, edges, bus=bus, clock=clock, log=log)
    if group is not None:
        _group_answers(group, policy, registry, tree)
    server = Server(
        weights,
        bus=bus,
        clock=clock,
        wall=wall,
        log=log,
        aggregator=aggregator,
        policy=policy,
        registry=registry,
        intake=make_intake(server_plugins, _cloud_rows(world)),
        accounting=accounting,
        sampler=sampler,
        download_codec=pipeline(config.codec.download, sparse=config.model.prune is not None),
        edge_codec=edge_codec,
        evaluate=evaluate,
        rules=_stop_rules(config),
        inbox_capacity=_inbox_capacity(in_flight, tree),
        download_generator=lambda version: seeding.torch_stream(config.seed, seeding.DOWNLOAD_CODEC, version),
        components=_server_components(clock, world, registry, remote, room),
        plugins=server_plugins,
    )
    return ServerParts(server=server, edges=edges)


def client_table(config: RunConfig) -> ClientTable | None:
    """Return the run's per-client table (``tracking.client_table``; None: off).

    The accounting counts every task's outcome and bytes in it (:attr:`Accounting.clients`). It is also a
    :class:`~flasync.core.client_table.ClientFigures` sink: whatever learns per-client figures (an evaluation on
    clients) feeds them to its ``record``, and each figure becomes a column of the table.
    """
    tcfg = config.tracking
    if not tcfg.client_table:
        return None
    return ClientTable(tcfg.client_table_rows, tcfg.client_table_top, tcfg.client_table_rank)


def _make_dispatch(
    config: RunConfig,
    population: Population,
    world: ClientWorld,
    in_flight: int,
    *,
    bus: EventBus,
    clock: RunClock,
    start_task: PostTask | None,
    availability: Availability | None,
) -> tuple[Accounting, TaskRegistry, CohortClients | None, ClientSampler, SecureRoom | None]:
    """Return how tasks reach clients: the accounting of their outcomes, the registry of tasks in flight, the
    simulated clients' coroutine (None: a transport starts each task), the sampler, and the room where clients hold
    their updates for secure aggregation (None: off)."""
    # Every task of several waves failing means the model or data is broken, not an unlucky client. Only
    # genuine training errors count: injected faults, dropouts and timeouts never do.
    # A server that refuses every update for many waves of tasks cannot make progress: it ends the run with the
    # refusal reasons instead of training for ever.
    accounting = Accounting(
        failure_limit=max(3 * in_flight, 30), rejection_limit=max(20 * in_flight, 200), clients=client_table(config)
    )
    room = _secure_room(config, world, lambda: registry, bus=bus, clock=clock)
    group: CohortClients | None = None
    start: StartGroup | PostTask
    if start_task is None:
        group = CohortClients(world, live=lambda task: registry.holds(task), secure=room)
        start = group.run
    else:
        start = start_task
    # Simulated clients that never crash, hang, drop out or go offline answer on timelines known at dispatch: the
    # tasks dispatched together share one coroutine (such a fault decides per task whether and when it answers).
    share = group is not None and (world.faults is None or not world.faults.active) and clock.virtual
    lru = config.population.sampling == "lru"
    # Async slots draw idle clients one at a time, excluding those in flight: there an LRU draw passes over them.
    follow = lru and not isinstance(config.server, FedAvgServer)
    registry = TaskRegistry(
        bus=bus,
        clock=clock,
        accounting=accounting,
        num_clients=len(population),
        start=start,
        timeout_s=config.resilience.task_timeout_s,
        # Only least-recently-used sampling reads the clients' last use: other runs never build that state.
        mark_used=population.mark_used if lru else None,
        mark_idle=population.mark_idle if follow else None,
        # Only client plug-ins and a secure room keep state per task: without them a release tells nobody.
        on_release=_released(world, room),
        share=share,
        holding=None if room is None else room.holds,
        on_attach=None if room is None else room.attached,
        post=start_task is not None,
    )
    if group is not None:  # the registry's own check, asked once per task: no lambda in between once it exists
        group.live = registry.holds
    if follow:
        population.follow_tasks(registry.busy)
    if availability is None and world.faults is not None and world.faults.windows:
        availability = world.faults
    sampler = ClientSampler(
        population, config.population.sampling, seeding.numpy_stream(config.seed, seeding.SERVER), availability
    )
    return accounting, registry, group, sampler, room


def _released(world: ClientWorld, room: SecureRoom | None) -> Callable[[TaskAssigned], None] | None:
    """What a task's release tells: the client plug-ins (:meth:`ClientWorld.forget`) where there are any, the secure
    room where there is one (None: nothing keeps state per task, and a release calls nothing)."""
    if room is None:
        return world.forget if world.plugins else None
    return _both(world.forget, room.released) if world.plugins else room.released


def _both(
    first: Callable[[TaskAssigned], None], second: Callable[[TaskAssigned], None]
) -> Callable[[TaskAssigned], None]:
    """Return a callback that tells ``first``, then ``second``."""

    def both(task: TaskAssigned) -> None:
        first(task)
        second(task)

    return both


def _secure_room(
    config: RunConfig, world: ClientWorld, registry: Callable[[], TaskRegistry], *, bus: EventBus, clock: Clock
) -> SecureRoom | None:
    """Return the room where simulated clients hold their updates for secure aggregation (None: off)."""
    if not config.secure_aggregation.enabled:
        return None
    staleness, example_weight = staleness_weight_of(config.server), make_example_weight(config.server)
    return secure_room(
        config, world, registry, staleness=staleness, example_weight=example_weight, bus=bus, clock=clock
    )


def _group_answers(group: CohortClients, policy: Policy, registry: TaskRegistry, tree: Tree | None) -> None:
    """Set whether tasks dispatched together answer together, and whether those due at several times are gathered."""
    group.together = not policy.abandons and registry.timeout_s is None
    # A round that closes on its last answer, straight to the cloud, does nothing between its uploads but fold
    # them in: those due at several times may reach it together.
    group.gather = group.together and policy.rounds and tree is None


def _privacy_noise(
    config: RunConfig, privacy: PrivacyPlan | None, weights: torch.Tensor
) -> tuple[float | None, GaussianMechanism | None]:
    """Return the norm updates are clipped to (None: not clipped) and differential privacy's noise (None: off)."""
    clip_norm = config.resilience.clip_update_norm
    noise: GaussianMechanism | None = None
    if privacy is not None:
        clip_norm = privacy.clip_norm if clip_norm is None else min(clip_norm, privacy.clip_norm)
        seed = config.seed
        noise = GaussianMechanism(
            clip_norm=privacy.clip_norm,
            noise_multiplier=privacy.noise_multiplier,
            denominator=privacy.denominator,
            generator=lambda step: seeding.torch_stream(seed, seeding.PRIVACY, step, device=weights.device),
        )
    return clip_norm, noise


def _cloud_rows(world: ClientWorld) -> RowDecoder | None:
    """The decoder the workers run for the cloud's intake (None: none)."""
    prepare = world.job.prepare
    return prepare if isinstance(prepare, RowDecoder) else None


def _intake_factory(
    config: RunConfig,
    registry: TaskRegistry,
    world: ClientWorld,
    weights: torch.Tensor,
    *,
    clip_norm: float | None,
    wall: Callable[[], float],
) -> Callable[..., Intake]:
    """Return what makes the admission path of the cloud and of each edge (one intake each; the cloud's with the
    run's server-side plug-ins)."""
    server_cfg, res = config.server, config.resilience
    num_params = weights.numel()
    max_staleness = server_cfg.max_staleness if isinstance(server_cfg, FedBuffServer | FedAsyncServer) else None
    upload_codec = world.job.upload_codec

    def make_intake(plugins: Sequence[ServerPlugin] = (), row_decoder: RowDecoder | None = None) -> Intake:
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
                norm_bound_factor=res.norm_bound_factor,
            ),
            max_staleness=max_staleness,
            clip_norm=clip_norm,
            wall=wall,
            plugins=plugins,
            row_decoder=row_decoder,
        )

    return make_intake


def _make_edges(
    config: RunConfig,
    tree: Tree | None,
    registry: TaskRegistry,
    make_intake: Callable[[], Intake],
    edge_codec: Pipeline,
    weights: torch.Tensor,
    *,
    bus: EventBus,
    clock: RunClock,
    wall: Callable[[], float],
    log: Any,
) -> EdgeNetwork | None:
    """Return the edges of a tree topology (None: a flat run)."""
    if tree is None or not isinstance(config.topology, TreeTopology):
        return None
    return EdgeNetwork(
        tree,
        _edge_settings(config, config.topology),
        registry=registry,
        make_intake=make_intake,
        bus=bus,
        clock=clock,
        wall=wall,
        log=log,
        edge_codec=edge_codec,
        num_params=weights.numel(),
        device=weights.device,
    )


def _inbox_capacity(in_flight: int, tree: Tree | None) -> int:
    """Return how many messages the cloud's inbox holds."""
    capacity = 2 * in_flight + 8
    if tree is not None:
        # Edges may hold many finished tasks' answers at once: the cloud's inbox must never block them.
        capacity = max(capacity, 4 * tree.num_edges + 2 * in_flight + 8)
    return capacity


def _stop_rules(config: RunConfig) -> StopRules:
    """Return when the server evaluates, checkpoints and stops."""
    stop = config.stop
    return StopRules(
        max_versions=stop.max_versions,
        target_accuracy=stop.target_accuracy,
        max_simulated_s=stop.max_simulated_s,
        max_wall_s=stop.max_wall_s,
        eval_every=config.eval.every_versions,
        checkpoint_every=config.checkpoint.every_versions,
        checkpoint_every_s=config.checkpoint.every_s,
    )


def _server_aggregator(
    config: RunConfig,
    weights: torch.Tensor,
    noise: GaussianMechanism | None,
    aggregator_factory: AggregatorFactory | None,
) -> Aggregator:
    """Return the cloud's aggregation rule: the one ``config.server`` names, or a user's factory's."""
    if aggregator_factory is None:
        server = config.server
        if config.secure_aggregation.enabled and isinstance(server, FedBuffServer):
            # each revealed buffer sum is one step: the clients formed the buffer of K themselves
            server = server.model_copy(update={"buffer_size": 1})
        return make_aggregator(weights, server, noise)
    return custom_aggregator(aggregator_factory, weights, config.server)


def _server_plugins(
    config: RunConfig,
    weights: torch.Tensor,
    privacy: PrivacyPlan | None,
    world: ClientWorld,
    shapes: Sequence[tuple[int, ...]],
    extra: Sequence[ServerPlugin],
    *,
    bus: EventBus,
    clock: Clock,
    log: Any,
    clients: ClientFigures | None = None,
) -> tuple[ServerPlugin, ...]:
    """Return the server's algorithm state: client-side evaluation's summary (its reports also go to ``clients``,
    the per-client table), SCAFFOLD's control variate ``c``,
    central differential privacy's one-update-per-client rule and accountant, and the pruning mask (each when it is
    on), then ``extra`` (a caller's own)."""
    plugins: list[ServerPlugin] = []
    if config.eval.clients.enabled:
        plugins.append(evaluation_summary(config, bus=bus, clock=clock, log=log, clients=clients))
    if config.scaffold.enabled:
        controls = ControlVariate(weights.numel(), num_clients=len(world.population), device=weights.device)
        plugins.append(ScaffoldServer(controls, world.job.upload_codec))
    if privacy is not None:
        plugins.append(CentralPrivacy(privacy.accountant))
    prune = config.model.prune
    if prune is not None:
        plugins.append(
            PruningServer(
                weights,
                target_density=prune.target_density,
                every_versions=prune.every_versions,
                steps=prune.steps,
                shapes=shapes,
            )
        )
    return (*plugins, *extra)


class _ClientState:
    """A client plug-in's state as a checkpoint component: the tasks in flight are the registry's."""

    def __init__(self, plugin: ClientPlugin, registry: TaskRegistry) -> None:
        self.plugin = plugin
        self.registry = registry

    def state_dict(self) -> dict[str, Any]:
        """Return the plug-in's state, tasks in flight as they started."""
        return self.plugin.state_dict(iter(self.registry))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the plug-in's state."""
        self.plugin.load_state_dict(state)


def _server_components(
    clock: RunClock, world: ClientWorld, registry: TaskRegistry, remote: Stateful | None, room: SecureRoom | None
) -> dict[str, Stateful]:
    """Return the state a checkpoint keeps besides the server's own: the clock, the clients' plug-ins' state, the
    remote transport's and the updates clients hold for secure aggregation (each when there is one)."""
    components: dict[str, Stateful] = {"clock": clock}
    if remote is not None:
        components["remote"] = remote
    if room is not None:
        components[room.name] = RoomState(room, registry)
    return components | {plugin.name: _ClientState(plugin, registry) for plugin in world.plugins}
