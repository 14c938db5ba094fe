"""The run's profile: the profiler and alert monitor its diagnostics config asks for, and the profile built from
their records when it ends.

A run may live in segments: started, stopped (SIGINT/SIGTERM: its MLflow run ends ``KILLED``), resumed from its
checkpoint into the same MLflow run, and so on. Each segment profiles what it did, whether it finished or was stopped:

* its ``profile/version/*`` series are logged at the versions it made, into the run's one series per key (a resumed
  segment's first versions, made again from the checkpoint, keep the values the stopped segment logged: a resumed
  tracker writes each step once), so the series of a stopped and resumed run cover every version, as an uninterrupted
  run's do;
* its ``profile.json`` carries a ``segment`` entry (the versions it covers, whether it was stopped) and goes to
  :func:`profile_artifact`: ``profile.json`` for the segment that finished the run, as for a run never stopped, and
  ``profile-v<first>-v<last>.json`` for a stopped one, so a resumed segment never overwrites an earlier one's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from flasync import codecs, tracking
from flasync.config import RunConfig
from flasync.core.bus import EventBus
from flasync.observe.profiling import (
    Instrumentation,
    Profiler,
    build_profile,
    gpu_status,
    headline,
    peak_rss_bytes,
    torch_memory,
)
from flasync.observe.summary import RunSummary
from flasync.runtime.naming import run_mode
from flasync.server import Server
from flasync.training.diagnostics import AlertMonitor, LayerLayout
from flasync.training.executors.threads import TrainingExecutor

__all__ = ["finish_profile", "instrumentation", "profile_artifact", "segment", "tracking_health"]

# Fields of a profile row that are no metric series of their own: a constant 1, and the figures the server's
# ``server.version`` line already logs at the same steps (``server/version/updates``, ...). profile.json keeps them.
_PROFILE_ROW_NOT_LOGGED = frozenset({"versions", "updates", "aggregate_s", "simulated_s", "staleness_mean"})


def instrumentation(
    config: RunConfig, bus: EventBus, server: Server, layout: LayerLayout | None, log: Any, now: Callable[[], float]
) -> Instrumentation | None:
    """Build the profiler and alert monitor the diagnostics config asks for (None: neither)."""
    dcfg = config.diagnostics
    if not dcfg.profile and dcfg.level == "off":
        return None
    return Instrumentation(
        bus,
        profiler=Profiler(run_mode(config)) if dcfg.profile else None,
        monitor=AlertMonitor(
            dcfg,
            layer_names=layout.names if layout is not None else (),
            model=lambda: server.registry.current,
            initial=server.weights.clone() if dcfg.level != "off" else None,
            step_cause=(
                "the privacy noise: a smaller privacy.noise_multiplier or more clients per version?"
                if config.privacy.enabled
                else "server.optimizer.lr?"
            ),
        ),
        log=log,
        now=now,
    )


def segment(*, first_version: int, last_version: int, stopped: bool) -> dict[str, Any]:
    """Return a profile's ``segment`` entry: the model versions it covers, ``(first_version, last_version]``, and
    whether the segment was stopped (its run then ends ``KILLED``, to be resumed) rather than finished."""
    return {"first_version": first_version, "last_version": last_version, "stopped": stopped}


def tracking_health(tracker: tracking.Tracker) -> dict[str, int]:
    """Return the profile's ``tracking`` entry: the metric rows lost so far (written neither to MLflow nor to the
    run's journal; the summary and the tag ``flasync.metric_rows_lost`` have the count at the run's end) and those the
    writer's backlog spilled to the journal (sent to the run at its end); zeros for an untracked run."""
    if not isinstance(tracker, tracking.MlflowTracker):
        return {"metric_rows_lost": 0, "metric_rows_spilled": 0}
    return {"metric_rows_lost": tracker.metric_rows_lost, "metric_rows_spilled": tracker.metric_rows_spilled}


def profile_artifact(profile: Mapping[str, Any]) -> str:
    """Return the artifact a segment's profile goes to: ``profile.json`` unless it was stopped, then
    ``profile-v<first>-v<last>.json`` (see the module's docstring)."""
    part = profile.get("segment")
    if not isinstance(part, Mapping) or not part.get("stopped"):
        return "profile.json"
    return f"profile-v{int(part['first_version'])}-v{int(part['last_version'])}.json"


def finish_profile(
    config: RunConfig,
    summary: RunSummary,
    instrumentation: Instrumentation,
    server: Server,
    executor: TrainingExecutor,
    layout: LayerLayout | None,
    residual_memory: Mapping[str, int],
    log: Any,
    weights: torch.Tensor | None,
) -> tuple[RunSummary, dict[str, Any] | None]:
    """Build the profile from the instrumentation's records, log its headline metrics, extend the summary; return
    the summary and the profile (None without a profiler)."""
    monitor = instrumentation.monitor
    alerts = dict(monitor.counts) if monitor is not None else {}
    rss = peak_rss_bytes()
    summary = replace(summary, peak_rss_bytes=rss, alerts=sum(alerts.values()))
    if instrumentation.profiler is None:
        return summary, None
    num_params = weights.numel() if weights is not None else 0
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
        instrumentation.profiler.finish(),
        mode=run_mode(config),
        num_params=num_params,
        dense_bytes=codecs.HEADER.size + 4 * num_params,
        stragglers=config.diagnostics.stragglers,
        memory=memory,
        diagnostics=monitor.summary() if monitor is not None else None,
    )
    profile["alerts"] = alerts
    if summary.tiers:
        profile["communication"]["edge_tiers"] = dict(summary.tiers)
    profile["layers"] = list(layout.names) if layout is not None else []
    if layout is not None and weights is not None and layout.num_trainable <= weights.numel():
        parts = torch.split(weights[: layout.num_trainable], list(layout.lengths))
        profile["diagnostics"]["layer_weight_norms"] = {
            name: float(torch.linalg.vector_norm(part)) for name, part in zip(layout.names, parts, strict=True)
        }
    # Single figures at the run's end: profile.json and `flasync report` hold them, not one-point metric series.
    log.debug("profile", step=summary.versions, **headline(profile), metrics=False)
    for row in profile["time"]["per_version"]:
        fields = {k: v for k, v in row.items() if k not in _PROFILE_ROW_NOT_LOGGED}
        log.debug("profile.version", step=int(row["version"]), **fields)
    summary = replace(
        summary,
        stragglers=tuple(int(row["client_id"]) for row in profile["clients"]["stragglers"]),
        server_idle_fraction=float(profile["time"]["server_idle_fraction"]),
    )
    return summary, profile
