"""Assembly: a run's configuration becomes its components. The one module that switches on config unions.

Everything else receives built objects: an :class:`~flasync.aggregation.Aggregator`, a
:class:`~flasync.server.policies.Policy`, codecs, staleness and example weights, a server optimizer. Adding a
component kind means a config model and one branch here.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from flasync._version import __version__
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
    PrivacyAccountant,
    PrivacyPlan,
    calibrate_noise_multiplier,
    sampling_rate,
)
from flasync.clients.simulated.client import Client, ClientResiduals, ClientWorld, CohortClients
from flasync.clients.simulated.faults import FaultModel
from flasync.clients.simulated.population import Network, Population
from flasync.codecs.build import pipeline
from flasync.codecs.validation import UpdateValidator
from flasync.config import (
    AdagradServerOptimizer,
    AdamServerOptimizer,
    ByColumnPartition,
    ConstantStalenessConfig,
    FedAsyncServer,
    FedAvgServer,
    FedBuffServer,
    FilesData,
    HingeStalenessConfig,
    MLPModel,
    RunConfig,
    ServerConfig,
    ServerOptimizerConfig,
    SmallCNNModel,
    StalenessConfig,
    SyntheticData,
    TreeTopology,
    YogiServerOptimizer,
    validate,
)
from flasync.core import seeding
from flasync.core.bus import EventBus
from flasync.core.clock import Clock, RunClock
from flasync.core.errors import ConfigError, DataError
from flasync.data import (
    ArrayData,
    Partition,
    SyntheticClients,
    prepare,
)
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
from flasync.server.registry import StartTask
from flasync.server.sampler import Availability
from flasync.server.topology import Tree, build_tree
from flasync.training.cohort import unsupported_reason
from flasync.training.diagnostics import TrainingDiagnostics
from flasync.training.executors.ray import RayTrainingExecutor
from flasync.training.executors.threads import ThreadTrainingExecutor, TrainingExecutor, resolve_device
from flasync.training.jobs import ClientSamples, JobContext
from flasync.training.local import EvalResult, LocalObjective, LocalTraining, evaluate, flat_parameters, objective_name
from flasync.training.models import MLP, SmallCNN
from flasync.training.residuals import ResidualStore

__all__ = [
    "AggregatorFactory",
    "DatasetRecord",
    "ModelFactory",
    "Prepared",
    "RunInputs",
    "ServerParts",
    "build_server",
    "build_world",
    "check_objective",
    "custom_aggregator",
    "data_name",
    "dataset_record",
    "default_run_name",
    "make_aggregator",
    "make_evaluator",
    "make_example_weight",
    "make_executor",
    "make_server_optimizer",
    "make_staleness_weight",
    "rule_name",
    "run_mode",
    "run_tags",
    "topology_name",
]


ModelFactory = Callable[[], nn.Module]
AggregatorFactory = Callable[[torch.Tensor, ServerConfig], Aggregator]
"""Builds a server rule of your own from the global flat weights (to change in place) and the server config."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """What a run is made of before it starts: data, partition, model, initial weights, tree, device.

    ``config`` is the run's configuration as resolved against its data (``partition.kind = "by_column"`` takes
    ``population.num_clients`` from the data); ``files_sha256`` the digest of ``data.kind = "files"`` files.
    """

    train: ArrayData
    test: ArrayData
    partition: Partition
    factory: ModelFactory
    initial: torch.Tensor
    tree: Tree | None
    device: torch.device
    sizes: np.ndarray
    lazy: SyntheticClients | None
    config: RunConfig
    files_sha256: str | None = None
    privacy: PrivacyPlan | None = None
    model_spec: tuple[str, dict[str, Any]] | None = None
    """The model as :func:`flasync.training.models.build` rebuilds it (class name, arguments); None for a caller's
    factory."""


class RunInputs:
    """A run's configuration and what a caller gives besides it (data, model, client attributes).

    Args:
        config: The run's configuration.
        dataset: Training data instead of ``config.data``.
        test_dataset: Held-out data (default: a split of ``dataset``).
        model_factory: The model to train instead of ``config.model``.
        client_attributes: Per-client attribute arrays (``topology.assign = "attribute"``).
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
        test_dataset: ArrayData | torch.utils.data.Dataset[Any] | None = None,
        model_factory: ModelFactory | None = None,
        client_attributes: Mapping[str, Sequence[Any] | np.ndarray] | None = None,
    ) -> None:
        """Keep the inputs (nothing is loaded yet)."""
        self.config = config
        self._dataset = dataset
        self._test_dataset = test_dataset
        self._model_factory = model_factory
        self._client_attributes = dict(client_attributes or {})

    def _clients_from_data(self, count: int) -> RunConfig:
        """Return the config with ``population.num_clients = count`` (``by_column``), checking a value given."""
        cfg = self.config
        source = cfg.data
        assert isinstance(source, FilesData)  # by_column is validated to need a files source
        if "num_clients" in cfg.population.model_fields_set:
            if cfg.population.num_clients != count:
                raise ConfigError(
                    f"population.num_clients: {cfg.population.num_clients}, but data.client_column "
                    f"{source.client_column!r} of {source.train} gives {count} clients; set {count} or leave it unset"
                )
            return cfg
        data = cfg.model_dump(mode="json")  # the checkpoints' round trip
        data["population"]["num_clients"] = count
        try:
            return validate(data)
        except ConfigError as exc:
            raise ConfigError(
                f"{exc} (population.num_clients = {count}: the clients of data.client_column {source.client_column!r})"
            ) from None

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

    def _model_spec(self, train: ArrayData) -> tuple[str, dict[str, Any]] | None:
        """Return what :func:`flasync.training.models.build` needs to make the factory's model (None: a caller's
        factory)."""
        if self._model_factory is not None:
            return None
        model = self.config.model
        classes = train.num_classes
        if isinstance(model, MLPModel):
            features = int(np.prod(train.feature_shape))
            return "MLP", {"in_features": features, "hidden": list(model.hidden), "num_classes": classes}
        assert isinstance(model, SmallCNNModel)
        return "SmallCNN", {
            "in_channels": model.in_channels,
            "image_size": list(model.image_size),
            "num_classes": classes,
            "channels": list(model.channels),
        }

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

    def prepare(self) -> Prepared:
        """Load and check the data, partition it, build the model and the tree.

        Raises:
            ConfigError: If the model or the topology does not fit the data.
            DataError: If the data set cannot be used.
        """
        device = self._device()
        loaded = prepare.load(self.config, self._dataset, self._test_dataset)
        train, test = loaded.train, loaded.test
        if loaded.partition is not None:
            self.config = self._clients_from_data(len(loaded.partition))
        elif isinstance(self.config.partition, ByColumnPartition):
            raise ConfigError("partition.kind: 'by_column' needs data.kind = 'files'; a given data set has no clients")
        if len(test) == 0:
            raise DataError("the held-out split is empty")
        if test.num_classes != train.num_classes or test.feature_shape != train.feature_shape:
            raise DataError("test data must have the training data's feature shape and classes")
        lazy = None
        if isinstance(self.config.data, SyntheticData) and self.config.data.lazy:
            if self._dataset is not None:
                raise ConfigError("data.lazy: a lazy synthetic source cannot be combined with a given dataset")
            lazy = prepare.lazy_clients(self.config)
            partition = Partition(np.zeros(0, dtype=np.int64), np.zeros(len(lazy) + 1, dtype=np.int64))
            sizes = lazy.sizes.astype(np.int64)
        else:
            partition = loaded.partition if loaded.partition is not None else prepare.partition(self.config, train)
            sizes = partition.sizes
        factory = self._factory(train)
        initial = self._initial_weights(factory, train)
        tree = self._tree()
        privacy = plan_privacy(self.config, len(sizes)) if self.config.privacy.enabled else None
        return Prepared(
            train,
            test,
            partition,
            factory,
            initial,
            tree,
            device,
            sizes,
            lazy,
            self.config,
            loaded.files_sha256,
            privacy,
            self._model_spec(train),
        )

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
    """
    upload_codec = pipeline(config.codec.upload)
    residuals: ResidualStore | None = None
    if upload_codec.error_feedback:
        spill = config.codec.residual_dir or scratch()
        residuals = ResidualStore(
            prepared.initial.numel(), max_in_memory=config.codec.max_residuals_in_memory, spill_dir=spill
        )
    variates: ResidualStore | None = None
    if config.scaffold.enabled:
        variates = ResidualStore(
            prepared.initial.numel(),
            max_in_memory=config.scaffold.max_in_memory,
            spill_dir=config.scaffold.spill_dir or scratch(),
        )
    device = prepared.device
    # Data, weights and the aggregation buffers (which follow the weights) live on the training device.
    data_device = device if config.executor.data_on_device else torch.device("cpu")
    train_x, train_y = prepared.train.x.to(data_device), prepared.train.y.to(data_device)
    if device.type == "cuda" and not config.executor.data_on_device:
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
        local=LocalTraining(**config.client.model_dump(), objective=objective),
        upload_codec=upload_codec,
        num_params=prepared.initial.numel(),
        residuals=residuals,
        residual_lock=threading.Lock(),
        diagnostics=diagnostics,
        wall=wall,
        variates=variates,
    )
    population = config.population
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
        ),
        network=Network(config.network, population.num_clients, config.seed),
        faults=FaultModel(config.faults, config.seed, population.num_clients),
        samples=samples,
        pool=executor.pool,
        job=job,
        pre_task_residuals={} if residuals is not None else None,
        pre_task_variates={} if variates is not None else None,
    )


def make_evaluator(prepared: Prepared, executor: TrainingExecutor, clock: Clock, *, batch_size: int) -> Evaluator:
    """Return the server's evaluator: the held-out split on the device, evaluated in the executor."""
    device = prepared.device
    test_x, test_y = prepared.test.x.to(device), prepared.test.y.to(device)

    async def evaluate_weights(flat: torch.Tensor) -> EvalResult | None:
        if test_y.numel() == 0:
            return None
        return await clock.run(
            executor.pool,
            lambda: evaluate(executor.models.get(), flat, test_x, test_y, batch_size=batch_size),
            simulated_s=0.0,
        )

    return evaluate_weights


def make_executor(
    config: RunConfig,
    prepared: Prepared,
    *,
    on_fallback: Callable[[str], None] | None = None,
    on_event: Callable[[str, str], None] | None = None,
    objective: LocalObjective | None = None,
) -> TrainingExecutor:
    """Build the executor a run's training jobs run in (threads, vectorized cohorts on the threads, or Ray actors).

    ``auto`` picks threads or vectorized cohorts (:func:`choose_executor`) and tells ``on_event("auto", why)``.

    Raises:
        ConfigError: If Ray is asked for and cannot start or be reached.
    """
    executor = config.executor
    kind = executor.kind
    if kind == "auto":
        kind, why = choose_executor(config, prepared, objective)
        if on_event is not None:
            on_event("auto", f"{kind}: {why}")
    if kind == "ray":
        return RayTrainingExecutor(
            prepared.factory,
            executor.ray,
            device=prepared.device,
            on_fallback=on_fallback,
            on_event=on_event,
            lazy=prepared.lazy,
        )
    workers = executor.workers
    if workers is None:
        workers, why = default_workers(
            kind,
            prepared.device,
            cores=_cores(),
            num_params=prepared.initial.numel(),
            max_cohort=executor.max_cohort,
            available_bytes=_available_memory(),
        )
        if on_event is not None and workers > 1:
            on_event("workers", f"{workers} training threads: {why}")
    return ThreadTrainingExecutor(
        prepared.factory,
        workers=workers,
        threads_per_worker=executor.threads_per_worker,
        vectorized=kind == "vectorized",
        max_cohort=executor.max_cohort,
        device=prepared.device,
        on_fallback=on_fallback,
    )


AUTO_MAX_WORKERS = 4
"""Most training threads an unset ``executor.workers`` gives vectorized cohorts on the CPU (one per core up to it)."""

# Bytes a cohort member's training holds per parameter: its weights, gradients and momentum in float32.
_COHORT_BYTES_PER_PARAM = 12


def default_workers(
    kind: str,
    device: torch.device,
    *,
    cores: int,
    num_params: int,
    max_cohort: int,
    available_bytes: int | None,
) -> tuple[int, str]:
    """Return the training threads of an executor whose ``executor.workers`` is unset, and why.

    Vectorized cohorts on the CPU get one thread per core, at most :data:`AUTO_MAX_WORKERS`: a round larger than
    ``max_cohort`` trains as several cohorts, and each thread trains one at a time on its own core (the weights do not
    depend on the number of threads). Cohorts training at once each hold their members' weights, gradients and
    momentum, so there are no more threads than full cohorts fit in half of ``available_bytes`` (None: unknown).
    Threads that train one client at a time, and cohorts on a GPU, get one: a small model's step is Python, which
    the threads would take turns at.
    """
    if kind != "vectorized" or device.type != "cpu":
        return 1, "one training thread"
    workers = max(1, min(cores, AUTO_MAX_WORKERS))
    why = f"one per core ({cores}, at most {AUTO_MAX_WORKERS}) for vectorized cohorts"
    if available_bytes is not None:
        cohort_bytes = _COHORT_BYTES_PER_PARAM * num_params * max_cohort
        fit = max(1, available_bytes // (2 * max(cohort_bytes, 1)))
        if fit < workers:
            workers = fit
            why = f"as many cohorts of {max_cohort} as half the free memory holds"
    return workers, why


def _cores() -> int:
    """Return the CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _available_memory() -> int | None:
    """Return the bytes of memory available to new allocations (None where the OS does not say)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


AUTO_MIN_COHORT = 32
"""Smallest FedAvg round ``executor.kind = "auto"`` trains as one vectorized cohort (the tutorial MLP on 2 cores:
vectorized 1.45x the threads at 50 clients per round, 1.9x at 100, 2.4x at 500)."""

AUTO_MIN_CONCURRENCY = 48
"""Fewest clients in flight for which ``executor.kind = "auto"`` trains an asynchronous server's clients as cohorts
when the model is batched through ``vmap``. A cohort is every client dispatched since the last one started (at any
model version), about a quarter to a third of the concurrency on the tutorial workload; through ``vmap``, small
cohorts gain little or nothing (0.84x the threads at concurrency 20, measured on 2 cores)."""

AUTO_MIN_CONCURRENCY_OWN = 16
"""The same for a model with its own ``cohort_forward`` (the built-in MLP), whose small cohorts pay: FedBuff on the
tutorial workload, vectorized against threads, whole-call updates/s on 2 idle cores, was 1.67x at concurrency 10,
1.92x at 16 and 1.93-2.04x at 20 (``benchmarks/matrix.py --concurrency 10 16 20``); the default run (digits,
C = 20) trains 1.5x faster."""


def choose_executor(
    config: RunConfig, prepared: Prepared, objective: LocalObjective | None = None
) -> tuple[Literal["thread", "vectorized"], str]:
    """Return the executor ``executor.kind = "auto"`` runs, and why.

    Vectorized cohorts pay when many clients train at once: FedAvg rounds of at least :data:`AUTO_MIN_COHORT`
    clients, or FedBuff / FedAsync with at least :data:`AUTO_MIN_CONCURRENCY` clients in flight
    (:data:`AUTO_MIN_CONCURRENCY_OWN` for a model with its own ``cohort_forward``), on a flat topology, with a model
    and objective ``vmap`` can batch and no gradient checkpointing. On an accelerator (``prepared.device`` not the
    CPU) two clients a round or in flight are enough: there one client at a time is bound by kernel launches (on an
    H200 the tutorial MLP trained 118-159 clients/s one at a time, slower than one CPU core), which a cohort makes
    once for all its members. Everything else trains on the threads.
    """
    server = config.server
    if isinstance(config.topology, TreeTopology):
        return "thread", "edges start their rounds apart: cohorts would be small"
    # On an accelerator one client's step is a few launches of small kernels, and a cohort's step the same launches
    # for all its members: cohorts pay from two members on (the sizes below were measured on CPU cores).
    on_cpu = prepared.device.type == "cpu"
    least_round = AUTO_MIN_COHORT if on_cpu else 2
    if isinstance(server, FedAvgServer) and server.clients_per_round < least_round:
        return "thread", f"rounds of {server.clients_per_round} clients (< {least_round}) gain nothing from cohorts"
    model = prepared.factory()
    where = "" if on_cpu else f" on {prepared.device.type}"
    if isinstance(server, FedAvgServer):
        why = f"FedAvg rounds of {server.clients_per_round} clients{where}: one cohort each"
    else:
        own = callable(getattr(model, "cohort_forward", None))
        least = (AUTO_MIN_CONCURRENCY_OWN if own else AUTO_MIN_CONCURRENCY) if on_cpu else 2
        if server.concurrency < least:
            how = ("its own cohort_forward" if own else "vmap") if on_cpu else prepared.device.type
            return "thread", f"{server.kind} with {server.concurrency} clients in flight (< {least} for {how})"
        why = f"{server.kind} with {server.concurrency} clients in flight{where}: cohorts of those sent together"
    if config.client.checkpoint_segments:
        return "thread", "gradient checkpointing trains one client at a time"
    reason = unsupported_reason(model)
    if reason is not None:
        return "thread", reason
    if objective is not None and not objective.vectorizable:
        return "thread", f"the objective {objective_name(objective)} is not vectorizable"
    return "vectorized", why


def topology_name(config: RunConfig) -> str:
    """Return a short name of the run's topology (``flat``, ``tree(10x4)``, ``tree(3 edges)``)."""
    topology = config.topology
    if not isinstance(topology, TreeTopology):
        return "flat"
    if topology.edges:
        return f"tree({len(topology.edges)} edges)"
    return "tree(" + "x".join(str(f) for f in topology.fanout) + ")"


def run_mode(config: RunConfig) -> str:
    """Return ``sync`` for round-based servers and ``async`` for the others."""
    return "sync" if isinstance(config.server, FedAvgServer) else "async"


@dataclass(frozen=True, slots=True)
class DatasetRecord:
    """How a run's training data is recorded in MLflow (a dataset input): name, digest, source and profile."""

    name: str
    digest: str
    source: str
    profile: dict[str, Any]


_HASHED_BYTES = 256 * 2**20  # larger data sets are digested from evenly spaced rows


def dataset_record(config: RunConfig, prepared: Prepared, *, custom: bool) -> DatasetRecord:
    """Describe the run's training data for tracking: a content digest, where it came from, and its sizes.

    The digest is the sha256 (first 16 hex digits) of the training features and labels, of evenly spaced rows when
    they exceed 256 MiB, and of the data config for lazily drawn clients (nothing is held to hash). Data read from
    files (``data.kind = "files"``) is named after the training file's stem and digested from the files' bytes
    (training file, then test file), so ``sha256sum train.csv`` shows the same digits when no test file is named.

    Args:
        config: The run's configuration.
        prepared: What the run is made of.
        custom: The data came from the Python API (a user's data set) rather than ``config.data``.
    """
    train = prepared.train
    source = data_name(config, custom=custom)
    if isinstance(config.data, FilesData) and not custom and prepared.files_sha256 is not None:
        files = [config.data.train] + ([config.data.test] if config.data.test is not None else [])
        digest, where = prepared.files_sha256, ", ".join(files)
    else:
        hashed = hashlib.sha256()
        if prepared.lazy is not None:
            hashed.update(config.data.model_dump_json().encode())
        else:
            step = max(1, math.ceil((train.x.nbytes + train.y.nbytes) / _HASHED_BYTES))
            hashed.update(repr((tuple(train.x.shape), train.num_classes, step)).encode())
            hashed.update(train.x[::step].cpu().contiguous().numpy().tobytes())
            hashed.update(train.y[::step].cpu().contiguous().numpy().tobytes())
        digest = hashed.hexdigest()
        where = {
            "custom": "a data set given to flasync.Federation",
            "digits": "sklearn.datasets.load_digits",
            "synthetic": f"flasync synthetic data, seed {config.seed}",
        }.get(source, source)
    partition = config.partition.model_dump(mode="json")
    return DatasetRecord(
        name=source,
        digest=digest[:16],
        source=where,
        profile={
            "rows": int(prepared.sizes.sum()),
            "test_rows": int(prepared.test.x.shape[0]),
            "features": int(math.prod(train.x.shape[1:])),
            "classes": int(train.num_classes),
            "clients": len(prepared.sizes),
            "partition": ", ".join(f"{k}={v}" for k, v in partition.items()),
        },
    )


def data_name(config: RunConfig, *, custom: bool = False) -> str:
    """Name the run's data: ``custom`` (given in Python), the training file's stem (``data.kind = "files"``), or
    the data kind (``digits``, ``synthetic``)."""
    if custom:
        return "custom"
    if isinstance(config.data, FilesData):
        return Path(config.data.train).stem
    return config.data.kind


def default_run_name(config: RunConfig, suffix: str, *, custom: bool = False) -> str:
    """A run name that says what ran: ``<aggregator>-<data>-seed<seed>-<suffix>`` (``suffix`` tells reruns apart;
    the data is named by :func:`data_name`)."""
    return f"{config.server.kind}-{data_name(config, custom=custom)}-seed{config.seed}-{suffix}"


def run_tags(config: RunConfig, *, virtual_clock: bool) -> dict[str, str]:
    """Return the tracking tags of a run: flasync version, aggregator, mode, clock, topology, seed."""
    return {
        "flasync.version": __version__,
        "aggregator": config.server.kind,
        "mode": run_mode(config),
        "clock": "virtual" if virtual_clock else "wall",
        "topology": topology_name(config),
        "seed": str(config.seed),
    }


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


def _staleness_of(config: ServerConfig) -> StalenessWeight:
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
            privacy=noise,
        )
    if isinstance(config, FedBuffServer):
        return BufferedAggregator(
            weights,
            size=config.buffer_size,
            optimizer=make_server_optimizer(weights, config.optimizer),
            staleness=make_staleness_weight(config.staleness),
            example_weight=make_example_weight(config),
            privacy=noise,
        )
    return MixingAggregator(weights, alpha=config.alpha, staleness=make_staleness_weight(config.staleness))


def plan_privacy(config: RunConfig, num_clients: int) -> PrivacyPlan:
    """Resolve a run's differential privacy: its noise multiplier, sampling rate and accountant.

    A version holds at most ``clients_per_round`` (FedAvg; over-selected clients beyond it count too, since any of
    them may be in the round) or ``buffer_size`` (FedBuff) clients' updates.

    Raises:
        ConfigError: If no noise multiplier reaches ``privacy.target_epsilon``.
    """
    dp, server = config.privacy, config.server
    if isinstance(server, FedAvgServer):
        denominator, per_version = server.clients_per_round, _in_flight(config, num_clients)
    elif isinstance(server, FedBuffServer):
        denominator = per_version = server.buffer_size
    else:  # pragma: no cover - the config refuses privacy with FedAsync
        raise ConfigError("privacy.enabled needs server.kind = 'fedavg' or 'fedbuff'")
    uniform = config.population.sampling == "uniform" and config.faults.availability is None
    rate = sampling_rate(per_version=per_version, num_clients=num_clients, uniform=uniform)
    z = dp.noise_multiplier
    if z is None:
        assert dp.target_epsilon is not None  # the config asks for one of the two
        z = calibrate_noise_multiplier(
            target_epsilon=dp.target_epsilon, delta=dp.delta, sampling_rate=rate, versions=config.stop.max_versions
        )
    accountant = PrivacyAccountant(noise_multiplier=z, sampling_rate=rate, delta=dp.delta)
    return PrivacyPlan(
        clip_norm=dp.clip_norm, noise_multiplier=z, sampling_rate=rate, denominator=denominator, accountant=accountant
    )


_AGGREGATOR_MEMBERS = ("add", "add_partial", "ready", "step", "count", "nbytes", "state_dict", "load_state_dict")


def rule_name(rule: object) -> str:
    """Return what a user's factory or rule is called in tags and messages (a function's or a class's name)."""
    name = getattr(rule, "__qualname__", None)
    return name if isinstance(name, str) else objective_name(rule)


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


def _in_flight(config: RunConfig, num_clients: int) -> int:
    server = config.server
    if isinstance(server, FedAvgServer):
        over = config.resilience.over_selection
        return min(num_clients, math.ceil((1.0 + over) * server.clients_per_round - 1e-9))
    return server.concurrency


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
        staleness=_staleness_of(config.server),
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
    start_task: StartTask | None = None,
    availability: Availability | None = None,
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
        start_task: How a task reaches its client instead of an in-process client coroutine (e.g. a remote
            transport's :meth:`~flasync.clients.remote.transport.RemoteTransport.start_task`).
        availability: Who can take a task now, instead of the failure model's windows (e.g. the remote transport:
            the devices connected now).
    """
    server_cfg, res = config.server, config.resilience
    num_params = weights.numel()
    in_flight = _in_flight(config, len(population))
    # Every task of several waves failing means the model or data is broken, not an unlucky client. Only
    # genuine training errors count: injected faults, dropouts and timeouts never do.
    # A server that refuses every update for many waves of tasks cannot make progress: it ends the run with the
    # refusal reasons instead of training for ever.
    accounting = Accounting(failure_limit=max(3 * in_flight, 30), rejection_limit=max(20 * in_flight, 200))
    # Simulated clients that never crash, hang, drop out or go offline answer on timelines known at dispatch: the
    # tasks dispatched together run in one coroutine (such a fault decides per task whether and when it answers).
    group = (
        CohortClients(world, live=lambda task: registry.holds(task))
        if start_task is None and (world.faults is None or not world.faults.active) and clock.virtual
        else None
    )
    registry = TaskRegistry(
        bus=bus,
        clock=clock,
        accounting=accounting,
        num_clients=len(population),
        start_task=start_task or (lambda task, snapshot: Client(task.client_id, world).run(task, snapshot)),
        timeout_s=res.task_timeout_s,
        mark_used=population.mark_used,
        on_release=world.forget,
        start_group=group.run if group is not None else None,
    )
    if availability is None and world.faults is not None and world.faults.config.availability is not None:
        availability = world.faults
    sampler = ClientSampler(
        population, config.population.sampling, seeding.numpy_stream(config.seed, seeding.SERVER), availability
    )
    max_staleness = server_cfg.max_staleness if isinstance(server_cfg, FedBuffServer | FedAsyncServer) else None
    upload_codec = world.job.upload_codec
    clip_norm = res.clip_update_norm
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
                norm_bound_factor=res.norm_bound_factor,
            ),
            max_staleness=max_staleness,
            clip_norm=clip_norm,
            wall=wall,
            controls=config.scaffold.enabled,
            one_per_client=privacy is not None,
        )

    edge_codec = pipeline(config.topology.codec if isinstance(config.topology, TreeTopology) else ())
    edges = None
    if tree is not None and isinstance(config.topology, TreeTopology):
        edges = EdgeNetwork(
            tree,
            _edge_settings(config, config.topology),
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
    if aggregator_factory is None:
        aggregator = make_aggregator(weights, server_cfg, noise)
    else:
        aggregator = custom_aggregator(aggregator_factory, weights, server_cfg)
    controls = (
        ControlVariate(num_params, num_clients=len(population), device=weights.device)
        if config.scaffold.enabled
        else None
    )
    policy = _make_policy(config, aggregator, registry, sampler, accounting, edges, bus=bus, clock=clock, log=log)
    if group is not None:
        group.together = not policy.abandons and registry.timeout_s is None
        # A round that closes on its last answer, straight to the cloud, does nothing between its uploads but fold
        # them in: those due at several times may reach it together.
        group.gather = group.together and policy.rounds and tree is None
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
        components={
            "clock": clock,
            "residuals": ClientResiduals(world, lambda: iter(registry)),
            **({"variates": ClientResiduals(world, lambda: iter(registry), variates=True)} if controls else {}),
        },
        privacy=privacy.accountant if privacy is not None else None,
        controls=controls,
    )
    return ServerParts(server=server, edges=edges)
