"""Typed run configuration: pydantic models, file loading and ``--set`` overrides.

Every component is chosen by a discriminated union on ``kind``; every model forbids unknown keys, so a typo is an
error that names the field. :func:`load_config` turns a TOML or YAML file plus ``path.to.field=value`` overrides
into a validated :class:`RunConfig` or raises :class:`~flasync.core.errors.ConfigError` with a one-line message.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flasync.core.errors import ConfigError

__all__ = [
    "FILE_FORMATS",
    "AdamServerOptimizer",
    "AvailabilityConfig",
    "BFloat16Stage",
    "ByColumnPartition",
    "CheckpointConfig",
    "ClientConfig",
    "CodecConfig",
    "ConstantSpeed",
    "ConstantStalenessConfig",
    "DiagnosticsConfig",
    "DigitsData",
    "DirichletPartition",
    "EdgeLinkConfig",
    "EdgeSpec",
    "EvalConfig",
    "ExecutorConfig",
    "FaultsConfig",
    "FedAsyncServer",
    "FedAvgServer",
    "FedBuffServer",
    "FilesData",
    "FlatTopology",
    "Float16Stage",
    "HalfNormalSpeed",
    "HingeStalenessConfig",
    "IIDPartition",
    "Int8Stage",
    "LogNormalSpeed",
    "MLPModel",
    "NetworkConfig",
    "PolynomialStalenessConfig",
    "PopulationConfig",
    "PrivacyConfig",
    "RandomKStage",
    "RayConfig",
    "RemoteConfig",
    "ResilienceConfig",
    "RunConfig",
    "SGDServerOptimizer",
    "ScaffoldConfig",
    "ShardsPartition",
    "SmallCNNModel",
    "StopConfig",
    "SyntheticData",
    "TopKStage",
    "TrackingConfig",
    "TreeTopology",
    "apply_override",
    "flatten",
    "format_validation_error",
    "load_config",
]


SamplingStrategy = Literal["uniform", "weighted", "lru", "available"]
"""How the server draws clients: uniformly, weighted by samples, least recently used, or among those online."""
SAMPLING_STRATEGIES: tuple[SamplingStrategy, ...] = ("uniform", "weighted", "lru", "available")


class _Section(BaseModel):
    # Infinity and NaN are refused wherever a number is read (a bandwidth may be infinite: an instant link).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _default_kinds(cls, data: Any) -> Any:
        """Give a partial component table the default component's ``kind`` (``--set model.hidden=[32]``)."""
        if not isinstance(data, Mapping):
            return data
        filled: dict[str, Any] | None = None
        for name, info in cls.model_fields.items():
            value = data.get(name)
            default = info.default
            if isinstance(value, Mapping) and "kind" not in value and isinstance(default, BaseModel):
                kind = getattr(default, "kind", None)
                if kind is not None:
                    filled = filled if filled is not None else dict(data)
                    filled[name] = {"kind": kind, **value}
        return data if filled is None else filled


# --------------------------------------------------------------------------------------------------------- data
class DigitsData(_Section):
    """scikit-learn's handwritten digits: 1797 images of 8x8 pixels, 10 classes, shipped with the package."""

    kind: Literal["digits"] = "digits"
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Held-out share, stratified by label.")


class SyntheticData(_Section):
    """The tutorials' generator: ``x ~ N(0, 1)``, ``y`` uniform, ``x[y mod d] += 2``."""

    kind: Literal["synthetic"] = "synthetic"
    samples_per_client: int = Field(200, ge=1, le=10_000_000, description="Training samples generated per client.")
    num_features: int = Field(32, ge=1, le=1_000_000)
    num_classes: int = Field(10, ge=2, le=1_000_000)
    test_samples: int = Field(2000, ge=1, le=10_000_000)
    lazy: bool = Field(
        False,
        description="Draw each client's samples when it is sampled, from its own stream (for millions of clients; "
        "every client holds samples_per_client, so the partition is ignored).",
    )


FILE_FORMATS = (".npz", ".pt", ".csv", ".parquet")
"""The file suffixes ``data.kind = "files"`` reads (the format follows from the suffix, case-insensitively)."""


class FilesData(_Section):
    """Your own data, read from a ``.npz``, ``.pt``, ``.csv`` or ``.parquet`` file.

    Arrays (``.npz``, ``.pt``): ``features`` names one array of shape ``(N, ...)``, ``label`` one of shape ``(N,)``,
    ``client_column`` (if set) one of shape ``(N,)``. Tables (``.csv`` with a header row, ``.parquet``): ``features``
    lists feature columns (default: every column but the label and client columns). Features become float32, labels
    are integer class ids or (tables and ``.npz``) text mapped to ids in sorted order. A relative path in a config
    file is read from that file's folder; one given by ``--set`` or in Python, from the working directory.
    """

    kind: Literal["files"] = "files"
    train: str = Field(min_length=1, description="Training data: a .npz, .pt, .csv or .parquet file.")
    test: str | None = Field(
        None, min_length=1, description="Held-out data in the same layout (default: a test_fraction split of train)."
    )
    test_fraction: float = Field(
        0.2,
        gt=0.0,
        lt=1.0,
        description="Held-out share when test is unset: stratified by label, or by client with by_column.",
    )
    features: tuple[str, ...] | None = Field(
        None,
        description="Arrays: the one feature key (default 'x'); tables: the feature columns (default: all others).",
    )
    label: str = Field("y", min_length=1, description="The label key or column.")
    client_column: str | None = Field(
        None, min_length=1, description="The key or column naming each sample's client (user, device) for by_column."
    )
    num_classes: int | None = Field(None, ge=2, le=1_000_000, description="Default: inferred from the labels.")

    @field_validator("features", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_files(self) -> FilesData:
        for name in ("train", "test"):
            path: str | None = getattr(self, name)
            if path is not None and Path(path).suffix.lower() not in FILE_FORMATS:
                raise _FieldError(("data", name), f"unsupported format of {path!r} (use {', '.join(FILE_FORMATS)})")
        if self.test is not None and self.test_fraction != FilesData.model_fields["test_fraction"].default:
            raise _FieldError(("data", "test_fraction"), "is not used when data.test is set; remove one of them")
        if self.features is not None:
            if not self.features or any(not name for name in self.features):
                raise _FieldError(("data", "features"), "must name at least one key or column, none empty")
            arrays = [p for p in (self.train, self.test) if p and Path(p).suffix.lower() in (".npz", ".pt")]
            if arrays and len(self.features) != 1:
                raise _FieldError(("data", "features"), f"{arrays[0]!r} holds its features in one array; name one key")
            for column in (self.label, self.client_column):
                if column in self.features:
                    raise _FieldError(("data", "features"), f"{column!r} is the label or client column")
        if self.client_column is not None and self.client_column == self.label:
            raise _FieldError(("data", "client_column"), f"{self.label!r} is already the label")
        return self


DataSource = Annotated[DigitsData | SyntheticData | FilesData, Field(discriminator="kind")]


class IIDPartition(_Section):
    """Shuffle and deal samples evenly."""

    kind: Literal["iid"] = "iid"


class DirichletPartition(_Section):
    """Per-label Dirichlet(alpha) proportions over clients (Hsu et al. 2019); small alpha = more skew."""

    kind: Literal["dirichlet"] = "dirichlet"
    alpha: float = Field(0.5, gt=0.0)
    min_samples: int = Field(1, ge=1)


class ShardsPartition(_Section):
    """Sort by label, cut into shards, deal ``shards_per_client`` to each client (McMahan et al. 2017)."""

    kind: Literal["shards"] = "shards"
    shards_per_client: int = Field(2, ge=1)


class ByColumnPartition(_Section):
    """The data's natural partition: one client per distinct value of ``data.client_column`` (a user, a device).

    Clients are numbered in sorted order of those values and keep their samples in file order. The population size
    is the number of clients kept: leave ``population.num_clients`` unset, or set it to that number.
    """

    kind: Literal["by_column"] = "by_column"
    min_samples: int = Field(
        1, ge=1, description="Drop clients with fewer training samples (their samples go unused), as LEAF does."
    )


PartitionConfig = Annotated[
    IIDPartition | DirichletPartition | ShardsPartition | ByColumnPartition, Field(discriminator="kind")
]


# ------------------------------------------------------------------------------------------------------- models
class MLPModel(_Section):
    """Fully connected ReLU network."""

    kind: Literal["mlp"] = "mlp"
    hidden: tuple[int, ...] = Field((64,), description="Widths of the hidden layers.")

    @model_validator(mode="after")
    def _positive(self) -> MLPModel:
        if any(h < 1 for h in self.hidden):
            raise ValueError("hidden widths must be >= 1")
        return self


class SmallCNNModel(_Section):
    """Two conv layers and a linear head; flat inputs are reshaped to ``(C, H, W)``."""

    kind: Literal["cnn"] = "cnn"
    in_channels: int = Field(1, ge=1)
    image_size: tuple[int, int] = (8, 8)
    channels: tuple[int, int] = (16, 32)


ModelConfig = Annotated[MLPModel | SmallCNNModel, Field(discriminator="kind")]


# ----------------------------------------------------------------------------------------------- population/time
class ConstantSpeed(_Section):
    """Every client takes ``seconds_per_step`` simulated seconds per local step."""

    kind: Literal["constant"] = "constant"
    seconds_per_step: float = Field(0.05, gt=0.0)


class LogNormalSpeed(_Section):
    """Each client is slower by a fixed factor ``exp(N(0, sigma))`` drawn once per client (heavy-tailed stragglers).

    ``jitter`` adds a per-task factor ``exp(N(0, jitter))`` on top.
    """

    kind: Literal["lognormal"] = "lognormal"
    seconds_per_step: float = Field(0.05, gt=0.0)
    sigma: float = Field(1.0, ge=0.0)
    jitter: float = Field(0.1, ge=0.0)


class HalfNormalSpeed(_Section):
    """Each task takes ``steps * seconds_per_step * (1 + |N(0, sigma)|)`` (the FedBuff paper's timing model)."""

    kind: Literal["halfnormal"] = "halfnormal"
    seconds_per_step: float = Field(0.05, gt=0.0)
    sigma: float = Field(1.0, ge=0.0)


SpeedConfig = Annotated[ConstantSpeed | LogNormalSpeed | HalfNormalSpeed, Field(discriminator="kind")]


class PopulationConfig(_Section):
    """Who the clients are and how fast they compute."""

    num_clients: int = Field(100, ge=1, le=100_000_000)
    speed: SpeedConfig = LogNormalSpeed()
    regions: int | None = Field(
        None, ge=1, description="Give each client a seeded uniform 'region' attribute in 0..regions-1."
    )
    sampling: SamplingStrategy = Field(
        "uniform",
        description="How the server picks clients: uniform, weighted by samples, least recently used, available now.",
    )
    available_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="Share of its availability period a client is online (1: always)."
    )
    availability_period_s: float = Field(86_400.0, gt=0.0, description="Simulated seconds of one on/off cycle.")
    slow_clients: dict[int, float] = Field(
        default_factory=dict,
        description="Fixed slowdown factors of named clients (client id -> factor), on top of the speed model.",
    )

    @model_validator(mode="after")
    def _check_slow_clients(self) -> PopulationConfig:
        for client_id, factor in self.slow_clients.items():
            if not 0 <= client_id < self.num_clients:
                raise _FieldError(
                    ("population", "slow_clients"), f"client {client_id} is not in 0..{self.num_clients - 1}"
                )
            if not (math.isfinite(factor) and factor > 0):
                raise _FieldError(("population", "slow_clients"), f"factor of client {client_id} must be > 0")
        return self


class NetworkConfig(_Section):
    """Simulated links: transfer time is ``latency + bytes / bandwidth`` on the virtual clock.

    Each client's latency and bandwidths are the configured medians times ``exp(N(0, sigma))``, drawn once per client
    from the run's seed (``sigma = 0``: every client has the medians).
    """

    latency_s: float = Field(0.05, ge=0.0, description="Median one-way latency.")
    upload_bytes_per_s: float = Field(
        1.25e6, gt=0.0, allow_inf_nan=True, description="Median client uplink (default 10 Mbit/s)."
    )
    download_bytes_per_s: float = Field(
        5.0e6, gt=0.0, allow_inf_nan=True, description="Median client downlink (default 40 Mbit/s)."
    )
    latency_sigma: float = Field(0.0, ge=0.0, le=5.0, description="Log-space spread of latency across clients.")
    bandwidth_sigma: float = Field(0.0, ge=0.0, le=5.0, description="Log-space spread of bandwidth across clients.")


class Float16Stage(_Section):
    """Values as IEEE half precision."""

    kind: Literal["fp16"] = "fp16"


class BFloat16Stage(_Section):
    """Values as bfloat16."""

    kind: Literal["bf16"] = "bf16"


class Int8Stage(_Section):
    """Values as int8 with a float32 scale per tensor (``chunk`` unset) or per chunk; stochastic rounding."""

    kind: Literal["int8"] = "int8"
    chunk: int | None = Field(None, ge=1)
    stochastic: bool = True


class TopKStage(_Section):
    """Keep the ``ratio`` largest-magnitude values; the rest goes to the client's error-feedback residual."""

    kind: Literal["topk"] = "topk"
    ratio: float = Field(0.01, gt=0.0, le=1.0)
    error_feedback: bool = True


class RandomKStage(_Section):
    """Keep a random ``ratio`` of the values."""

    kind: Literal["randomk"] = "randomk"
    ratio: float = Field(0.01, gt=0.0, le=1.0)
    error_feedback: bool = True


CodecStage = Annotated[Float16Stage | BFloat16Stage | Int8Stage | TopKStage | RandomKStage, Field(discriminator="kind")]
_SPARSIFIERS = (TopKStage, RandomKStage)
_VALUE_ENCODERS = (Float16Stage, BFloat16Stage, Int8Stage)


class CodecConfig(_Section):
    """What crosses the wire: a pipeline of stages per direction (empty = dense float32, lossless).

    An upload pipeline is at most one sparsifier (``topk``/``randomk``) first, then at most one value encoder
    (``fp16``/``bf16``/``int8``). Downloads take a value encoder only (the model is dense).
    """

    upload: tuple[CodecStage, ...] = ()
    download: tuple[CodecStage, ...] = ()
    max_residuals_in_memory: int = Field(
        1024, ge=1, description="Error-feedback residuals kept in memory; older ones spill to disk."
    )
    residual_dir: str | None = Field(None, description="Where residuals spill (default: a temporary folder).")

    @model_validator(mode="after")
    def _stage_order(self) -> CodecConfig:
        for direction, stages in (("upload", self.upload), ("download", self.download)):
            sparsifiers = [i for i, st in enumerate(stages) if isinstance(st, _SPARSIFIERS)]
            encoders = [i for i, st in enumerate(stages) if isinstance(st, _VALUE_ENCODERS)]
            if direction == "download" and sparsifiers:
                raise _FieldError(("codec", "download"), "only fp16, bf16 and int8 stages apply to downloads")
            if len(sparsifiers) > 1 or (sparsifiers and sparsifiers[0] != 0):
                raise _FieldError(("codec", direction), "at most one topk/randomk stage, and it must come first")
            if len(encoders) > 1 or (encoders and encoders[0] != len(stages) - 1):
                raise _FieldError(("codec", direction), "at most one fp16/bf16/int8 stage, and it must come last")
        return self


class ClientConfig(_Section):
    """Local training of one client task: SGD over the client's own samples."""

    epochs: int = Field(5, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Cap on local steps per task (None: whole epochs).")
    batch_size: int = Field(16, ge=1)
    lr: float = Field(0.1, gt=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    clip_norm: float | None = Field(None, gt=0.0, description="Clip the gradient's global L2 norm.")
    proximal_mu: float = Field(
        0.0,
        ge=0.0,
        description="FedProx (Li et al., MLSys 2020): add mu/2 ||w - w_base||^2 to the local objective (0: off).",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="bf16 = autocast of the forward pass; fp16 = autocast with dynamic loss scaling (CUDA)."
    )
    checkpoint_segments: int = Field(
        0,
        ge=0,
        description="Gradient checkpointing: recompute each nn.Sequential block in this many segments (0: off).",
    )


# ------------------------------------------------------------------------------------------------- aggregation
class ConstantStalenessConfig(_Section):
    """``s(tau) = 1``."""

    kind: Literal["constant"] = "constant"


class PolynomialStalenessConfig(_Section):
    """``s(tau) = (1 + tau)^-a``."""

    kind: Literal["polynomial"] = "polynomial"
    a: float = Field(0.5, ge=0.0)


class HingeStalenessConfig(_Section):
    """``s(tau) = 1`` if ``tau <= b`` else ``1 / (a (tau - b) + 1)``."""

    kind: Literal["hinge"] = "hinge"
    a: float = Field(10.0, ge=0.0)
    b: int = Field(4, ge=0)


StalenessConfig = Annotated[
    ConstantStalenessConfig | PolynomialStalenessConfig | HingeStalenessConfig,
    Field(discriminator="kind"),
]


class SGDServerOptimizer(_Section):
    """``w <- w - lr * m``, ``m <- momentum * m + g`` with ``g`` the averaged client delta (FedAvgM with momentum)."""

    kind: Literal["sgd"] = "sgd"
    lr: float = Field(1.0, gt=0.0)
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    nesterov: bool = Field(False, description="Step with g + momentum * m instead of m (needs momentum > 0).")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDServerOptimizer:
        if self.nesterov and self.momentum <= 0:
            raise _FieldError(("server", "optimizer", "nesterov"), "needs momentum > 0")
        return self


class AdamServerOptimizer(_Section):
    """Server Adam on the pseudo-gradient (FedAdam, Reddi et al. 2021); ``eps`` is the paper's adaptivity ``tau``."""

    kind: Literal["adam"] = "adam"
    lr: float = Field(0.01, gt=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    eps: float = Field(1e-3, gt=0.0, description="The adaptivity tau added to sqrt(v).")


class AdagradServerOptimizer(_Section):
    """FedAdagrad (Reddi et al. 2021, Algorithm 2): ``v <- v + g^2``, ``w <- w - lr m / (sqrt(v) + tau)``."""

    kind: Literal["adagrad"] = "adagrad"
    lr: float = Field(0.01, gt=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="First-moment decay (0: plain Adagrad).")
    tau: float = Field(1e-3, gt=0.0, description="Adaptivity: added to sqrt(v); v starts at tau^2.")


class YogiServerOptimizer(_Section):
    """FedYogi (Reddi et al. 2021, Algorithm 2): ``v <- v - (1 - beta2) g^2 sign(v - g^2)``."""

    kind: Literal["yogi"] = "yogi"
    lr: float = Field(0.01, gt=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.99, ge=0.0, lt=1.0)
    tau: float = Field(1e-3, gt=0.0, description="Adaptivity: added to sqrt(v); v starts at tau^2.")


ServerOptimizerConfig = Annotated[
    SGDServerOptimizer | AdamServerOptimizer | AdagradServerOptimizer | YogiServerOptimizer,
    Field(discriminator="kind"),
]


class FedAvgServer(_Section):
    """Synchronous FedAvg: sample a cohort per round, wait for it, combine the round's updates, one server step.

    ``aggregation`` combines a round's updates by sample-weighted mean (McMahan et al., AISTATS 2017), or
    coordinate-wise median or trimmed mean (Yin et al., ICML 2018), robust to a minority of broken clients.
    """

    kind: Literal["fedavg"] = "fedavg"
    clients_per_round: int = Field(10, ge=1)
    optimizer: ServerOptimizerConfig = SGDServerOptimizer()
    aggregation: Literal["mean", "median", "trimmed_mean"] = Field(
        "mean", description="Combine a round's updates by weighted mean, coordinate-wise median or trimmed mean."
    )
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5, description="trimmed_mean: share cut at each end.")


class FedBuffServer(_Section):
    """Buffered asynchronous aggregation (Nguyen et al., AISTATS 2022)."""

    kind: Literal["fedbuff"] = "fedbuff"
    buffer_size: int = Field(10, ge=1, description="K: updates per server step.")
    concurrency: int = Field(20, ge=1, description="C: client tasks in flight.")
    staleness: StalenessConfig = PolynomialStalenessConfig()
    max_staleness: int | None = Field(None, ge=0, description="Drop (and count) older updates.")
    example_weight: Literal["equal", "samples"] = "equal"
    optimizer: ServerOptimizerConfig = SGDServerOptimizer()


class FedAsyncServer(_Section):
    """Per-update mixing ``w <- (1 - a_tau) w + a_tau w_local`` (Xie et al. 2019)."""

    kind: Literal["fedasync"] = "fedasync"
    alpha: float = Field(0.6, gt=0.0, le=1.0)
    concurrency: int = Field(20, ge=1)
    staleness: StalenessConfig = PolynomialStalenessConfig()
    max_staleness: int | None = Field(None, ge=0)


ServerConfig = Annotated[FedAvgServer | FedBuffServer | FedAsyncServer, Field(discriminator="kind")]


# --------------------------------------------------------------------------------------------------- topology
class FlatTopology(_Section):
    """Every client talks to the server (the cloud) directly."""

    kind: Literal["flat"] = "flat"


class EdgeLinkConfig(_Section):
    """The simulated link between an edge and its parent: ``latency + bytes / bandwidth`` each way."""

    latency_s: float = Field(0.01, ge=0.0, description="One-way latency.")
    upload_bytes_per_s: float = Field(1.25e8, gt=0.0, allow_inf_nan=True, description="Edge uplink (default 1 Gbit/s).")
    download_bytes_per_s: float = Field(
        1.25e8, gt=0.0, allow_inf_nan=True, description="Edge downlink (default 1 Gbit/s)."
    )


class EdgeSpec(_Section):
    """One edge of an explicit tree: its name, its parent, and the clients attached to it."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    parent: str = Field("cloud", min_length=1, description="'cloud' or the name of another edge.")
    clients: tuple[int | str, ...] = Field((), description="Client ids and inclusive ranges such as '0-99'.")


class TreeTopology(_Section):
    """Clients -> edges -> ... -> cloud (Liu et al., "Client-Edge-Cloud Hierarchical Federated Learning", 2020).

    The tree is either generated (``fanout``, top-down: ``[10]`` is 10 edges under the cloud, ``[10, 10]`` 10 edges
    with 10 sub-edges each) with clients assigned to the leaf edges by ``assign``, or given explicitly in ``edges``.
    With a ``fedavg`` server the edges run synchronous HierFAVG (``kappa2`` edge rounds per cloud round); with
    ``fedbuff`` or ``fedasync`` they aggregate asynchronously and forward every ``buffer_size`` updates or
    ``max_wait_s``.
    """

    kind: Literal["tree"] = "tree"
    fanout: tuple[Annotated[int, Field(ge=1)], ...] = Field((10,), description="Edges per level, top-down.")
    assign: Literal["blocks", "round_robin", "attribute"] = Field(
        "blocks", description="Clients to leaf edges: contiguous blocks, round-robin, or one edge per attribute value."
    )
    attribute: str = Field("region", min_length=1, description="The client attribute 'attribute' assignment uses.")
    edges: tuple[EdgeSpec, ...] = Field((), description="An explicit tree (overrides fanout and assign).")
    buffer_size: int = Field(10, ge=1, description="K_e: updates an async edge folds before forwarding.")
    max_wait_s: float | None = Field(
        None, gt=0.0, description="An async edge forwards what it holds this long after its first update."
    )
    kappa2: int = Field(1, ge=1, description="Sync HierFAVG: edge aggregations per cloud aggregation.")
    link: EdgeLinkConfig = EdgeLinkConfig()
    codec: tuple[CodecStage, ...] = Field(
        (), description="How edges encode the partials they send up: one fp16, bf16 or int8 stage (empty: float32)."
    )
    per_edge_metrics: bool = Field(False, description="Also log figures per edge name (at most 32 edges).")

    @model_validator(mode="after")
    def _edge_codec(self) -> TreeTopology:
        if len(self.codec) > 1 or any(not isinstance(stage, _VALUE_ENCODERS) for stage in self.codec):
            raise _FieldError(("topology", "codec"), "one fp16, bf16 or int8 stage at most (partials keep no residual)")
        return self


TopologyConfig = Annotated[FlatTopology | TreeTopology, Field(discriminator="kind")]


# ------------------------------------------------------------------------------------------------- faults
class AvailabilityConfig(_Section):
    """Periodic availability: each client is online for ``online_fraction`` of every ``period_s`` seconds.

    Each client's window starts at its own phase, drawn once from the run's seed. The server samples only online
    clients, and a client whose window closes before its upload is done drops out at that moment.
    """

    period_s: float = Field(gt=0.0, description="Length of one availability cycle, in (simulated) seconds.")
    online_fraction: float = Field(gt=0.0, le=1.0, description="Share of every cycle a client is online.")


class FaultsConfig(_Section):
    """Simulated client failures, drawn per client task from the run's seed (deterministic on the virtual clock).

    For each task one uniform draw ``u`` decides its fate: ``u < crash`` the training raises; then ``hang``
    (the client never answers: only ``resilience.task_timeout_s`` ends the task); then ``dropout`` (the client
    disconnects part-way through training). The three rates must sum to less than 1.
    """

    crash: float = Field(0.0, ge=0.0, lt=1.0, description="Probability that a task's training raises.")
    hang: float = Field(0.0, ge=0.0, lt=1.0, description="Probability that a task never returns.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Probability that a client leaves mid-training.")
    availability: AvailabilityConfig | None = None
    byzantine: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of clients (a fixed set drawn from the seed) that attack with every update.",
    )
    attack: Literal["sign_flip", "scale"] = Field(
        "sign_flip", description="sign_flip: send -attack_factor x the update; scale: send +attack_factor x it."
    )
    attack_factor: float = Field(20.0, gt=0.0, le=1e6, description="How much an attacker scales its update.")

    @model_validator(mode="after")
    def _rates(self) -> FaultsConfig:
        total = self.crash + self.hang + self.dropout
        if not total < 1.0:
            raise _FieldError(("faults",), f"crash + hang + dropout must be < 1, got {total:g}")
        return self


class ResilienceConfig(_Section):
    """How the server copes with failing clients and suspicious updates."""

    task_timeout_s: float | None = Field(
        None, gt=0.0, description="A task not answered this many seconds after dispatch is abandoned (timed out)."
    )
    round_quorum: float = Field(
        1.0, gt=0.0, le=1.0, description="Sync: a round closes once this share of clients_per_round answered."
    )
    round_deadline_s: float | None = Field(
        None, gt=0.0, description="Sync: a round closes this many seconds after it started, with who answered."
    )
    over_selection: float = Field(
        0.0, ge=0.0, le=10.0, description="Sync: sample ceil((1 + x) * clients_per_round) clients per round."
    )
    max_update_norm: float | None = Field(None, gt=0.0, description="Reject updates whose L2 norm is larger.")
    zscore_threshold: float | None = Field(
        None, gt=0.0, description="Reject updates whose norm's robust z-score over recent updates is larger."
    )
    zscore_window: int = Field(50, ge=3, description="Accepted update norms the robust z-score looks at.")
    zscore_min_history: int = Field(10, ge=3, description="Norms needed before the z-score check applies.")
    norm_bound_factor: float | None = Field(
        None,
        gt=1.0,
        description="Refuse updates whose norm exceeds this multiple of the median of recently accepted norms (a "
        "reference refused updates cannot move); needs zscore_min_history accepted updates first.",
    )
    clip_update_norm: float | None = Field(None, gt=0.0, description="Scale accepted updates down to this norm.")


class ScaffoldConfig(_Section):
    """SCAFFOLD (Karimireddy et al., ICML 2020), option II: local steps are corrected by ``c - c_i``, the server's
    and the client's control variates; each client keeps ``c_i`` (bounded in memory, spilled to disk, checkpointed)
    and uploads ``Delta c_i`` beside its delta; the server adds ``sum Delta c_i / N`` to ``c`` at each version and
    sends ``c`` with the model. Both travel through the codecs and count on the wire."""

    enabled: bool = False
    max_in_memory: int = Field(1024, ge=1, description="Client variates held in memory; older ones spill to disk.")
    spill_dir: str | None = Field(None, description="Where client variates spill (default: a temporary folder).")


class PrivacyConfig(_Section):
    """Central differential privacy (DP-FedAvg, McMahan et al. 2018; DP-FedBuff): every update is clipped to
    ``clip_norm``, each version's sum gets Gaussian noise of standard deviation ``noise_multiplier * clip_norm``
    and is divided by the fixed count (``clients_per_round`` or ``buffer_size``). The privacy spent, epsilon at
    ``delta``, is computed by Google's dp-accounting (``pip install 'flasync[privacy]'``) and logged per version."""

    enabled: bool = False
    clip_norm: float = Field(1.0, gt=0.0, description="C: the L2 norm every client update is clipped to.")
    noise_multiplier: float | None = Field(
        None, gt=0.0, description="z: noise standard deviation over clip_norm (or give target_epsilon)."
    )
    target_epsilon: float | None = Field(
        None, gt=0.0, description="Pick the smallest z whose epsilon after stop.max_versions versions is this."
    )
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="The delta epsilon is reported at (keep it < 1/clients).")

    @model_validator(mode="after")
    def _one_noise_source(self) -> PrivacyConfig:
        if self.enabled and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise _FieldError(("privacy", "noise_multiplier"), "give exactly one of noise_multiplier, target_epsilon")
        return self


class CheckpointConfig(_Section):
    """Checkpoints of the whole run state, written as MLflow artifacts (``checkpoints/a.pt`` and ``b.pt`` in turn)."""

    every_versions: int | None = Field(None, ge=1, description="Write a checkpoint every N model versions.")
    on_interrupt: bool = Field(True, description="Write a checkpoint when SIGINT/SIGTERM stops the run.")


# ---------------------------------------------------------------------------------------------------- runtime
class EvalConfig(_Section):
    """Server-side evaluation on the held-out split."""

    every_versions: int = Field(5, ge=1, description="Evaluate every N model versions (and at the end).")
    batch_size: int = Field(1024, ge=1)


class StopConfig(_Section):
    """When the run ends: the first limit reached wins."""

    max_versions: int = Field(150, ge=1)
    target_accuracy: float | None = Field(None, gt=0.0, le=1.0, description="Stop once reached.")
    max_simulated_s: float | None = Field(None, gt=0.0)
    max_wall_s: float | None = Field(None, gt=0.0)


class RayConfig(_Section):
    """Ray actors that train clients (``executor.kind = "ray"``; ``pip install 'flasync[ray]'``).

    Each actor holds the model and the training data (shipped once through Ray's object store); each model version
    is put once, and a task ships only its client's sample indices and random state.
    """

    address: str | None = Field(
        None,
        description="None: start a local Ray for this run and stop it at the end; 'host:port' or 'auto': join that "
        "cluster (and leave it running).",
    )
    actors: int = Field(2, ge=1, le=4096, description="Training actors.")
    cpus_per_actor: float = Field(1.0, gt=0.0, description="CPUs Ray reserves for each actor.")
    gpus_per_actor: float = Field(0.0, ge=0.0, description="GPUs Ray reserves for each actor (fractions share one).")
    threads_per_actor: int = Field(
        1, ge=1, le=256, description="Intra-op torch threads of each actor (the weights depend on it, as on threads)."
    )
    vectorized: bool = Field(False, description="Train the clients of one model version as cohorts inside actors.")
    connect_timeout_s: float = Field(10.0, gt=0.0, description="How long to try to reach executor.ray.address.")


class ExecutorConfig(_Section):
    """Where local training runs: a pool of worker threads, each reusing one model instance, or Ray actors.

    ``kind = "vectorized"`` trains clients that start from the same model version together, as one batched job
    of up to ``max_cohort`` clients (:mod:`flasync.training.cohort`); results match one-at-a-time training to float
    rounding, and a model ``vmap`` cannot batch is trained one client at a time (with a warning saying why).
    ``kind = "ray"`` trains on Ray actors (``executor.ray``), on this machine or a cluster: the same weights as the
    threads for the same config, whatever the number of actors. ``kind = "auto"`` (the default) runs vectorized
    cohorts when enough clients train at once and the model can be batched (FedAvg rounds of at least 32 clients,
    16 or 48 in flight for FedBuff / FedAsync; two of either on a GPU), threads otherwise, and logs which and why
    (``executor.auto``).
    """

    kind: Literal["auto", "thread", "vectorized", "ray"] = "auto"
    ray: RayConfig = RayConfig()
    workers: int | None = Field(
        None,
        ge=1,
        le=256,
        description="Training threads (more help when kernels, not Python, dominate a step). Unset: one per core "
        "(at most 4, and no more cohorts than half the free memory holds) for vectorized cohorts on the CPU, else 1.",
    )
    threads_per_worker: int = Field(
        1,
        ge=1,
        le=256,
        description="Intra-op torch threads of each worker. Part of what the final weights depend on: more threads "
        "split a kernel's sums differently, so weights_sha256 changes with it (workers does not change it).",
    )
    max_cohort: int = Field(256, ge=1, description="Most clients trained in one vectorized job.")
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda|cuda:[0-9]+|auto)$",
        description="cpu, cuda, cuda:N or auto (cuda when available): where data, models and aggregation live.",
    )
    data_on_device: bool = Field(
        True, description="Keep the training data on the device; False: in pinned host memory, batches prefetched."
    )


class DiagnosticsConfig(_Section):
    """What a run measures about itself beyond the tracking of its progress.

    ``profile`` collects the time, memory and communication profile (``profile.json`` and plots at the end);
    ``level`` selects training diagnostics: ``off`` (NaN/Inf checks only, which are free), ``basic`` (+ update
    norms, weight norms and drift per version, exploding-update and divergence alerts), ``full`` (+ per-layer
    gradient-norm statistics in every training step and exploding/vanishing-gradient alerts).
    """

    profile: bool = Field(True, description="Collect the time/memory/communication profile and write reports.")
    level: Literal["off", "basic", "full"] = "basic"

    @field_validator("level", mode="before")
    @classmethod
    def _off_is_not_false(cls, value: Any) -> Any:
        # YAML reads a bare `off` (in files and in --set) as false.
        return "off" if value is False else value

    plots: bool = Field(True, description="Write SVG plots (plots/*.svg) with profile.json.")
    torch_profiler_tasks: int = Field(
        0, ge=0, le=100, description="Trace the first N local training calls with torch.profiler (Chrome traces)."
    )
    stragglers: int = Field(5, ge=0, description="Slowest clients named in the profile.")
    exploding_factor: float = Field(
        10.0, gt=1.0, description="Alert when an update norm exceeds this multiple of the running median."
    )
    grad_norm_max: float = Field(1e3, gt=0.0, description="Alert when a layer's gradient norm exceeds this (full).")
    grad_norm_min: float = Field(1e-7, ge=0.0, description="Alert when a layer's mean gradient norm is below (full).")
    divergence_window: int = Field(3, ge=1, description="Alert when the server loss rose in this many evaluations.")
    divergence_tolerance: float = Field(0.1, ge=0.0, description="... and is this fraction above its best.")
    step_ratio_max: float = Field(
        0.5,
        gt=0.0,
        description="Alert when one version moves the weights by more than this share of their norm (basic+; "
        "healthy runs move a few percent per version).",
    )


class TrackingConfig(_Section):
    """Structured logs and MLflow."""

    enabled: bool = True
    uri: str | None = Field(None, description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or mlruns/).")
    experiment: str = Field("flasync", min_length=1)
    run_name: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_model: bool = Field(True, description="Also log the final model with mlflow.pytorch.")
    metrics: Literal["standard", "all"] = Field(
        "standard",
        description="Per-update metrics: 'standard' (samples, loss, peak memory, bytes, staleness) or 'all' (also "
        "training, queue wait, encode/decode and simulated s, compression, residual and update norms, staleness "
        "weight); the timings' per-version sums are logged either way.",
    )
    system_metrics: bool = Field(False, description="MLflow's CPU/GPU/memory monitor (on for CLI runs).")
    system_metrics_interval_s: float = Field(
        2.0,
        ge=0.1,
        description="Seconds between two samples of the system monitor (at least 0.1: each sample is a row of every "
        "system/ metric).",
    )

    @field_validator("uri")
    @classmethod
    def _known_store(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        scheme = uri.partition("://")[0].lower() if "://" in uri else ""
        if scheme.partition("+")[0] not in _TRACKING_SCHEMES:
            known = ", ".join(sorted(_TRACKING_SCHEMES))
            shown = re.sub(r"//[^/@]*@", "//***@", uri)  # never echo credentials
            raise _FieldError(("tracking", "uri"), f"{shown!r} is not an MLflow store URI (schemes: {known})")
        if scheme == "sqlite":
            path = Path(uri.removeprefix("sqlite:///").partition("?")[0])
            if uri.startswith("sqlite:///") and path.is_dir():
                raise _FieldError(
                    ("tracking", "uri"),
                    f"the SQLite store {path} is a folder; name the database file, e.g. {path}/mlflow.db",
                )
        return uri


class RemoteConfig(_Section):
    """Remote clients over HTTP (``flasync serve``, :func:`flasync.runtime.serve.asgi_app`): tasks go to devices that
    ask
    for them instead of to in-process coroutines; their uploads enter the same intake, aggregation and tracking."""

    enabled: bool = False
    tokens_file: str | None = Field(
        None,
        description="Lines 'CLIENT_ID TOKEN' (client ids 0 .. population.num_clients - 1; '#' starts a comment): "
        "each bearer token is bound to one client id.",
    )
    poll_s: float = Field(20.0, gt=0.0, le=300.0, description="Longest a client's request for a task is held open.")
    max_waiting: int = Field(
        1024, ge=1, description="Task requests held open at once; more are answered 429 with Retry-After."
    )
    retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After of a 429 or 503 answer, in seconds.")
    max_num_samples: int = Field(
        1_000_000, ge=1, description="Largest sample count a client may report (it weighs the client's update)."
    )


class RunConfig(_Section):
    """One federated run: data, model, clients, server, time and tracking."""

    seed: int = Field(0, ge=0, lt=2**63, description="The run's seed: every random stream is derived from it.")
    data: DataSource = DigitsData()
    partition: PartitionConfig = DirichletPartition()
    model: ModelConfig = MLPModel()
    population: PopulationConfig = PopulationConfig()
    client: ClientConfig = ClientConfig()
    server: ServerConfig = FedBuffServer()
    network: NetworkConfig = NetworkConfig()
    topology: TopologyConfig = FlatTopology()
    codec: CodecConfig = CodecConfig()
    eval: EvalConfig = EvalConfig()
    stop: StopConfig = StopConfig()
    executor: ExecutorConfig = ExecutorConfig()
    clock: Literal["virtual", "wall"] = "virtual"
    wall_time_factor: float | None = Field(
        None,
        gt=0.0,
        le=1000.0,
        description=(
            "With clock = 'wall': emulate the speed and network models, each simulated second lasting this many "
            "real seconds (1: real time, 0.1: ten times faster); unset: clients train at the machine's pace."
        ),
    )
    tracking: TrackingConfig = TrackingConfig()
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    faults: FaultsConfig = FaultsConfig()
    resilience: ResilienceConfig = ResilienceConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    scaffold: ScaffoldConfig = ScaffoldConfig()
    remote: RemoteConfig = RemoteConfig()

    @model_validator(mode="before")
    @classmethod
    def _robust_rule_belongs_to_the_server(cls, data: Any) -> Any:
        # `resilience.aggregation` and `resilience.trim_fraction` were where the robust rule was chosen; it is a
        # choice of the FedAvg server now (`server.aggregation`), and the old keys still mean the same.
        if not isinstance(data, Mapping):
            return data
        resilience = data.get("resilience")
        if not isinstance(resilience, Mapping) or not {"aggregation", "trim_fraction"} & resilience.keys():
            return data
        resilience = dict(resilience)
        moved = {key: resilience.pop(key) for key in ("aggregation", "trim_fraction") if key in resilience}
        server = data.get("server")
        server = dict(server) if isinstance(server, Mapping) else {"kind": "fedbuff"} if server is None else server
        kind = server.get("kind", "fedbuff") if isinstance(server, dict) else getattr(server, "kind", "fedbuff")
        if kind != "fedavg":
            rule = moved.get("aggregation", "mean")
            if rule != "mean":
                raise _FieldError(
                    ("resilience", "aggregation"),
                    f"{rule!r} applies to sync rounds only (server.kind = 'fedavg'), not {kind!r}",
                )
            return {**data, "resilience": resilience}
        if not isinstance(server, dict):
            server = server.model_dump()
        return {**data, "resilience": resilience, "server": {**moved, **server}}

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        n = self.population.num_clients
        data = self.data
        if isinstance(data, SyntheticData) and not data.lazy:
            needed = (data.samples_per_client * n + data.test_samples) * data.num_features * 4
            if needed > _MAX_EAGER_DATA_BYTES:
                raise _FieldError(
                    ("data", "samples_per_client"),
                    f"{data.samples_per_client} samples x {n} clients x {data.num_features} features need "
                    f"{needed / 2**30:.0f} GiB in memory (at most {_MAX_EAGER_DATA_BYTES // 2**30} GiB); "
                    "use data.lazy = true to draw each client's samples when it is sampled",
                )
        if isinstance(self.partition, ByColumnPartition) and (
            not isinstance(data, FilesData) or data.client_column is None
        ):
            raise _FieldError(
                ("partition", "kind"),
                "'by_column' needs data.kind = 'files' with data.client_column naming the client of each sample",
            )
        server = self.server
        if isinstance(server, FedAvgServer) and server.clients_per_round > n:
            raise _FieldError(
                ("server", "clients_per_round"),
                f"must be <= population.num_clients ({n}), got {server.clients_per_round}",
            )
        if isinstance(server, FedBuffServer | FedAsyncServer) and server.concurrency > n:
            raise _FieldError(
                ("server", "concurrency"),
                f"must be <= population.num_clients ({n}), got {server.concurrency}",
            )
        topology = self.topology
        if isinstance(topology, TreeTopology) and topology.per_edge_metrics:
            count = len(topology.edges) or sum(math.prod(topology.fanout[: i + 1]) for i in range(len(topology.fanout)))
            if count > 32:
                raise _FieldError(("topology", "per_edge_metrics"), f"at most 32 edges, the tree has {count}")

        res = self.resilience
        if isinstance(topology, TreeTopology):
            # Edges close their clients' tasks and aggregate them: validation, clipping, timeouts and the failure
            # model apply at every edge; a round's quorum, deadline and over-selection, and a coordinate-wise rule
            # (which needs every client update at the cloud) do not.
            for field_loc, value, default in (
                (("resilience", "round_quorum"), res.round_quorum, 1.0),
                (("resilience", "round_deadline_s"), res.round_deadline_s, None),
                (("resilience", "over_selection"), res.over_selection, 0.0),
                (("server", "aggregation"), getattr(server, "aggregation", "mean"), "mean"),
            ):
                if value != default:
                    raise _FieldError(field_loc, "is not supported with topology.kind = 'tree' (flat runs only)")
        sampling = self.population.sampling
        if self.faults.availability is not None and sampling != "uniform":
            raise _FieldError(
                ("faults", "availability"),
                f"windows pick online clients themselves; they need population.sampling = 'uniform', not {sampling!r}",
            )
        if self.checkpoint.every_versions is not None and sampling == "lru":
            raise _FieldError(
                ("checkpoint", "every_versions"),
                "checkpoints do not hold the least-recently-used sampler's queue; use another population.sampling",
            )
        if self.faults.hang > 0 and res.task_timeout_s is None:
            raise _FieldError(
                ("resilience", "task_timeout_s"),
                f"must be set when faults.hang > 0 (got hang={self.faults.hang:g}): hanging clients never answer",
            )
        if self.privacy.enabled:
            self._check_privacy()
        if self.scaffold.enabled:
            self._check_scaffold()
        if res.zscore_min_history > res.zscore_window:
            raise _FieldError(
                ("resilience", "zscore_min_history"),
                f"must be <= resilience.zscore_window ({res.zscore_window}), got {res.zscore_min_history}",
            )
        return self

    @model_validator(mode="after")
    def _remote_checks(self) -> RunConfig:
        if self.wall_time_factor is not None and self.clock != "wall":
            raise _FieldError(("wall_time_factor",), f"needs clock = 'wall', got {self.clock!r}")
        remote = self.remote
        if not remote.enabled:
            return self
        if self.clock != "wall":
            raise _FieldError(("clock",), f"remote clients need clock = 'wall', got {self.clock!r}")
        if remote.tokens_file is None:
            raise _FieldError(("remote", "tokens_file"), "must name the tokens file when remote.enabled = true")
        if self.resilience.task_timeout_s is None:
            raise _FieldError(
                ("resilience", "task_timeout_s"),
                "must be set when remote.enabled = true: a device that leaves would hold its task for ever",
            )
        if isinstance(self.topology, TreeTopology):
            raise _FieldError(("remote", "enabled"), "is not supported with topology.kind = 'tree' (flat runs only)")
        if self.scaffold.enabled:
            raise _FieldError(("remote", "enabled"), "cannot be combined with scaffold.enabled")
        if self.faults != FaultsConfig():
            raise _FieldError(("faults",), "simulates in-process clients; a run with remote clients takes none")
        if self.wall_time_factor is not None:
            raise _FieldError(("wall_time_factor",), "emulates in-process clients; remote clients run in real time")
        return self

    def _check_privacy(self) -> None:
        # The sensitivity of a version's sum is clip_norm only when each update counts once, with weight <= 1.
        server, where = self.server, ("privacy", "enabled")
        if isinstance(server, FedAsyncServer):
            raise _FieldError(where, "needs server.kind = 'fedavg' or 'fedbuff' (FedAsync has no sum to noise)")
        if isinstance(server, FedAvgServer) and server.aggregation != "mean":
            raise _FieldError(where, f"needs server.aggregation = 'mean', not {server.aggregation!r}")
        if isinstance(server, FedBuffServer) and server.example_weight != "equal":
            raise _FieldError(where, "needs server.example_weight = 'equal' (sample weights break the noise's bound)")
        if isinstance(self.topology, TreeTopology):
            raise _FieldError(where, "is not supported with topology.kind = 'tree' (flat runs only)")

    def _check_scaffold(self) -> None:
        where = ("scaffold", "enabled")
        if isinstance(self.server, FedAsyncServer):
            raise _FieldError(where, "needs server.kind = 'fedavg' or 'fedbuff' (FedAsync mixes models, not deltas)")
        if isinstance(self.topology, TreeTopology):
            raise _FieldError(where, "is not supported with topology.kind = 'tree' (flat runs only)")
        if self.privacy.enabled:
            raise _FieldError(where, "cannot be combined with privacy.enabled (the variates are not privatized)")


_MAX_EAGER_DATA_BYTES = 16 * 2**30
_TRACKING_SCHEMES = frozenset(
    {"sqlite", "file", "http", "https", "databricks", "databricks-uc", "uc", "postgresql", "mysql", "mssql"}
)
_YAML_MAX_DEPTH = 64


class _LimitedLoader(yaml.SafeLoader):
    """PyYAML's safe loader without anchors or aliases (a config needs neither; they allow expansion bombs) and
    with a bounded nesting depth (a deep document is refused before it costs a deep recursion)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise _YamlRefused(f"YAML aliases (*{event.anchor}) are not supported in configs", event.start_mark)
        event = self.peek_event()  # type: ignore[no-untyped-call]
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise _YamlRefused(f"YAML anchors (&{anchor}) are not supported in configs", event.start_mark)
        self._depth += 1
        if self._depth > _YAML_MAX_DEPTH:
            raise _YamlRefused(f"nested deeper than {_YAML_MAX_DEPTH} levels", event.start_mark)
        try:
            node: yaml.Node | None = super().compose_node(parent, index)
            return node
        finally:
            self._depth -= 1


class _YamlRefused(yaml.YAMLError):
    def __init__(self, message: str, mark: yaml.Mark | None) -> None:
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        super().__init__(f"{message}{where}")


def safe_yaml(text: str) -> Any:
    """Parse YAML with PyYAML's safe loader, refusing anchors and aliases and nesting over 64 levels.

    Raises:
        yaml.YAMLError: If the text is not YAML, or uses what is refused (the message says which and where).
    """
    loader = _LimitedLoader(text)
    try:
        return loader.get_single_data()
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise yaml.YAMLError(str(exc).split(";")[0]) from None
    finally:
        loader.dispose()


class _FieldError(ValueError):
    """A cross-field check that knows which field is wrong."""

    def __init__(self, loc: tuple[str, ...], message: str) -> None:
        super().__init__(f"{'.'.join(loc)}: {message}")
        self.loc = loc
        self.message = message


# ------------------------------------------------------------------------------------------------ loading
def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a run configuration from a TOML/YAML file (or the defaults) and apply ``--set`` overrides.

    Relative data file paths in the file (``data.train``, ``data.test``) are made absolute against the file's
    folder, so a config and its data move together; paths given by ``overrides`` stay relative to the working
    directory.

    Args:
        path: A ``.toml``, ``.yaml`` or ``.yml`` file; ``None`` starts from the defaults.
        overrides: ``path.to.field=value`` strings; values are parsed as YAML scalars or lists
            (``0.5``, ``true``, ``[64, 64]``, ``fedasync``).

    Returns:
        The validated configuration.

    Raises:
        ConfigError: With a one-line message naming the file or field that is wrong.
    """
    data: dict[str, Any] = {} if path is None else _read_file(Path(path))
    if path is not None:
        _anchor_data_paths(data, Path(path).absolute().parent)
    for override in overrides:
        apply_override(data, override)
    return validate(data)


def validate(data: Mapping[str, Any]) -> RunConfig:
    """Validate a plain mapping into a :class:`RunConfig`.

    Raises:
        ConfigError: With a one-line message naming the first wrong field.
    """
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, data, model=RunConfig)) from None


def _read_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():
        raise ConfigError(f"config path is not a file: {path}")
    suffix = path.suffix.lower()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    loaded: Any
    if suffix == ".toml":
        try:
            loaded = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    elif suffix in (".yaml", ".yml"):
        try:
            loaded = safe_yaml(text)
        except yaml.YAMLError as exc:
            detail = " ".join(str(exc).split())
            raise ConfigError(f"{path}: invalid YAML: {detail}") from None
        if loaded is None:
            loaded = {}
    else:
        raise ConfigError(f"{path}: unsupported config format {suffix!r} (use .toml, .yaml or .yml)")
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be a table/mapping, got {type(loaded).__name__}")
    return loaded


def _anchor_data_paths(data: dict[str, Any], folder: Path) -> None:
    """Make the relative file paths a config file names (a ``files`` data section's, the remote tokens file)
    absolute against ``folder``, in place."""
    places: list[tuple[dict[str, Any], str]] = []
    section = data.get("data")
    if isinstance(section, dict) and section.get("kind") == "files":
        places += [(section, "train"), (section, "test")]
    remote = data.get("remote")
    if isinstance(remote, dict):
        places.append((remote, "tokens_file"))
    for table, key in places:
        value = table.get(key)
        if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
            table[key] = os.path.normpath(folder / value)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set ``path.to.field=value`` in a nested mapping, in place.

    Raises:
        ConfigError: If the override is malformed or walks through a value that is not a table.
    """
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {override!r}: expected path.to.field=value")
    parts = key.split(".")
    if any(not p.strip() or not p.replace("_", "a").isalnum() for p in parts):
        raise ConfigError(f"--set {override!r}: {key!r} is not a dotted field path")
    try:
        value = safe_yaml(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError):  # not YAML, or a number too long for Python to convert: the raw text
        value = raw
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"--set {override!r}: {where} is a value, not a table")
        node = child
    node[parts[-1]] = value


def format_validation_error(
    exc: ValidationError, data: Mapping[str, Any] | None = None, *, model: type[BaseModel] | None = None
) -> str:
    """Render a pydantic error as one line naming the field, e.g. ``server.buffer_size: must be >= 1 (got 0)``.

    With ``model`` (the validated class), an unknown field is followed by the closest known one of its table
    (``server.bufer_size: unknown field (did you mean buffer_size?)``), or by that table's fields.
    """
    errors = exc.errors()
    first = errors[0]
    ctx_error = (first.get("ctx") or {}).get("error")
    if isinstance(ctx_error, _FieldError):
        where, message = ".".join(ctx_error.loc), ctx_error.message
    else:
        where = ".".join(_strip_tags(first["loc"], data)) or "config"
        message = _message(first)
        if first["type"] == "extra_forbidden" and model is not None and first["loc"]:
            message += _known_fields_hint(str(first["loc"][-1]), _table_fields(model, first["loc"][:-1]))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {message}{more}"


def _known_fields_hint(name: str, fields: Sequence[str]) -> str:
    """Return `` (did you mean X?)`` for the field of ``fields`` closest to ``name``, else `` (fields: ...)``."""
    if not fields:
        return ""
    close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (fields: {', '.join(sorted(fields))})"


def _table_fields(model: type[BaseModel], loc: Sequence[int | str]) -> list[str]:
    """Return the field names of the table at pydantic's ``loc`` (union tags and list indices included) under
    ``model``; [] where the path leads elsewhere than to a table."""
    node: Any = model
    for part in loc:
        node, tagged = _unwrap(node, part)
        if tagged:
            continue  # the part was a union's tag: the member it names is the table
        if isinstance(node, type) and issubclass(node, BaseModel) and part in node.model_fields:
            node = node.model_fields[str(part)].annotation
        elif get_origin(node) in (list, tuple) and isinstance(part, int):
            node = get_args(node)[0]
        else:
            return []
    node, _ = _unwrap(node, None)
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _unwrap(node: Any, tag: int | str | None) -> tuple[Any, bool]:
    """Strip ``Annotated`` and ``None`` from ``node``; of a union of tables, take the member ``tag`` names (by
    ``kind`` or class name; then True: the tag is used up), else its only table (None if it has several)."""
    while get_origin(node) is Annotated:
        node = get_args(node)[0]
    if get_origin(node) not in (Union, types.UnionType):
        return node, False
    members = [m for m in get_args(node) if m is not type(None)]
    tables = [m for m in members if isinstance(m, type) and issubclass(m, BaseModel)]
    for member in tables:
        kind = member.model_fields.get("kind")
        if tag is not None and (tag == member.__name__ or (kind is not None and kind.default == tag)):
            return member, True
    if len(members) == 1:
        return members[0], False
    return (tables[0] if len(tables) == 1 else None), False


def _strip_tags(loc: Sequence[int | str], data: Mapping[str, Any] | None) -> list[str]:
    """Drop discriminator tags (``server.fedbuff.buffer_size`` -> ``server.buffer_size``)."""
    out: list[str] = []
    node: Any = data
    last = len(loc) - 1
    for i, part in enumerate(loc):
        tag = isinstance(node, Mapping) and part not in node and node.get("kind", part) == part
        if tag and i < last:
            continue
        out.append(str(part))
        if isinstance(node, Mapping):
            node = node.get(part)
        elif isinstance(node, list | tuple) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
    return out


def _message(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":
        ctx = error.get("ctx") or {}
        return f"unknown kind {ctx.get('tag', error['input'])!r} (expected one of {ctx.get('expected_tags', '')})"
    message = str(error["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if "input" in error and not isinstance(error["input"], Mapping):
        shown = repr(error["input"])
        message += f" (got {shown if len(shown) <= 80 else shown[:60] + f'... ({len(shown)} characters)'})"
    return message


def flatten(config: BaseModel) -> dict[str, Any]:
    """Flatten a configuration to ``{"server.buffer_size": 10, ...}`` for MLflow params."""
    return dict(_flatten(config.model_dump(mode="json"), ""))


def _flatten(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        if isinstance(node, float) and not math.isfinite(node):
            node = str(node)
        yield prefix[:-1], node
