"""What a run is made of before it starts: data, partition, model, initial weights, device, tree, privacy plan."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from flasync.aggregation.privacy import (
    PrivacyAccountant,
    PrivacyPlan,
    calibrate_noise_multiplier,
    sampling_rate,
)
from flasync.clients.simulated.trace import DeviceTrace, read_trace
from flasync.config import (
    ByColumnPartition,
    FedAvgServer,
    FedBuffServer,
    FilesData,
    MLPModel,
    RunConfig,
    SmallCNNModel,
    SyntheticData,
    TreeTopology,
    validate,
)
from flasync.core import seeding
from flasync.core.errors import ConfigError, DataError
from flasync.data import (
    ArrayData,
    Partition,
    SyntheticClients,
    prepare,
)
from flasync.server.topology import Tree, build_tree
from flasync.training.exchange import Exchanged, LoraSpec, PartialFactory, apply_lora, exchanged_names
from flasync.training.executors.threads import resolve_device
from flasync.training.local import flat_layout, flat_parameters
from flasync.training.metrics import MetricSet, resolve_metrics
from flasync.training.models import MLP, SmallCNN

__all__ = [
    "ModelFactory",
    "Prepared",
    "RunInputs",
    "clients_in_flight",
    "plan_privacy",
]


ModelFactory = Callable[[], nn.Module]


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
    shapes: tuple[tuple[int, ...], ...] = ()
    """The shapes of the tensors of ``initial``, in order (:func:`flasync.training.local.flat_layout`)."""
    trace: DeviceTrace | None = None
    """The device trace ``population.trace`` names (None: none)."""
    metrics: MetricSet = field(default_factory=MetricSet)
    """The metrics ``eval.metrics`` adds to accuracy and loss, resolved against the data's classes."""
    held_out: Partition | None = None
    """Each client's samples held out for client-side evaluation (``eval.clients``; None: no split): ``partition``
    holds the rest."""


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

    def _initial_weights(
        self, factory: ModelFactory, sample: ArrayData
    ) -> tuple[ModelFactory, torch.Tensor, tuple[tuple[int, ...], ...]]:
        """Build the run's initial model; return the factory of its copies, its flat weights and their shapes.

        With a partial exchange (``model.exchange``, ``model.adapter``) the factory is a
        :class:`~flasync.training.exchange.PartialFactory` holding these initial weights, and the flat weights are
        the exchanged part's.
        """
        seed = seeding.stream_seed(self.config.seed, seeding.MODEL_INIT)
        spec = self.config.model
        adapter = None
        if spec.adapter is not None:
            adapter = LoraSpec(spec.adapter.r, spec.adapter.alpha, spec.adapter.target, spec.adapter.modules_to_save)
        try:
            # The factory's initialisers draw from torch's default generator: seed it for this call only.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                module = factory()
                if adapter is not None and isinstance(module, nn.Module):
                    module = apply_lora(module, adapter)  # its A matrices draw from the same seeded stream
        except ConfigError:
            raise
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
        if not spec.partial:
            return factory, flat_parameters(module), _shapes(module)
        names = exchanged_names(module, spec.exchange if spec.exchange is not None else "trainable")
        state = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
        partial = PartialFactory(factory, names, state, adapter)
        exchanged = Exchanged(module, names)
        return partial, flat_parameters(exchanged), _shapes(exchanged)

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
            ConfigError: If the model, the topology or a metric does not fit the data, or a user's metric cannot be
                imported.
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
            sizes = np.asarray(lazy.sizes, dtype=np.int64)  # no copy of a lazy source's int64 sizes
        else:
            partition = loaded.partition if loaded.partition is not None else prepare.partition(self.config, train)
            sizes = partition.sizes
        held_out = None
        share = self.config.eval.clients.held_out_share
        if share > 0.0:
            if lazy is not None:
                raise ConfigError("eval.clients: client-side evaluation needs data that is not lazy (data.lazy)")
            partition, held_out = partition.hold_out(share, seeding.numpy_stream(self.config.seed, seeding.CLIENT_EVAL))
            sizes = partition.sizes
        factory, initial, shapes = self._initial_weights(self._factory(train), train)
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
            None if self.config.model.partial else self._model_spec(train),
            shapes,
            read_trace(self.config.population.trace) if self.config.population.trace is not None else None,
            resolve_metrics(self.config.eval.metrics, num_classes=train.num_classes),
            held_out,
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


def _shapes(module: nn.Module) -> tuple[tuple[int, ...], ...]:
    """Return the shapes of the tensors of ``module``'s flat vector, in order."""
    layout = flat_layout(module)
    return tuple(tuple(t.shape) for _, t in [*layout.parameters, *layout.buffers])


def plan_privacy(config: RunConfig, num_clients: int) -> PrivacyPlan:
    """Resolve a run's differential privacy: its noise multiplier, sampling rate and accountant.

    A version holds at most ``clients_per_round`` (FedAvg; over-selected clients beyond it count too, since any of
    them may be in the round) or ``buffer_size`` (FedBuff) clients' updates.

    Raises:
        ConfigError: If no noise multiplier reaches ``privacy.target_epsilon``.
    """
    dp, server = config.privacy, config.server
    if isinstance(server, FedAvgServer):
        denominator, per_version = server.clients_per_round, clients_in_flight(config, num_clients)
    elif isinstance(server, FedBuffServer):
        denominator = per_version = server.buffer_size
    else:  # pragma: no cover - the config refuses privacy with FedAsync
        raise ConfigError("privacy.enabled needs server.kind = 'fedavg' or 'fedbuff'")
    windows = config.faults.availability is not None or config.population.trace is not None
    uniform = config.population.sampling == "uniform" and not windows
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


def clients_in_flight(config: RunConfig, num_clients: int) -> int:
    """Return the most tasks a run has out at once: a FedAvg round's clients with the over-selected ones (at most
    ``num_clients``), or an asynchronous server's concurrency."""
    server = config.server
    if isinstance(server, FedAvgServer):
        over = config.resilience.over_selection
        return min(num_clients, math.ceil((1.0 + over) * server.clients_per_round - 1e-9))
    return server.concurrency
