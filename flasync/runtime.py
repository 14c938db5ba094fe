"""The runtime: wires data, model, clock, bus, executor, server and tracking into one run.

``await Federation(config).run()`` works inside any running event loop (a web service's, say): it creates no loop,
closes none, and never blocks the loop - data preparation, training, evaluation and every MLflow call run in
worker threads. Every task it starts belongs to its ``asyncio.TaskGroup``.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import math
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np
import structlog
import torch
import yaml
from torch import nn

import tracking
from flasync import checkpoint, codecs, seeding
from flasync._version import __version__
from flasync.assembly import build_server, pipeline
from flasync.bus import EventBus
from flasync.client import ClientWorld
from flasync.clock import Clock, VirtualClock, WallClock
from flasync.config import (
    DigitsData,
    DirichletPartition,
    FedAvgServer,
    IIDPartition,
    MLPModel,
    RunConfig,
    ShardsPartition,
    SmallCNNModel,
    SyntheticData,
    TreeTopology,
    flatten,
    validate,
)
from flasync.data import (
    ArrayData,
    Partition,
    SyntheticClients,
    from_dataset,
    load_digits,
    make_synthetic,
    partition_dirichlet,
    partition_iid,
    partition_shards,
    train_test_split,
)
from flasync.diagnostics import AlertMonitor, LayerLayout, TrainingDiagnostics, layer_layout
from flasync.errors import ConfigError, DataError, RunInterrupted
from flasync.executors import ThreadTrainingExecutor, resolve_device
from flasync.faults import FaultModel
from flasync.jobs import ClientSamples, JobContext
from flasync.models import MLP, SmallCNN
from flasync.population import Network, Population
from flasync.profiling import (
    Instrumentation,
    Profiler,
    build_profile,
    gpu_status,
    headline,
    peak_rss_bytes,
    render_plots,
    torch_memory,
)
from flasync.residuals import ResidualStore
from flasync.server import Server
from flasync.topology import Tree, build_tree
from flasync.training import EvalResult, LocalTraining, evaluate, flat_parameters

__all__ = ["Federation", "RunSummary", "run", "weights_sha256"]

ModelFactory = Callable[[], nn.Module]
_METRIC_EXCLUDE = frozenset(tracking.DEFAULT_EXCLUDE | {"version"})
# Per-update figures logged only with ``tracking.metrics = "all"``; their per-version sums are in ``profile.version.*``
# and profile.json either way. Each MLflow metric row costs the store's writer ~0.2 ms of CPU (sqlite).
_DETAIL_KEYS = frozenset(
    {
        "client.sim_train_s",
        "client.sim_download_s",
        "client.encode_s",
        "client.compression",
        "client.residual_norm",
        "server.update.staleness_weight",
        "server.update.decode_s",
        "server.update.norm",
    }
)


def weights_sha256(weights: torch.Tensor) -> str:
    """Return the sha256 of a flat vector's little-endian float32 bytes."""
    array = weights.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return hashlib.sha256(array.tobytes()).hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    """What a run achieved and cost; also written as ``summary.json``."""

    run_id: str | None
    accuracy: float
    loss: float
    updates_accepted: int
    updates_dropped: int
    updates_failed: int
    tasks_dispatched: int
    tasks_timed_out: int
    tasks_abandoned: int
    versions: int
    wall_s: float
    simulated_s: float
    upload_bytes: int
    download_bytes: int
    staleness_mean: float
    staleness_max: int
    upload_compression: float
    updates_per_s: float
    stop_reason: str
    weights_sha256: str
    cloud_ingress_bytes: int = 0
    cloud_egress_bytes: int = 0
    cloud_aggregate_s: float = 0.0
    topology: str = "flat"
    tiers: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    alerts: int = 0
    stragglers: tuple[int, ...] = ()
    server_idle_fraction: float = math.nan

    def to_dict(self) -> dict[str, Any]:
        """Return the summary as a JSON-ready dict (NaN becomes None, tuples lists)."""

        def clean(value: Any) -> Any:
            if isinstance(value, float) and not math.isfinite(value):
                return None
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            if isinstance(value, tuple):
                return [clean(v) for v in value]
            return value

        return {k: clean(v) for k, v in asdict(self).items()}


@dataclass(frozen=True, slots=True)
class _Prepared:
    train: ArrayData
    test: ArrayData
    partition: Partition
    factory: ModelFactory
    initial: torch.Tensor
    tree: Tree | None
    device: torch.device
    sizes: np.ndarray
    lazy: SyntheticClients | None


class Federation:
    """One federated run, awaitable from any event loop.

    Args:
        config: A :class:`RunConfig` or a mapping validated into one (``None``: the defaults).
        dataset: Training data instead of ``config.data``: an :class:`ArrayData` or any map-style torch
            ``Dataset`` of ``(x, y)`` pairs. It is partitioned over clients as ``config.partition`` says.
        test_dataset: Held-out data evaluated by the server (default: a stratified split of ``dataset`` by
            ``config.data.test_fraction``).
        model_factory: Builds the ``nn.Module`` to train instead of ``config.model``; called once for the initial
            weights (under the run's seed) and once per worker thread.
        tracker: Where params, metrics and artifacts go (default: MLflow per ``config.tracking``).
        client_attributes: Per-client attribute arrays of ``population.num_clients`` values each, e.g.
            ``{"region": [...]}``, for ``topology.assign = "attribute"``.
        clock: Overrides the clock ``config.clock`` names.
        wall: Monotonic real seconds (injected for tests).
        resume: Continue from a checkpoint (see :mod:`flasync.checkpoint`) instead of starting afresh; its
            ``run_id`` (if any) is the MLflow run to continue. ``config`` must be the checkpointed run's config
            (its ``stop`` section may differ).

    Raises:
        ConfigError: If ``config`` is not a valid configuration.
    """

    def __init__(
        self,
        config: RunConfig | Mapping[str, Any] | None = None,
        *,
        dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
        test_dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
        model_factory: ModelFactory | None = None,
        tracker: tracking.Tracker | None = None,
        client_attributes: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
        clock: Clock | None = None,
        wall: Callable[[], float] = time.perf_counter,
        resume: checkpoint.ResumePoint | None = None,
    ) -> None:
        """Validate the configuration and create the clock and bus (nothing runs yet)."""
        if config is None:
            config = RunConfig()
        elif not isinstance(config, RunConfig):
            config = validate(config)
        self.config: RunConfig = config
        self._dataset = dataset
        self._test_dataset = test_dataset
        self._model_factory = model_factory
        self._tracker = tracker
        self._client_attributes = dict(client_attributes or {})
        self.clock: Clock = clock or (VirtualClock() if config.clock == "virtual" else WallClock())
        self.bus = EventBus(on_activity=self.clock.poke)
        self._wall = wall
        self.weights: torch.Tensor | None = None
        self.run_id: str | None = None
        self.profile: dict[str, Any] | None = None
        """The run's profile (``profile.json``) once it finished with ``diagnostics.profile`` on."""
        self._scratch: str | None = None
        self._traces: TrainingDiagnostics | None = None
        self._resume = resume
        self._server: Server | None = None
        self._stop_requested = ""

    def request_stop(self, reason: str = "interrupted") -> None:
        """Ask the run to stop soon, checkpoint and end as ``KILLED``; :meth:`run` then raises ``RunInterrupted``.

        Call it from the run's event loop (a signal handler installed with ``loop.add_signal_handler`` is). The
        server finishes the message at hand, clients are cancelled, every metric is flushed, a checkpoint is
        written (``checkpoint.on_interrupt``) and the tracking run ends ``KILLED``.
        """
        if not self._stop_requested:
            self._stop_requested = reason
        if self._server is not None:
            self._server.request_stop(reason)

    @property
    def stop_requested(self) -> str:
        """What asked the run to stop (empty if nothing did)."""
        return self._stop_requested

    @property
    def server(self) -> Server | None:
        """The running server (for inspection, e.g. :meth:`Server.state_dict`), None outside :meth:`run`."""
        return self._server

    # -------------------------------------------------------------------------------------------- preparation
    def _load_data(self) -> tuple[ArrayData, ArrayData]:
        cfg = self.config
        if self._dataset is not None:
            train = self._dataset if isinstance(self._dataset, ArrayData) else from_dataset(self._dataset)
            if self._test_dataset is not None:
                test = (
                    self._test_dataset
                    if isinstance(self._test_dataset, ArrayData)
                    else from_dataset(self._test_dataset, num_classes=train.num_classes)
                )
                return train, test
            fraction = cfg.data.test_fraction if isinstance(cfg.data, DigitsData) else 0.2
            return train_test_split(train, test_fraction=fraction, rng=seeding.numpy_stream(cfg.seed, seeding.DATA))
        source = cfg.data
        if isinstance(source, DigitsData):
            return train_test_split(
                load_digits(),
                test_fraction=source.test_fraction,
                rng=seeding.numpy_stream(cfg.seed, seeding.DATA),
            )
        assert isinstance(source, SyntheticData)
        test = make_synthetic(
            num_samples=source.test_samples,
            num_features=source.num_features,
            num_classes=source.num_classes,
            rng=seeding.numpy_stream(cfg.seed, seeding.DATA, 1),
        )
        if source.lazy:  # only a sample for shapes: clients draw their own data when sampled
            return self._lazy_clients().client(0), test
        train = make_synthetic(
            num_samples=source.samples_per_client * cfg.population.num_clients,
            num_features=source.num_features,
            num_classes=source.num_classes,
            rng=seeding.numpy_stream(cfg.seed, seeding.DATA, 0),
        )
        return train, test

    def _lazy_clients(self) -> SyntheticClients:
        cfg = self.config
        source = cfg.data
        assert isinstance(source, SyntheticData)
        sizes = np.full(cfg.population.num_clients, source.samples_per_client, dtype=np.int32)
        return SyntheticClients(sizes, num_features=source.num_features, num_classes=source.num_classes, seed=cfg.seed)

    def _partition(self, train: ArrayData) -> Partition:
        cfg = self.config
        n, rng = cfg.population.num_clients, seeding.numpy_stream(cfg.seed, seeding.PARTITION)
        if n > len(train):
            raise DataError(
                f"population.num_clients: {n} clients need one training sample each, but the data has {len(train)}"
            )
        part = cfg.partition
        if isinstance(part, IIDPartition):
            partition = partition_iid(len(train), n, rng=rng)
        elif isinstance(part, DirichletPartition):
            partition = partition_dirichlet(train.y.numpy(), n, alpha=part.alpha, rng=rng, min_samples=part.min_samples)
        else:
            assert isinstance(part, ShardsPartition)
            partition = partition_shards(train.y.numpy(), n, shards_per_client=part.shards_per_client, rng=rng)
        empty = np.flatnonzero(partition.sizes == 0)
        if len(empty):
            raise DataError(f"partition leaves {len(empty)} client(s) with 0 samples (first: client {empty[0]})")
        return partition

    def _factory(self, train: ArrayData) -> ModelFactory:
        if self._model_factory is not None:
            return self._model_factory
        model = self.config.model
        features = int(np.prod(train.feature_shape))
        classes = train.num_classes
        if isinstance(model, MLPModel):
            hidden = model.hidden
            return lambda: MLP(features, hidden, classes)
        assert isinstance(model, SmallCNNModel)
        expected = model.in_channels * model.image_size[0] * model.image_size[1]
        if expected != features:
            raise ConfigError(
                f"model.image_size: {model.in_channels}x{model.image_size[0]}x{model.image_size[1]} = {expected} "
                f"values, but samples have {features}"
            )
        channels, size, in_channels = model.channels, model.image_size, model.in_channels
        return lambda: SmallCNN(in_channels=in_channels, image_size=size, num_classes=classes, channels=channels)

    def _initial_weights(self, factory: ModelFactory, sample: ArrayData) -> torch.Tensor:
        seed = seeding.stream_seed(self.config.seed, seeding.MODEL_INIT)
        try:
            # The factory's initialisers draw from torch's default generator: seed it for this call only.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                module = factory()
        except Exception as exc:
            raise ConfigError(f"model factory failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(module, nn.Module):
            raise ConfigError(f"model factory must return a torch.nn.Module, got {type(module).__name__}")
        try:
            with torch.no_grad():
                out = module(sample.x[:2])
        except Exception as exc:
            raise ConfigError(
                f"model cannot take samples of shape {tuple(sample.feature_shape)}: {type(exc).__name__}: {exc}"
            ) from exc
        if out.dim() != 2 or out.shape[1] != sample.num_classes:
            raise ConfigError(
                f"model outputs shape {tuple(out.shape)} for 2 samples, expected (2, {sample.num_classes}) logits"
            )
        return flat_parameters(module)

    def _device(self) -> torch.device:
        executor = self.config.executor
        try:
            device = resolve_device(executor.device)
        except ValueError as exc:
            raise ConfigError(f"executor.device: {exc}") from exc
        if self.config.client.precision == "fp16" and device.type != "cuda":
            raise ConfigError(f"client.precision: fp16 needs a CUDA device, but training runs on {device}")
        return device

    def _prepare(self) -> _Prepared:
        device = self._device()
        train, test = self._load_data()
        if len(test) == 0:
            raise DataError("the held-out split is empty")
        if test.num_classes != train.num_classes or test.feature_shape != train.feature_shape:
            raise DataError("test data must have the training data's feature shape and classes")
        lazy = None
        if isinstance(self.config.data, SyntheticData) and self.config.data.lazy:
            if self._dataset is not None:
                raise ConfigError("data.lazy: a lazy synthetic source cannot be combined with a given dataset")
            lazy = self._lazy_clients()
            partition = Partition(np.zeros(0, dtype=np.int64), np.zeros(len(lazy) + 1, dtype=np.int64))
            sizes = lazy.sizes.astype(np.int64)
        else:
            partition = self._partition(train)
            sizes = partition.sizes
        factory = self._factory(train)
        initial = self._initial_weights(factory, train)
        return _Prepared(train, test, partition, factory, initial, self._tree(), device, sizes, lazy)

    def _tree(self) -> Tree | None:
        cfg = self.config
        if not isinstance(cfg.topology, TreeTopology):
            return None
        n = cfg.population.num_clients
        attributes = {name: np.asarray(values) for name, values in self._client_attributes.items()}
        if cfg.population.regions is not None:
            rng = seeding.numpy_stream(cfg.seed, seeding.TOPOLOGY)
            attributes.setdefault("region", rng.integers(cfg.population.regions, size=n))
        for name, values in attributes.items():
            if values.shape != (n,):
                raise ConfigError(f"client_attributes[{name!r}]: {values.size} values for {n} clients")
        return build_tree(cfg.topology, n, attributes)

    def _make_tracker(self) -> tracking.Tracker:
        if self._tracker is not None:
            return self._tracker
        cfg = self.config.tracking
        if not cfg.enabled:
            return tracking.NullTracker()
        return tracking.MlflowTracker(cfg.uri, system_metrics=cfg.system_metrics)

    def _tags(self) -> dict[str, str]:
        cfg = self.config
        return {
            "flasync.version": __version__,
            "aggregator": cfg.server.kind,
            "mode": "sync" if isinstance(cfg.server, FedAvgServer) else "async",
            "clock": "virtual" if self.clock.virtual else "wall",
            "topology": self._topology_name(),
            "seed": str(cfg.seed),
        }

    def _topology_name(self) -> str:
        topology = self.config.topology
        if not isinstance(topology, TreeTopology):
            return "flat"
        if topology.edges:
            return f"tree({len(topology.edges)} edges)"
        return "tree(" + "x".join(str(f) for f in topology.fanout) + ")"

    # ---------------------------------------------------------------------------------------------------- run
    async def run(self) -> RunSummary:
        """Run the federation to its stop condition and return its summary.

        Raises:
            ConfigError: If the data, partition or model do not fit the configuration (no MLflow run is left).
            DataError: If the data set cannot be used.
        """
        cfg = self.config
        tracker = self._make_tracker()
        tracker.prepare()  # e.g. its MLflow writer process starts up while the data loads
        try:
            prepared = await asyncio.to_thread(self._prepare)
            if self._stop_requested:
                raise RunInterrupted(self._stop_requested)  # before any tracking run exists
        except BaseException:
            tracker.finish("FAILED")  # no run exists yet: this only stops what prepare() started
            raise
        metrics: tracking.MetricsProcessor | None = None
        if not isinstance(tracker, tracking.NullTracker):
            drop = _DETAIL_KEYS if cfg.tracking.metrics == "standard" else ()
            metrics = tracking.MetricsProcessor(tracker.log_metrics, exclude=_METRIC_EXCLUDE, drop_keys=drop)
        # Metrics are taken at each log call; events below the log level skip structlog's chain.
        log = tracking.make_logger(level=cfg.tracking.log_level, metrics=metrics)
        if self._resume is not None and self._resume.run_id:
            run_id = await asyncio.to_thread(tracker.resume, self._resume.run_id)
        else:
            run_id = await asyncio.to_thread(
                tracker.start,
                experiment=cfg.tracking.experiment,
                run_name=cfg.tracking.run_name,
                params=flatten(cfg),
                tags=self._tags(),
            )
        self.run_id = run_id or None
        warned: set[str] = set()

        def on_fallback(reason: str) -> None:
            if reason not in warned:  # once per reason, not once per cohort
                warned.add(reason)
                log.warning("executor.fallback", reason=reason, metrics=False)

        executor = ThreadTrainingExecutor(
            prepared.factory,
            workers=cfg.executor.workers,
            threads_per_worker=cfg.executor.threads_per_worker,
            vectorized=cfg.executor.kind == "vectorized",
            max_cohort=cfg.executor.max_cohort,
            device=prepared.device,
            on_fallback=on_fallback,
        )
        executor.attach(self.clock)
        status: Literal["FINISHED", "FAILED", "KILLED"] = "FAILED"
        try:
            context = {"run_id": self.run_id} if self.run_id else {}
            with structlog.contextvars.bound_contextvars(**context):
                summary = await self._simulate(prepared, executor, log, tracker)
                await asyncio.to_thread(self._log_artifacts, tracker, prepared, summary, log)
            status = "FINISHED"
            return summary
        except (asyncio.CancelledError, KeyboardInterrupt, RunInterrupted):
            status = "KILLED"
            raise
        finally:
            # Blocking on purpose: this must complete even while the task is being cancelled.
            executor.shutdown()
            tracker.finish(status)
            if self._traces is not None and self._traces.trace_dir is not None:
                shutil.rmtree(self._traces.trace_dir, ignore_errors=True)

    async def _simulate(
        self, prepared: _Prepared, executor: ThreadTrainingExecutor, log: Any, tracker: tracking.Tracker
    ) -> RunSummary:
        cfg = self.config
        dcfg = cfg.diagnostics
        layout: LayerLayout | None = None
        if dcfg.profile or dcfg.level == "full":
            layout = await asyncio.to_thread(lambda: layer_layout(prepared.factory()))
        diagnostics = TrainingDiagnostics(
            dcfg.level,
            layout,
            profile_tasks=dcfg.torch_profiler_tasks,
            trace_dir=tempfile.mkdtemp(prefix="flasync-traces-") if dcfg.torch_profiler_tasks else None,
        )
        self._traces = diagnostics
        local = LocalTraining(**cfg.client.model_dump())
        upload_codec = pipeline(cfg.codec.upload)
        residuals: ResidualStore | None = None
        if upload_codec.error_feedback:
            spill = cfg.codec.residual_dir
            if spill is None:
                spill = self._scratch = tempfile.mkdtemp(prefix="flasync-residuals-")
            residuals = ResidualStore(
                prepared.initial.numel(), max_in_memory=cfg.codec.max_residuals_in_memory, spill_dir=spill
            )
        device = prepared.device
        # Data, weights and the aggregation buffers (which follow the weights) live on the training device.
        data_device = device if cfg.executor.data_on_device else torch.device("cpu")
        train_x, train_y = prepared.train.x.to(data_device), prepared.train.y.to(data_device)
        if device.type == "cuda" and not cfg.executor.data_on_device:
            train_x, train_y = train_x.pin_memory(), train_y.pin_memory()
        samples = ClientSamples(
            train_x,
            train_y,
            prepared.partition,
            torch.from_numpy(np.array(prepared.partition.indices, dtype=np.int64)).to(data_device),
            prepared.lazy,
        )
        job = JobContext(
            models=executor.models,
            local=local,
            upload_codec=upload_codec,
            num_params=prepared.initial.numel(),
            residuals=residuals,
            residual_lock=threading.Lock(),
            diagnostics=diagnostics,
            wall=self._wall,
        )
        population = Population(
            prepared.sizes,
            cfg.population.speed,
            cfg.seed,
            available_fraction=cfg.population.available_fraction,
            availability_period_s=cfg.population.availability_period_s,
            slow_clients=cfg.population.slow_clients,
        )
        world = ClientWorld(
            clock=self.clock,
            bus=self.bus,
            log=log,
            wall=self._wall,
            seed=cfg.seed,
            population=population,
            network=Network(cfg.network, cfg.population.num_clients, cfg.seed),
            faults=FaultModel(cfg.faults, cfg.seed, cfg.population.num_clients),
            samples=samples,
            pool=executor.pool,
            job=job,
            pre_task_residuals={} if residuals is not None else None,
        )
        test_x, test_y = prepared.test.x.to(device), prepared.test.y.to(device)
        clock, batch_size = self.clock, cfg.eval.batch_size

        async def evaluate_weights(flat: torch.Tensor) -> EvalResult | None:
            if test_y.numel() == 0:
                return None
            return await clock.run(
                executor.pool,
                lambda: evaluate(executor.models.get(), flat, test_x, test_y, batch_size=batch_size),
                simulated_s=0.0,
            )

        weights = prepared.initial.to(device, copy=True)
        parts = build_server(
            cfg,
            weights,
            bus=self.bus,
            clock=self.clock,
            wall=self._wall,
            log=log,
            population=population,
            world=world,
            tree=prepared.tree,
            evaluate=evaluate_weights,
        )
        server = parts.server
        if not self.clock.virtual and self._resume is None:
            self.clock.restore({"now": 0.0})  # wall time counts from the federation's start, not from its set-up
        start_sim = self.clock.now()  # a resumed run reports simulated time from the start of the run
        if self._resume is not None:
            server.load_state_dict(self._resume.state)
            self.clock.restore(self._resume.state["clock"])
        writes = _CheckpointWriter(tracker, cfg, log)
        server.on_checkpoint = writes.submit
        self._server = server
        if self._stop_requested:
            server.request_stop(self._stop_requested)
        instrumentation: Instrumentation | None = None
        if dcfg.profile or dcfg.level != "off":
            instrumentation = Instrumentation(
                self.bus,
                profiler=Profiler() if dcfg.profile else None,
                monitor=AlertMonitor(
                    dcfg,
                    layer_names=layout.names if layout is not None else (),
                    weights=lambda: (int(server.version), server.weights),
                    initial=weights.clone() if dcfg.level != "off" else None,
                ),
                log=log,
                set_tags=tracker.set_tags,
                now=self.clock.now,
            )
        residual_memory: dict[str, int] = {}
        start_wall = self._wall()
        log.info(
            "run.started",
            run_id=self.run_id,
            clients=cfg.population.num_clients,
            aggregator=cfg.server.kind,
            clock=cfg.clock,
            params=prepared.initial.numel(),
            metrics=False,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.clock.drive(), name="flasync-clock")
                if instrumentation is not None:
                    tg.create_task(instrumentation.run(), name="flasync-instrumentation")
                try:
                    stats = await server.run()
                    if instrumentation is not None:
                        await instrumentation.drain()  # alerts of the last events still go on the bus
                finally:
                    self.clock.stop()
                    self.bus.close()
        except BaseExceptionGroup as group:
            raise _root_cause(group) from None
        finally:
            self._server = None
            if server.interrupted_state is not None and cfg.checkpoint.on_interrupt:
                writes.submit(server.interrupted_state)
            await asyncio.to_thread(writes.close)
            if residuals is not None:
                # Jobs of cancelled clients may still be running and about to store residuals: let them finish.
                await asyncio.to_thread(executor.shutdown)
                residuals_in_memory, residuals_on_disk = residuals.memory_bytes, residuals.disk_bytes
                residual_memory = {
                    "residual_memory_bytes": residuals_in_memory,
                    "residual_disk_bytes": residuals_on_disk,
                }
                residuals.close()
                log.debug(
                    "codec.residuals",
                    clients=len(residuals),
                    memory_bytes=residuals_in_memory,
                    disk_bytes=residuals_on_disk,
                    spills=residuals.spills,
                    loads=residuals.loads,
                )
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch = None
        wall_s = self._wall() - start_wall
        simulated_s = self.clock.now() - start_sim
        self.weights = weights.cpu()  # artifacts and callers get host tensors, whatever the training device
        if server.stop_requested:
            log.warning(
                "run.interrupted",
                reason=server.stop_requested,
                step=stats.versions,
                versions=stats.versions,
                updates_accepted=stats.updates_accepted,
                checkpoint=writes.last_saved,
                metrics=False,
            )
            raise RunInterrupted(server.stop_requested, run_id=self.run_id, checkpoint=writes.last_saved)
        summary = RunSummary(
            run_id=self.run_id,
            accuracy=stats.accuracy,
            loss=stats.loss,
            updates_accepted=stats.updates_accepted,
            updates_dropped=stats.updates_dropped,
            updates_failed=stats.updates_failed,
            tasks_dispatched=stats.tasks_dispatched,
            tasks_timed_out=stats.tasks_timed_out,
            tasks_abandoned=stats.tasks_abandoned,
            versions=stats.versions,
            wall_s=wall_s,
            simulated_s=simulated_s,
            upload_bytes=stats.upload_bytes,
            download_bytes=stats.download_bytes,
            staleness_mean=stats.staleness_sum / max(stats.updates_accepted, 1),
            staleness_max=stats.staleness_max,
            upload_compression=(
                (stats.updates_accepted + stats.updates_dropped)
                * (codecs.HEADER.size + 4 * prepared.initial.numel())
                / stats.upload_bytes
                if stats.upload_bytes
                else 1.0
            ),
            updates_per_s=stats.updates_accepted / wall_s if wall_s > 0 else 0.0,
            stop_reason=stats.stop_reason,
            weights_sha256=weights_sha256(weights),
            cloud_ingress_bytes=stats.cloud_ingress_bytes,
            cloud_egress_bytes=stats.cloud_egress_bytes,
            cloud_aggregate_s=stats.cloud_aggregate_s,
            topology=self._topology_name(),
            tiers=parts.edges.summary() if parts.edges is not None else {},
            peak_rss_bytes=peak_rss_bytes(),
        )
        figures = {
            key: value
            for key, value in summary.to_dict().items()
            if isinstance(value, int | float) and not isinstance(value, bool)
        }
        bus = self.bus.statistics()
        log.info("run.finished", step=stats.versions, **figures, bus_dropped=bus.dropped, bus_high_water=bus.high_water)
        if summary.tiers:
            log.info("run.tiers", step=stats.versions, **summary.tiers)
        if instrumentation is not None:
            # In a thread: summarising a long run's records must not stall the caller's event loop.
            summary = await asyncio.to_thread(
                self._finish_profile, summary, instrumentation, server, executor, layout, residual_memory, log
            )
        return summary

    def _finish_profile(
        self,
        summary: RunSummary,
        instrumentation: Instrumentation,
        server: Server,
        executor: ThreadTrainingExecutor,
        layout: LayerLayout | None,
        residual_memory: Mapping[str, int],
        log: Any,
    ) -> RunSummary:
        """Build the profile from the instrumentation's records, log its headline metrics, extend the summary."""
        cfg = self.config
        monitor = instrumentation.monitor
        alerts = dict(monitor.counts) if monitor is not None else {}
        rss = peak_rss_bytes()
        summary = replace(summary, peak_rss_bytes=rss, alerts=sum(alerts.values()))
        if instrumentation.profiler is None:
            return summary
        num_params = self.weights.numel() if self.weights is not None else 0
        trainable = layout.num_trainable if layout is not None else num_params
        aggregator = server.aggregator.nbytes
        memory: dict[str, Any] = {
            "peak_rss_bytes": rss,
            "model_bytes": 4 * num_params,
            "gradient_bytes": 4 * trainable,
            "optimizer_bytes": 4 * trainable,
            "worker_models": executor.models.built,
            "aggregator_bytes": aggregator,
            **residual_memory,
            **torch_memory(),
            "gpus": gpu_status(),
        }
        profile = build_profile(
            instrumentation.profiler.records,
            mode="sync" if isinstance(cfg.server, FedAvgServer) else "async",
            num_params=num_params,
            dense_bytes=codecs.HEADER.size + 4 * num_params,
            stragglers=cfg.diagnostics.stragglers,
            memory=memory,
            diagnostics=monitor.summary() if monitor is not None else None,
        )
        profile["alerts"] = alerts
        if summary.tiers:
            profile["communication"]["edge_tiers"] = dict(summary.tiers)
        profile["layers"] = list(layout.names) if layout is not None else []
        if layout is not None and self.weights is not None and layout.num_trainable <= self.weights.numel():
            parts = torch.split(self.weights[: layout.num_trainable], list(layout.lengths))
            profile["diagnostics"]["layer_weight_norms"] = {
                name: float(torch.linalg.vector_norm(part)) for name, part in zip(layout.names, parts, strict=True)
            }
        self.profile = profile
        log.info("profile", step=summary.versions, **headline(profile))
        for row in profile["time"]["per_version"]:
            log.debug("profile.version", step=int(row["version"]), **row)
        return replace(
            summary,
            stragglers=tuple(int(row["client_id"]) for row in profile["clients"]["stragglers"]),
            server_idle_fraction=float(profile["time"]["server_idle_fraction"]),
        )

    def _log_artifacts(self, tracker: tracking.Tracker, prepared: _Prepared, summary: RunSummary, log: Any) -> None:
        if isinstance(tracker, tracking.NullTracker):
            return
        tracker.log_dict(summary.to_dict(), "summary.json")
        if self.profile is not None:
            tracker.log_dict(_json_ready(self.profile), "profile.json")
            if self.config.diagnostics.plots:
                for name, image in render_plots(self.profile).items():
                    tracker.log_bytes(image, f"plots/{name}")
        if self._traces is not None:
            for path in self._traces.traces:
                tracker.log_file(path, "torch_profiler")
        if summary.alerts and self.profile is not None:
            tracker.set_tags({"alerts": ", ".join(f"{k}={v}" for k, v in sorted(self.profile["alerts"].items()))})
        config_text = yaml.safe_dump(self.config.model_dump(mode="json"), sort_keys=False)
        tracker.log_bytes(config_text.encode(), "config.yaml")
        assert self.weights is not None
        module = prepared.factory()
        offset = 0
        with torch.no_grad():
            for tensor in [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]:
                n = tensor.numel()
                tensor.copy_(self.weights[offset : offset + n].view_as(tensor))
                offset += n
        buffer = io.BytesIO()
        torch.save({"flat": self.weights, "state_dict": module.state_dict()}, buffer)
        tracker.log_bytes(buffer.getvalue(), "weights.pt")
        if self.config.tracking.log_model and isinstance(tracker, tracking.MlflowTracker):
            try:
                seconds = tracker.log_model(module)
                log.debug("tracking.log_model", seconds=seconds, metrics=False)
            except Exception as exc:  # a model MLflow cannot serialise must not fail the run
                log.warning("tracking.log_model_failed", error=f"{type(exc).__name__}: {exc}", metrics=False)


def _json_ready(value: Any) -> Any:
    """Return ``value`` with non-finite floats replaced by None (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    return value


class _CheckpointWriter:
    """Serialise and upload checkpoints on one background thread, in order; failures are logged, never raised."""

    def __init__(self, tracker: tracking.Tracker, config: RunConfig, log: Any) -> None:
        self._tracker = tracker
        self._config = config
        self._log = log
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self.last_saved: str | None = None

    def submit(self, state: dict[str, Any]) -> None:
        """Queue ``state`` for writing (returns at once: the event loop must not wait)."""
        if isinstance(self._tracker, tracking.NullTracker):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flasync-checkpoint")
        self._pending.append(self._pool.submit(self._write, state))

    def _write(self, state: dict[str, Any]) -> None:
        start = time.perf_counter()
        version = int(state["version"])
        try:
            data = checkpoint.encode(state, self._config)
            self._tracker.log_bytes(data, checkpoint.CHECKPOINT_ARTIFACT)
        except Exception as exc:  # a failing store must not take the run down
            self._log.warning("checkpoint.failed", version=version, error=f"{type(exc).__name__}: {exc}", metrics=False)
            return
        self.last_saved = checkpoint.CHECKPOINT_ARTIFACT
        self._log.debug(
            "checkpoint",
            step=version,
            bytes=len(data),
            seconds=time.perf_counter() - start,
            in_flight=len(state["registry"]["in_flight"]),
        )

    def close(self) -> None:
        """Wait for every queued checkpoint to be written."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _root_cause(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """Return the first error of a (nested) exception group that is not a cancellation."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _root_cause(error)
        if not isinstance(error, asyncio.CancelledError):
            return error
    return group.exceptions[0]


def run(config: RunConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> RunSummary:
    """Run a federation synchronously in a new event loop (uvloop when installed), for code without a loop.

    Args:
        config: As for :class:`Federation`.
        **kwargs: Passed to :class:`Federation`.
    """
    coro = Federation(config, **kwargs).run()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(coro)
    summary: RunSummary = uvloop.run(coro)
    return summary
