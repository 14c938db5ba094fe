"""How a run runs: executors, Ray, evaluation, stopping, checkpoints, diagnostics, tracking and remote clients."""

from __future__ import annotations

import posixpath
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flasync.config._base import _FieldError, _Section


class CheckpointConfig(_Section):
    """Checkpoints of the whole run state, written as MLflow artifacts (``checkpoints/a.pt`` and ``b.pt`` in turn)."""

    every_versions: int | None = Field(None, ge=1, description="Write a checkpoint every N model versions.")
    every_s: float | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="Also write one at the first version made this many wall seconds after the last (None: off).",
    )
    on_interrupt: bool = Field(True, description="Write a checkpoint when SIGINT/SIGTERM stops the run.")


ALWAYS_METRICS = ("accuracy", "loss")
"""What every evaluation logs, whatever ``eval.metrics`` names."""
BUILTIN_METRIC_NAMES = ("precision", "recall", "f1", "auc", "mse", "mae")
"""The built-in metrics ``eval.metrics`` may add (:mod:`flasync.training.metrics`)."""
CLIENT_EVAL_FIGURES = ("mean", "p10", "p50", "p90", "worst10")
"""What client-side evaluation logs per metric and version closed (``client_eval/<metric>/<figure>``)."""
_METRIC_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")
_RESERVED_FIELDS = frozenset(
    {"step", "version", "of", "updates", "simulated_s", "wall_s", "eta_s", "eval_s", "clients", "samples", "reports"}
)
"""Field names of the evaluation's log lines: a user's metric cannot take one."""


def check_metric_names(entries: Iterable[str]) -> tuple[str, ...]:
    """Check the entries of ``eval.metrics`` without importing anything; return the metric names they give.

    An entry is a built-in name (:data:`ALWAYS_METRICS`, :data:`BUILTIN_METRIC_NAMES`) or a user's metric,
    ``NAME=module:attribute``.

    Raises:
        ValueError: An entry is neither, or two entries give one name.
    """
    names: list[str] = []
    for entry in entries:
        name, eq, target = entry.partition("=")
        name = name.strip()
        if not eq:
            if name not in BUILTIN_METRIC_NAMES and name not in ALWAYS_METRICS:
                known = ", ".join((*ALWAYS_METRICS, *BUILTIN_METRIC_NAMES))
                raise ValueError(f"unknown metric {entry!r} (built-in: {known}; or NAME=module:attribute)")
        else:
            module, colon, attribute = target.strip().partition(":")
            if (
                not _METRIC_NAME.fullmatch(name)
                or name in _RESERVED_FIELDS
                or name in BUILTIN_METRIC_NAMES
                or name in ALWAYS_METRICS
            ):
                raise ValueError(f"{entry!r}: a user's metric needs a new lower-case identifier as its name")
            if not colon or not module or not attribute:
                raise ValueError(f"{entry!r}: a user's metric is NAME=module:attribute")
        if name in names:
            raise ValueError(f"metric {name!r} is named twice")
        names.append(name)
    return tuple(names)


class ClientEvalConfig(_Section):
    """Client-side (federated) evaluation: clients evaluate the model they downloaded on a held-out share of their
    own samples and report to the server, which sums the reports up per model version (off by default)."""

    fraction: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of tasks whose client evaluates (a draw per client and participation; 0: off).",
    )
    every: int | None = Field(
        None, ge=1, description="Instead of a fraction: every Nth participation of each client evaluates (None: off)."
    )
    when: Literal["before", "after"] = Field(
        "before",
        description="Evaluate the downloaded model before local training, or the locally trained model after it "
        "(either way the report counts towards the version downloaded).",
    )
    held_out: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="Share of each client's samples the partitioner holds out for its evaluation, never trained on "
        "(None: 0.2 when client-side evaluation is on, no split otherwise; a value splits even with it off).",
    )
    min_reports: int = Field(
        10, ge=1, description="A version's evaluation closes once this many reports for it arrived..."
    )
    deadline_s: float | None = Field(
        None,
        gt=0.0,
        description="... or once this many (simulated) seconds passed since the version was published, with at least "
        "one report (None: no deadline; open versions close at the run's end).",
    )

    @model_validator(mode="after")
    def _one_way(self) -> ClientEvalConfig:
        if self.fraction > 0.0 and self.every is not None:
            raise _FieldError(("eval", "clients", "every"), "set either eval.clients.fraction or every, not both")
        return self

    @property
    def enabled(self) -> bool:
        """Whether some tasks evaluate."""
        return self.fraction > 0.0 or self.every is not None

    @property
    def held_out_share(self) -> float:
        """Return the share of each client's samples held out for its evaluation (0: no split)."""
        if self.held_out is not None:
            return self.held_out
        return 0.2 if self.enabled else 0.0


class EvalConfig(_Section):
    """Server-side evaluation on the held-out split, and client-side evaluation (``eval.clients``)."""

    every_versions: int = Field(5, ge=1, description="Evaluate every N model versions (and at the end).")
    batch_size: int = Field(1024, ge=1, description="Samples per evaluation batch.")
    metrics: tuple[str, ...] = Field(
        ALWAYS_METRICS,
        description="What the evaluation computes: accuracy and loss always, and any of precision, recall, f1 "
        "(macro), auc (two classes), mse, mae (regression), or a user's metric as 'NAME=module:attribute' "
        "(update(preds, targets) and compute()); each is logged as server/eval/NAME.",
    )
    clients: ClientEvalConfig = Field(
        default_factory=ClientEvalConfig, description="Client-side (federated) evaluation (off by default)."
    )
    select: str | None = Field(
        None,
        description="Keep the best version's weights by a metric the evaluation logs, as 'KEY:max' or 'KEY:min' "
        "(e.g. 'server/eval/accuracy:max'); the run logs that model as 'best_model' besides the last one (None: off).",
    )

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, metrics: tuple[str, ...]) -> tuple[str, ...]:
        check_metric_names(metrics)
        return metrics

    @model_validator(mode="after")
    def _known_select(self) -> EvalConfig:
        if self.select is not None:
            parse_select(self.select, selectable_keys(self))
        return self

    @property
    def metric_names(self) -> tuple[str, ...]:
        """Return the names of the metrics the central evaluation logs (accuracy and loss first)."""
        names = check_metric_names(self.metrics)
        return (*ALWAYS_METRICS, *(n for n in names if n not in ALWAYS_METRICS))


def selectable_keys(config: EvalConfig) -> tuple[str, ...]:
    """Return the metric keys the evaluations of ``config`` log once per evaluated version: what ``eval.select`` may
    name (``server/eval/<metric>``, and ``client_eval/<metric>/<figure>`` with client-side evaluation on)."""
    central = tuple(f"server/eval/{name}" for name in config.metric_names)
    if not config.clients.enabled:
        return central
    figures = CLIENT_EVAL_FIGURES
    return (*central, *(f"client_eval/{name}/{figure}" for name in config.metric_names for figure in figures))


def parse_select(select: str, known: Iterable[str] | None = None) -> tuple[str, str]:
    """Return the metric key and the direction (``max`` or ``min``) of an ``eval.select`` value.

    Args:
        select: ``KEY:max`` or ``KEY:min``.
        known: The keys the run logs (None: any key; the config checked it already).

    Raises:
        ValueError: The key is not one of ``known``, or the direction is neither ``max`` nor ``min``.
    """
    key, colon, direction = select.rpartition(":")
    if not colon:
        key, direction = select, ""
    keys = tuple(known) if known is not None else (key,)
    if key not in keys:
        raise _FieldError(("eval", "select"), f"{key!r} is not a metric this run logs (one of: {', '.join(keys)})")
    if direction not in ("max", "min"):
        raise _FieldError(("eval", "select"), f"the direction must be ':max' or ':min', got {direction!r}")
    return key, direction


class StopConfig(_Section):
    """When the run ends: the first limit reached wins."""

    max_versions: int = Field(150, ge=1, description="Stop after this many model versions.")
    target_accuracy: float | None = Field(None, gt=0.0, le=1.0, description="Stop once reached.")
    max_simulated_s: float | None = Field(
        None, gt=0.0, description="Stop once this much simulated time has passed (None: no limit)."
    )
    max_wall_s: float | None = Field(
        None, gt=0.0, description="Stop once this much real time has passed (None: no limit)."
    )


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

    kind: Literal["auto", "thread", "vectorized", "ray"] = Field(
        "auto",
        description="Where training runs: worker threads, vectorized cohorts, Ray actors, or auto (cohorts when "
        "enough clients train at once and the model can be batched, threads otherwise).",
    )
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
    level: Literal["off", "basic", "full"] = Field(
        "basic",
        description="Training diagnostics: off (NaN/Inf checks only), basic (norms, drift, alerts) or full"
        " (per-layer gradients).",
    )

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


_TRACKING_SCHEMES = frozenset(
    {"sqlite", "file", "http", "https", "databricks", "databricks-uc", "uc", "postgresql", "mysql", "mssql"}
)


# The field `register` shadows the class's ABCMeta.register (never an instance's attribute): pydantic warns of it.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)

    class TrackingConfig(_Section):
        """Structured logs and MLflow."""

        enabled: bool = Field(True, description="Log the run to MLflow (off: console only).")
        uri: str | None = Field(None, description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or mlruns/).")
        experiment: str = Field(
            "flasync", min_length=1, description="The MLflow experiment the run goes to (made if missing)."
        )
        run_name: str | None = Field(
            None, description="The MLflow run's name (None: one made from the config, seed and time)."
        )
        log_level: Literal["debug", "info", "warning", "error"] = Field(
            "info",
            description="Lowest level of the log lines printed on the console (metrics are logged whatever it is).",
        )
        log_model: bool = Field(True, description="Also log the final model with mlflow.pytorch.")
        register: str | None = Field(
            None,
            description="Register the selected model (eval.select's best, else the last) in the MLflow Model Registry "
            "under this name, moving the alias 'champion' to it when its metric beats the champion's (None: off).",
        )
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
            description="Seconds between two samples of the system monitor (at least 0.1: each sample is a row of "
            "every system/ metric).",
        )

        @field_validator("register")
        @classmethod
        def _registry_name(cls, name: str | None) -> str | None:
            if name is None:
                return None
            # MLflow's rules for a registered model's name (mlflow.utils.validation and its file store), checked here so
            # that a refused name stops the run before training rather than after it.
            if not name.strip():
                raise _FieldError(("tracking", "register"), "the registered model's name is empty")
            refused = [c for c in ("/", ":", "%", "\\") if c in name]
            if refused or posixpath.normpath(name) != name or name in (".", ".."):
                why = f"contains {refused[0]!r}" if refused else "is not a plain path segment"
                message = f"MLflow refuses the registered model name {name!r}: it {why}"
                raise _FieldError(("tracking", "register"), message)
            return name

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

    enabled: bool = Field(
        False,
        description="Serve the run's tasks to remote clients over HTTP (flasync serve) instead of simulated clients.",
    )
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
