"""One run's whole configuration, the checks across its sections, and its flat form for MLflow params."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from flasync.config._base import _FieldError, _Section
from flasync.config.algorithms import PrivacyConfig, ResilienceConfig, ScaffoldConfig
from flasync.config.codec import CodecConfig
from flasync.config.data import (
    ByColumnPartition,
    DataSource,
    DigitsData,
    DirichletPartition,
    FilesData,
    PartitionConfig,
    SyntheticData,
)
from flasync.config.model import ClientConfig, MLPModel, ModelConfig
from flasync.config.population import FaultsConfig, NetworkConfig, PopulationConfig
from flasync.config.runtime import (
    CheckpointConfig,
    DiagnosticsConfig,
    EvalConfig,
    ExecutorConfig,
    RemoteConfig,
    StopConfig,
    TrackingConfig,
)
from flasync.config.secure import SecureAggregationConfig
from flasync.config.server import FedAsyncServer, FedAvgServer, FedBuffServer, ServerConfig
from flasync.config.tasks import Task, check_task
from flasync.config.topology import FlatTopology, TopologyConfig, TreeTopology

_MAX_EAGER_DATA_BYTES = 16 * 2**30


class RunConfig(_Section):
    """One federated run: data, model, clients, server, time and tracking."""

    seed: int = Field(0, ge=0, lt=2**63, description="The run's seed: every random stream is derived from it.")
    task: Task = Field(
        "classification",
        description="What the model learns: 'classification' (cross-entropy on class labels), 'regression' "
        "(mean squared error on a real target, one output) or 'language_model' (the next character of a .txt file; "
        "perplexity).",
    )
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
    clock: Literal["virtual", "wall"] = Field(
        "virtual",
        description="Virtual time for simulation (deterministic, never waits) or wall time (deployment, embedding).",
    )
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
    secure_aggregation: SecureAggregationConfig = SecureAggregationConfig()

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
        self._check_server_sizes(n)
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
        if self.population.trace is not None:
            self._check_trace()
        if self.faults.availability is not None and sampling != "uniform":
            raise _FieldError(
                ("faults", "availability"),
                f"windows pick online clients themselves; they need population.sampling = 'uniform', not {sampling!r}",
            )
        periodic = next((k for k in ("every_versions", "every_s") if getattr(self.checkpoint, k) is not None), None)
        if periodic is not None and sampling == "lru":
            raise _FieldError(
                ("checkpoint", periodic),
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
        if self.model.partial:
            self._check_partial_model()
        if self.model.prune is not None:
            self._check_pruning()
        if self.client.personal is not None:
            self._check_personal()
        if res.zscore_min_history > res.zscore_window:
            raise _FieldError(
                ("resilience", "zscore_min_history"),
                f"must be <= resilience.zscore_window ({res.zscore_window}), got {res.zscore_min_history}",
            )
        return self

    def _check_trace(self) -> None:
        """Refuse what a device trace cannot combine with: other windows, sampling that ignores them, devices."""
        where = ("population", "trace")
        if self.faults.availability is not None:
            raise _FieldError(where, "gives the availability windows; remove faults.availability")
        if self.population.sampling != "uniform":
            raise _FieldError(where, f"windows need population.sampling = 'uniform', not {self.population.sampling!r}")
        if self.population.available_fraction < 1.0:
            raise _FieldError(where, "gives the availability windows; remove population.available_fraction")
        if self.remote.enabled:
            raise _FieldError(where, "simulates devices; remote.enabled trains on real ones")

    def _check_server_sizes(self, n: int) -> None:
        """Refuse a server that asks for more clients at once than the population's ``n``."""
        server = self.server
        counts: list[tuple[str, int | None]] = []
        if isinstance(server, FedAvgServer):
            counts = [("clients_per_round", server.clients_per_round), ("min_clients", server.min_clients)]
        elif isinstance(server, FedBuffServer | FedAsyncServer):
            counts = [("concurrency", server.concurrency)]
        for name, count in counts:
            if count is not None and count > n:
                raise _FieldError(("server", name), f"must be <= population.num_clients ({n}), got {count}")

    @model_validator(mode="after")
    def _secure_aggregation_checks(self) -> RunConfig:
        if self.secure_aggregation.enabled:
            check_secure_aggregation(self)
        return self

    @model_validator(mode="after")
    def _task_checks(self) -> RunConfig:
        check_task(self)
        return self

    @model_validator(mode="after")
    def _registry_checks(self) -> RunConfig:
        track = self.tracking
        if track.register is not None and not track.enabled:
            raise _FieldError(("tracking", "register"), "needs tracking (tracking.enabled = true, no --no-tracking)")
        if track.register is not None and not track.log_model:
            raise _FieldError(("tracking", "register"), "needs the model logged (tracking.log_model = true)")
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

    def _check_partial_model(self) -> None:
        # A cohort stacks whole models (each member's every parameter), and a remote device builds its model from
        # the config without the run's initial weights, which the frozen part of a partial model is.
        which = "model.adapter" if self.model.adapter is not None else "model.exchange"
        if self.executor.kind == "vectorized":
            raise _FieldError(
                ("executor", "kind"), f"'vectorized' trains whole models; {which} needs 'thread', 'ray' or 'auto'"
            )
        if self.remote.enabled:
            raise _FieldError(("remote", "enabled"), f"cannot be combined with {which} (in-process clients only)")

    def _check_pruning(self) -> None:
        # The mask multiplies each gradient in the threads' training loop: a cohort's step and a Ray actor's take no
        # mask; SCAFFOLD sends its variate with each model, where the mask goes; a remote device takes no plug-in.
        where = ("model", "prune")
        if self.executor.kind in ("vectorized", "ray"):
            raise _FieldError(where, f"needs executor.kind = 'thread' or 'auto', not {self.executor.kind!r}")
        if self.scaffold.enabled:
            raise _FieldError(where, "cannot be combined with scaffold.enabled (both send state with each model)")
        if self.remote.enabled:
            raise _FieldError(where, "cannot be combined with remote.enabled (in-process clients only)")
        if isinstance(self.topology, TreeTopology):
            raise _FieldError(where, "is not supported with topology.kind = 'tree' (flat runs only)")
        if any(stage.kind in ("topk", "randomk") for stage in self.codec.upload):
            raise _FieldError(where, "sends updates sparse itself; drop the codec.upload topk/randomk stage")

    def _check_personal(self) -> None:
        # FedBN's start and withheld layers are a threads' task's parts: a cohort's step and a Ray actor take none;
        # SCAFFOLD and pruning would correct or mask the local layers as shared ones; a partial model's flat vector
        # is not the whole model's. Fine-tuning and Ditto train in the run's workers beside the global update.
        where = ("client", "personal")
        personal = self.client.personal
        fedbn = personal is not None and personal.kind == "fedbn"
        if self.executor.kind == "ray" or (fedbn and self.executor.kind == "vectorized"):
            raise _FieldError(where, f"needs executor.kind = 'thread' or 'auto', not {self.executor.kind!r}")
        clashes = [("remote.enabled", self.remote.enabled)]
        if fedbn:
            clashes += [
                ("scaffold.enabled", self.scaffold.enabled),
                ("model.prune", self.model.prune is not None),
                ("model.exchange / model.adapter", self.model.partial),
            ]
        clash = next((name for name, on in clashes if on), None)
        if clash is not None:
            raise _FieldError(where, f"cannot be combined with {clash}")
        if personal is not None and personal.kind == "finetune" and not self.eval.clients.enabled:
            raise _FieldError(where, "reports through client-side evaluation: set eval.clients.fraction or every")
        if self.eval.clients.enabled and self.eval.clients.when != "before":
            raise _FieldError(where, "evaluates the personal model before local training: set eval.clients.when")

    def _check_scaffold(self) -> None:
        where = ("scaffold", "enabled")
        if isinstance(self.server, FedAsyncServer):
            raise _FieldError(where, "needs server.kind = 'fedavg' or 'fedbuff' (FedAsync mixes models, not deltas)")
        if isinstance(self.topology, TreeTopology):
            raise _FieldError(where, "is not supported with topology.kind = 'tree' (flat runs only)")
        if self.privacy.enabled:
            raise _FieldError(where, "cannot be combined with privacy.enabled (the variates are not privatized)")


def check_secure_aggregation(config: RunConfig) -> None:
    """Refuse what secure aggregation cannot combine with, each with its reason, and a group it cannot protect.

    Raises:
        _FieldError: The first combination refused.
    """
    where, server, res = ("secure_aggregation", "enabled"), config.server, config.resilience
    if isinstance(server, FedAsyncServer):
        raise _FieldError(where, "needs server.kind = 'fedavg' or 'fedbuff' (FedAsync applies each update alone)")
    refusals: list[tuple[bool, str]] = [
        (
            any(s.kind in ("topk", "randomk") for s in config.codec.upload),
            "cannot combine with a topk/randomk upload "
            "stage: each client keeps other coordinates, and masks only cancel over the same coordinates",
        ),
        (
            bool(config.codec.upload),
            "takes no codec.upload stage: the masked ring vector is the upload's encoding "
            "(secure_aggregation.bits per coordinate)",
        ),
        (
            getattr(server, "aggregation", "mean") != "mean",
            "needs server.aggregation = 'mean': a robust rule needs the individual updates the server must not see",
        ),
        (
            any(
                v is not None
                for v in (res.max_update_norm, res.zscore_threshold, res.norm_bound_factor, res.clip_update_norm)
            ),
            "cannot combine with the server's norm checks or clipping (resilience.*_norm, zscore_threshold, "
            "norm_bound_factor): the server never sees one update's norm; secure_aggregation.clip bounds each value",
        ),
        (
            isinstance(config.topology, TreeTopology),
            "is not supported with topology.kind = 'tree' (an edge would see its clients' updates)",
        ),
        (
            config.privacy.enabled,
            "cannot combine with privacy.enabled: central DP clips each update at the server's "
            "intake, which never sees one under secure aggregation",
        ),
        (config.scaffold.enabled, "cannot combine with scaffold.enabled (the control variates would travel unmasked)"),
        (
            res.round_deadline_s is not None,
            "cannot combine with resilience.round_deadline_s: a round's clients that finished training hold their "
            "updates until the round's group is complete (members drop out in the protocol only)",
        ),
        (
            isinstance(server, FedBuffServer) and server.concurrency < server.buffer_size,
            "needs server.concurrency >= server.buffer_size: the clients of a filling buffer wait in their task "
            "slots until the buffer is full",
        ),
    ]
    for refused, reason in refusals:
        if refused:
            raise _FieldError(where, reason)
    if isinstance(server, FedAvgServer):
        group = math.ceil((1.0 + res.over_selection) * server.clients_per_round)
        config.secure_aggregation.check_group(group, ("server", "clients_per_round"))
    else:
        config.secure_aggregation.check_group(server.buffer_size, ("server", "buffer_size"))


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
