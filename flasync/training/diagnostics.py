"""Training diagnostics: NaN/Inf checks, update and gradient norms, and the alerts they raise.

Two halves:

* :class:`TrainingDiagnostics` runs in the training threads. It wraps :func:`flasync.training.local.train`, measures
what
  the configured level asks for (NaN/Inf checks always; the update norm from ``basic``; per-layer gradient-norm
  statistics of every step at ``full``), optionally records a ``torch.profiler`` trace of the first few calls, and
  returns a :class:`~flasync.core.events.TaskDiagnosis` of plain numbers that travels on the bus.
* :class:`AlertMonitor` runs on the event loop. It reads events (and, at ``basic`` and above, the server's weights
  when a version is produced) and decides which alerts to raise; the decisions are pure functions
  (:func:`task_alerts`, :func:`is_diverging`) so they are testable without a run.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import statistics
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, cast

import torch
from torch import nn

from flasync.codecs.validation import finite_norm
from flasync.config import DiagnosticsConfig
from flasync.core.errors import TrainingError
from flasync.core.events import (
    Aggregated,
    ClientFailed,
    Evaluated,
    TaskDiagnosis,
    UpdateRejected,
    UpdateUploaded,
)
from flasync.core.quantiles import StreamSummary, Thinned
from flasync.training.local import FlatModel, LocalResult, LocalTraining, flat_layout, train

if TYPE_CHECKING:
    from flasync.core.snapshots import ModelSnapshot

__all__ = [
    "Alert",
    "AlertMonitor",
    "DivergedTraining",
    "LayerLayout",
    "Level",
    "TrainingDiagnostics",
    "is_diverging",
    "layer_layout",
    "task_alerts",
]

Level = Literal["off", "basic", "full"]


@dataclass(frozen=True, slots=True)
class LayerLayout:
    """Names and lengths of the trainable tensors of a model, in the order of the flat vector."""

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    num_params: int

    @property
    def num_trainable(self) -> int:
        """Return the number of trainable elements (the gradient's length)."""
        return sum(self.lengths)


def layer_layout(module: nn.Module) -> LayerLayout:
    """Return the layout of ``module``'s parameters (and the total length with floating-point buffers)."""
    named, floating = flat_layout(module)
    buffers = sum(b.numel() for _, b in floating)
    lengths = tuple(p.numel() for _, p in named)
    return LayerLayout(tuple(n for n, _ in named), lengths, sum(lengths) + buffers)


class DivergedTraining(TrainingError):
    """Local training produced a non-finite update; :attr:`diagnosis` says what was found."""

    def __init__(self, message: str, diagnosis: TaskDiagnosis) -> None:
        """Keep the diagnosis with the message."""
        super().__init__(message)
        self.diagnosis = diagnosis


class _GradientStats:
    """Per-layer gradient norms accumulated over the steps of one training call (on the gradient's device)."""

    def __init__(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths
        self.total: torch.Tensor | None = None
        self.peak: torch.Tensor | None = None
        self.steps = 0

    def __call__(self, grad: torch.Tensor) -> None:
        with torch.no_grad():
            norms = torch.segment_reduce(grad * grad, "sum", lengths=self.lengths).sqrt_()
            if self.total is None or self.peak is None:
                self.total, self.peak = norms.clone(), norms
            else:
                self.total.add_(norms)
                self.peak = torch.maximum(self.peak, norms)
        self.steps += 1


class TrainingDiagnostics:
    """The training-thread half of diagnostics (thread-safe; one per run).

    Args:
        level: ``off``, ``basic`` or ``full``.
        layout: The model's layout (needed at ``full``).
        profile_tasks: Trace the first N training calls with ``torch.profiler``.
        trace_dir: Where traces go (required when ``profile_tasks > 0``).
    """

    def __init__(
        self,
        level: Level = "off",
        layout: LayerLayout | None = None,
        *,
        profile_tasks: int = 0,
        trace_dir: str | None = None,
    ) -> None:
        """Remember the settings; nothing is measured yet."""
        if level == "full" and layout is None:
            raise ValueError("level 'full' needs the model's layer layout")
        if profile_tasks and trace_dir is None:
            raise ValueError("profile_tasks needs a trace_dir")
        self.level = level
        self.layout = layout
        self._lengths = torch.tensor(layout.lengths, dtype=torch.int64) if layout is not None else None
        self._profile_left = profile_tasks
        self.trace_dir = trace_dir
        self._lock = threading.Lock()
        self._profiler_lock = threading.Lock()
        self.traces: list[str] = []

    def _claim_trace(self) -> bool:
        with self._lock:
            if self._profile_left <= 0:
                return False
            self._profile_left -= 1
            return True

    def train(
        self,
        model: FlatModel,
        base: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        cfg: LocalTraining,
        generator: torch.Generator,
        *,
        task_id: int = 0,
        train_fn: Callable[..., LocalResult] = train,
        indices: torch.Tensor | None = None,
        correction: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[LocalResult, TaskDiagnosis]:
        """Run ``train_fn`` (:func:`flasync.training.local.train`) and diagnose the result (see the module docstring).

        ``indices``: train on those rows of ``x`` and ``y``; ``correction``: added to every gradient; ``mask``:
        multiplies it (see :func:`~flasync.training.local.train`).
        """
        extra: dict[str, torch.Tensor] = {} if correction is None else {"correction": correction}
        if mask is not None:
            extra["mask"] = mask
        stats: _GradientStats | None = None
        if self.level == "full" and self._lengths is not None and self._lengths.numel():
            stats = _GradientStats(self._lengths.to(model.grad.device))
        if self._claim_trace():
            assert self.trace_dir is not None
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if model.flat.is_cuda:
                activities.append(ProfilerActivity.CUDA)
            # One profiler at a time: torch's profiler is process-wide.
            with self._profiler_lock, profile(activities=activities, record_shapes=True) as prof:
                result = train_fn(model, base, x, y, cfg, generator, on_backward=stats, indices=indices, **extra)
            path = os.path.join(self.trace_dir, f"train-task-{task_id}.json")
            prof.export_chrome_trace(path)
            with self._lock:
                self.traces.append(path)
        else:
            result = train_fn(model, base, x, y, cfg, generator, on_backward=stats, indices=indices, **extra)
        return result, self.diagnose(result, stats)

    def diagnose(self, result: LocalResult, stats: _GradientStats | None = None) -> TaskDiagnosis:
        """Return the diagnosis of one training result at this object's level."""
        # NaN: the delta has a NaN or Inf element (a norm the trainer gave is finite, so every element is).
        norm = result.update_norm if result.update_norm is not None else finite_norm(result.delta)
        update_finite = not math.isnan(norm)
        loss_finite = math.isfinite(result.loss)
        if self.level == "off":
            return TaskDiagnosis(loss_finite=loss_finite, update_finite=update_finite)
        if stats is None or stats.total is None or stats.peak is None:
            return TaskDiagnosis(loss_finite=loss_finite, update_finite=update_finite, update_norm=norm)
        mean = (stats.total / max(stats.steps, 1)).tolist()
        peak = stats.peak.tolist()
        grad_finite = all(math.isfinite(v) for v in peak)
        return TaskDiagnosis(
            loss_finite=loss_finite,
            update_finite=update_finite,
            grad_finite=grad_finite,
            update_norm=norm,
            grad_norm_max=math.sqrt(sum(v * v for v in peak)) if grad_finite else math.inf,
            layer_grad_norm_mean=tuple(mean),
            layer_grad_norm_max=tuple(peak),
        )


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert decided by a pure check, before it is raised (logged, published, tagged)."""

    kind: str
    message: str
    value: float
    client_id: int | None = None


def task_alerts(
    diagnosis: TaskDiagnosis,
    client_id: int,
    *,
    layer_names: tuple[str, ...],
    recent_update_norms: Sequence[float],
    config: DiagnosticsConfig,
) -> list[Alert]:
    """Return the alerts one task's diagnosis raises.

    * ``nan``: the loss, the gradients or the update hold NaN or Inf;
    * ``exploding_update``: the update norm exceeds ``exploding_factor`` times the median of ``recent_update_norms``
      (at least 5 of them);
    * ``exploding_gradient`` / ``vanishing_gradient``: a layer's largest gradient norm exceeds ``grad_norm_max``,
      or its mean gradient norm is below ``grad_norm_min`` (level ``full`` only).
    """
    alerts: list[Alert] = []
    if not (diagnosis.loss_finite and diagnosis.grad_finite and diagnosis.update_finite):
        where = [
            name
            for name, ok in (
                ("loss", diagnosis.loss_finite),
                ("gradients", diagnosis.grad_finite),
                ("update", diagnosis.update_finite),
            )
            if not ok
        ]
        alerts.append(Alert("nan", f"client {client_id}: NaN/Inf in {', '.join(where)}", math.nan, client_id))
        return alerts
    norm = diagnosis.update_norm
    # The median is at least the smallest norm: an update within the factor of that one needs no median.
    if (
        math.isfinite(norm)
        and len(recent_update_norms) >= 5
        and norm > config.exploding_factor * min(recent_update_norms)
    ):
        median = statistics.median(recent_update_norms)
        if median > 0 and norm > config.exploding_factor * median:
            alerts.append(
                Alert(
                    "exploding_update",
                    f"client {client_id}: update norm {norm:.3g} is {norm / median:.1f}x the recent median",
                    norm,
                    client_id,
                )
            )
    for name, peak in zip(layer_names, diagnosis.layer_grad_norm_max, strict=False):
        if peak > config.grad_norm_max:
            alerts.append(
                Alert(
                    "exploding_gradient",
                    f"client {client_id}: gradient norm of {name} reached {peak:.3g} > {config.grad_norm_max:g}",
                    peak,
                    client_id,
                )
            )
            break
    for name, mean in zip(layer_names, diagnosis.layer_grad_norm_mean, strict=False):
        if mean < config.grad_norm_min:
            alerts.append(
                Alert(
                    "vanishing_gradient",
                    f"client {client_id}: mean gradient norm of {name} is {mean:.3g} < {config.grad_norm_min:g}",
                    mean,
                    client_id,
                )
            )
            break
    return alerts


def is_diverging(losses: Sequence[float], *, window: int, tolerance: float, best: float | None = None) -> bool:
    """Tell whether a loss series is diverging: it rose in each of its last ``window`` steps (or became NaN/Inf)
    and its last value is more than ``tolerance`` (a fraction) above the best value seen.

    ``best`` is the lowest finite loss of the whole series when ``losses`` holds only its tail (None: the lowest in
    ``losses``)."""
    if not losses:
        return False
    if not math.isfinite(losses[-1]):
        return True
    if len(losses) < window + 1:
        return False
    tail = list(losses)[-(window + 1) :]
    rising = all(b > a for a, b in itertools.pairwise(tail))
    if best is None:
        best = min(v for v in losses if math.isfinite(v))
    return rising and tail[-1] > best * (1.0 + tolerance) + 1e-12


_NORMS_KEPT = 4096  # update norms kept for quantiles (a uniform sample beyond)


@dataclass(slots=True)
class _Series:
    """What the monitor keeps for the profile: bounded however long the run."""

    norms: StreamSummary
    weights: Thinned[tuple[int, float, float]] = field(default_factory=Thinned)
    update_norms: Thinned[tuple[int, int, float]] = field(default_factory=Thinned)
    layer_mean_sum: list[float] = field(default_factory=list)
    layer_max: list[float] = field(default_factory=list)
    layer_tasks: int = 0


class AlertMonitor:
    """The event-loop half of diagnostics: turn events into alerts and keep the diagnostic series.

    Args:
        config: The diagnostics settings.
        layer_names: Names of the model's trainable tensors (for per-layer statistics).
        model: Returns the server's latest published model (None: none yet); read on each new version at ``basic``+
            (events are read in batches a little after they are published, so the server may have moved on: the
            version recorded is the one the weights belong to, and versions between batches are skipped). Its
            ``exact`` weights are never changed after it is published, so the monitor keeps them, not a copy, as the
            next step's base, and takes its ``norm`` where the server measured it.
        initial: The initial weights (for drift).
        rng: Chooses which update norms the quantiles keep once there are too many (seeded by default).
        step_cause: What a too-large server step most likely comes from, named in its alert (the server's learning
            rate; under differential privacy, the noise).

    Everything it keeps is bounded: the update norms as a :class:`~flasync.core.quantiles.StreamSummary` and thinned
    series (:class:`~flasync.core.quantiles.Thinned`), the losses as the divergence window and the best loss.
    """

    READS: tuple[type, ...] = (UpdateUploaded, ClientFailed, UpdateRejected, Evaluated, Aggregated)
    """The events :meth:`observe` reads: it returns no alert for any other, and keeps nothing of it."""

    def __init__(
        self,
        config: DiagnosticsConfig,
        *,
        layer_names: tuple[str, ...] = (),
        model: Callable[[], ModelSnapshot | None] | None = None,
        initial: torch.Tensor | None = None,
        rng: random.Random | None = None,
        step_cause: str = "server.optimizer.lr?",
    ) -> None:
        """Start with no alerts."""
        self.config = config
        self.step_cause = step_cause
        self.layer_names = layer_names
        self._model = model
        self._initial = initial
        self._recent: deque[float] = deque(maxlen=50)
        self._losses: deque[float] = deque(maxlen=config.divergence_window + 1)
        self._best_loss = math.inf
        self._weights_version: int | None = None
        self._diverging = False
        self._previous: torch.Tensor | None = None
        self._previous_norm = math.nan  # ||_previous||
        self.counts: Counter[str] = Counter()
        self.series = _Series(StreamSummary(_NORMS_KEPT, rng if rng is not None else random.Random(0)))

    def observe(self, event: object, version: int) -> list[Alert]:
        """Read one event; return the alerts it raises (``version``: the latest version the monitor saw)."""
        cfg = self.config
        if isinstance(event, UpdateUploaded):
            if event.diagnosis is None:
                return []
            diagnosis = event.diagnosis
            alerts = task_alerts(
                diagnosis,
                int(event.client_id),
                layer_names=self.layer_names,
                recent_update_norms=self._recent,
                config=cfg,
            )
            if math.isfinite(diagnosis.update_norm):
                self._recent.append(diagnosis.update_norm)
                self.series.norms.add(diagnosis.update_norm)
                self.series.update_norms.add((version, int(event.client_id), diagnosis.update_norm))
            self._fold_layers(diagnosis)
            return alerts
        if isinstance(event, ClientFailed):
            if event.diagnosis is None:
                return []
            return task_alerts(
                event.diagnosis, int(event.client_id), layer_names=(), recent_update_norms=[], config=cfg
            )
        if isinstance(event, UpdateRejected) and event.reason == "non_finite":
            return [
                Alert("nan", f"client {event.client_id}: update rejected: {event.detail}", math.nan, event.client_id)
            ]
        if isinstance(event, Evaluated):
            self._losses.append(event.loss)
            if not math.isfinite(event.loss):
                return [Alert("nan", f"server loss of version {event.version} is {event.loss}", event.loss)]
            best = self._best_loss = min(self._best_loss, event.loss)
            diverging = is_diverging(
                self._losses, window=cfg.divergence_window, tolerance=cfg.divergence_tolerance, best=best
            )
            alert = diverging and not self._diverging
            self._diverging = diverging
            if alert:
                return [
                    Alert(
                        "divergence",
                        f"server loss rose {cfg.divergence_window} evaluations in a row to {event.loss:.4g} "
                        f"(best {best:.4g})",
                        event.loss,
                    )
                ]
            return []
        if isinstance(event, Aggregated) and self._model is not None and cfg.level != "off":
            snapshot = self._model()
            return [] if snapshot is None else self._observe_weights(snapshot)
        return []

    def observe_many(self, events: Sequence[object], version: int) -> list[tuple[int, Alert]]:
        """Read the events of one batch (of one class) in order; return the alerts they raise, in order, each with
        the index of the event that raised it: what :meth:`observe` of each returns.

        Uploads are read a run at a time: the diagnoses of a run that hold no NaN/Inf and no per-layer figures can
        only raise ``exploding_update``, and none can when every finite norm among them is within the factor of the
        smallest norm the recent window holds at any point of the run; then the run's norms are folded in at once.
        """
        if not events or not isinstance(events[0], UpdateUploaded):
            return [(index, alert) for index, event in enumerate(events) for alert in self.observe(event, version)]
        uploads = cast("Sequence[UpdateUploaded]", events)
        diagnoses = [upload.diagnosis for upload in uploads]
        # Plain: a diagnosis without NaN/Inf and without per-layer figures, whose norm alone can raise an alert.
        plain = [
            d is not None
            and d.loss_finite
            and d.grad_finite
            and d.update_finite
            and not d.layer_grad_norm_max
            and not d.layer_grad_norm_mean
            for d in diagnoses
        ]
        found: list[tuple[int, Alert]] = []
        start = 0
        for is_plain, run in itertools.groupby(plain):
            end = start + sum(1 for _ in run)
            quiet = is_plain and self._uploads_quiet(
                uploads[start:end], cast("list[TaskDiagnosis]", diagnoses[start:end]), version
            )
            if not quiet:
                for index in range(start, end):
                    found.extend((index, alert) for alert in self.observe(uploads[index], version))
            start = end
        return found

    def _uploads_quiet(
        self, uploads: Sequence[UpdateUploaded], diagnoses: Sequence[TaskDiagnosis], version: int
    ) -> bool:
        """Fold in plain uploads (their ``diagnoses`` hold no NaN/Inf and no per-layer figures) that raise no alert
        and return True; else change nothing and return False.

        An upload alerts when its norm exceeds ``exploding_factor`` times the smallest of the recent norms, which is
        never below the smallest of the window now and the run's norms together (and the factor is positive).
        """
        norms = [diagnosis.update_norm for diagnosis in diagnoses]
        finite = list(filter(math.isfinite, norms))
        if not finite:
            return True
        recent = self._recent
        floor = min(min(recent), min(finite)) if recent else min(finite)
        if len(recent) + len(finite) > 5 and max(finite) > self.config.exploding_factor * floor:
            return False
        recent.extend(finite)
        series = self.series
        series.norms.add_many(finite)
        series.update_norms.add_many(
            [
                (version, int(upload.client_id), norm)
                for upload, norm in zip(uploads, norms, strict=True)
                if math.isfinite(norm)
            ]
        )
        return True

    def _observe_weights(self, snapshot: ModelSnapshot) -> list[Alert]:
        """Keep the norm and drift of the server's weights of ``snapshot``; alert on NaN/Inf or a too-large step."""
        now = int(snapshot.version)
        if self._weights_version == now:
            return []  # several versions were read in one batch: the weights are those of the latest
        self._weights_version = now
        weights = snapshot.exact
        if weights.requires_grad:
            weights = weights.detach()
        norm = snapshot.norm if snapshot.norm is not None else float(torch.linalg.vector_norm(weights))
        # torch.dist(a, b) is torch.linalg.vector_norm(a - b), bit for bit, without the difference's tensor.
        drift = float(torch.dist(weights, self._initial)) if self._initial is not None else math.nan
        self.series.weights.add((now, norm, drift))
        if not math.isfinite(norm):
            return [Alert("nan", f"server weights of version {now} hold NaN/Inf", norm)]
        return self._step_alerts(now, weights, norm)

    def _step_alerts(self, version: int, weights: torch.Tensor, norm: float) -> list[Alert]:
        """Alert when one version moves the weights by more than ``step_ratio_max`` of their norm.

        Healthy runs move the model by a few percent of its norm per version; a server step that large means a
        learning rate (or an update) far too big, and the model is being destroyed between evaluations.

        Args:
            version: The version of ``weights``.
            weights: The server's weights (not in an autograd graph; never changed later: kept as the next base).
            norm: ``||weights||``, kept as the next step's base.
        """
        previous, base = self._previous, self._previous_norm
        self._previous, self._previous_norm = weights, norm
        if previous is None or previous.shape != weights.shape or previous.dtype != weights.dtype:  # start afresh
            return []
        ratio = float(torch.dist(weights, previous)) / max(base, 1e-12)
        limit = self.config.step_ratio_max
        if not ratio > limit:
            return []
        return [
            Alert(
                "step_ratio",
                f"version {version} moved the weights by {ratio:.3g} of their norm (> {limit:g}): the server step is "
                f"too large ({self.step_cause})",
                ratio,
            )
        ]

    def _fold_layers(self, diagnosis: TaskDiagnosis) -> None:
        mean, peak = diagnosis.layer_grad_norm_mean, diagnosis.layer_grad_norm_max
        if not mean:
            return
        series = self.series
        if not series.layer_mean_sum:
            series.layer_mean_sum = [0.0] * len(mean)
            series.layer_max = [0.0] * len(peak)
        series.layer_mean_sum = [a + b for a, b in zip(series.layer_mean_sum, mean, strict=False)]
        series.layer_max = [max(a, b) for a, b in zip(series.layer_max, peak, strict=False)]
        series.layer_tasks += 1

    def record(self, alert: Alert) -> int:
        """Count a raised alert; return how many of its kind the run has raised."""
        self.counts[alert.kind] += 1
        return self.counts[alert.kind]

    def summary(self) -> dict[str, object]:
        """Return the diagnostic series and alert counts for ``profile.json``."""
        series = self.series
        norms = series.norms
        layers = None
        if series.layer_tasks:
            layers = [
                {"name": name, "grad_norm_mean": total / series.layer_tasks, "grad_norm_max": peak}
                for name, total, peak in zip(self.layer_names, series.layer_mean_sum, series.layer_max, strict=False)
            ]
        return {
            "level": self.config.level,
            "alerts": dict(self.counts),
            "update_norm": (
                {
                    "p10": norms.quantile(0.1),
                    "p50": norms.quantile(0.5),
                    "p90": norms.quantile(0.9),
                    "max": norms.max,
                    "count": float(norms.count),
                }
                if norms.count
                else None
            ),
            "update_norms": [{"version": v, "client_id": c, "norm": n} for v, c, n in series.update_norms.items()],
            "weights": [{"version": v, "norm": n, "drift": d} for v, n, d in series.weights.items()],
            "layers": layers,
        }
