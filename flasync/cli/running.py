"""What `run` and `serve` share: the config (or resumed run), the signal handling and the summaries."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
from typing import TYPE_CHECKING

from flasync import tracking
from flasync.cli.shared import format_bytes
from flasync.config import RunConfig, apply_override, load_config, validate
from flasync.core.errors import CheckpointError, ConfigError
from flasync.runtime import tracked

if TYPE_CHECKING:
    from flasync.runtime import checkpoint
    from flasync.runtime.federation import Federation, RunSummary
    from flasync.tracking.spool import ReplayResult

SIGNAL_STATUS = {"SIGINT": 130, "SIGTERM": 143}


def stopped_status(reason: str) -> int:
    """Return the exit status of a run a stop request ended: 130 or 143 for a signal, 1 for anything else (the MLflow
    run could not be opened, the Ray cluster is gone)."""
    return SIGNAL_STATUS.get(reason, 1)


def resolve_resume(args: argparse.Namespace) -> tuple[RunConfig, checkpoint.ResumePoint, tracking.MlflowTracker]:
    """Fetch the run's checkpoint and config; only ``stop.*`` may be overridden."""
    if args.config:
        raise ConfigError(f"--resume takes the config from run {args.resume}'s checkpoint; drop {args.config}")
    if args.no_tracking:
        raise ConfigError("--resume continues an MLflow run; it cannot be combined with --no-tracking")
    if getattr(args, "register", None):
        raise ConfigError("--register: a resumed run keeps its checkpoint's config; name the model when it starts")
    for override in args.overrides:
        if not override.strip().startswith("stop."):
            raise ConfigError(f"--set {override!r}: with --resume only stop.* may change")
    uri = tracking.resolve_tracking_uri(args.tracking_uri)
    from flasync.runtime import checkpoint  # torch: imported once the command needs it

    run_id, replayed = _recover(args.resume, uri)
    try:
        config, state, status, tags, artifact = checkpoint.fetch(run_id, uri)
    except CheckpointError:
        if replayed is None:
            raise
        _end_killed(uri, run_id)  # its process is gone: the run stays as what it is, a killed one
        raise CheckpointError(
            f"run {args.resume} was killed before its first checkpoint: nothing to resume from; what it logged "
            f"({replayed.metrics} metric rows) is in MLflow run {run_id}, now KILLED; start the run again"
        ) from None
    if status == "FINISHED":
        raise ConfigError(f"MLflow run {run_id} already FINISHED; there is nothing to resume")
    if status == "RUNNING":
        from flasync.core.owner import HOST_TAG, PID_TAG, owner_alive

        alive = owner_alive(tags)
        if alive:
            raise ConfigError(
                f"MLflow run {run_id} is still running (process {tags[PID_TAG]} on {tags[HOST_TAG]}); "
                "stop it first (Ctrl-C writes a checkpoint) and resume it then"
            )
        if alive is None:
            raise ConfigError(
                f"MLflow run {run_id} is RUNNING and its process cannot be checked from here; if it is gone, "
                f"mark it failed with: flasync tracking mark-failed {run_id} --force"
            )
    data = config.model_dump(mode="json")
    data["tracking"] |= {"uri": uri, "system_metrics": not args.no_system_metrics}
    if args.log_level:
        data["tracking"]["log_level"] = args.log_level
    for override in args.overrides:
        apply_override(data, override)
    resumed = validate(data)
    return resumed, checkpoint.ResumePoint(run_id, state, artifact), tracked.mlflow_tracker(resumed)


def _end_killed(uri: str, run_id: str) -> None:
    """Mark a run replayed from the journal of a killed process KILLED (a store failing now leaves it RUNNING)."""
    import mlflow

    from flasync.tracking.store import bounded_http

    with contextlib.suppress(Exception), bounded_http(uri):
        mlflow.MlflowClient(tracking_uri=uri).set_terminated(run_id, "KILLED")


def _recover(resume_id: str, uri: str) -> tuple[str, ReplayResult | None]:
    """Return the MLflow run ``--resume`` names (a journal id or a run id), after replaying the journal a killed
    run left, saying so on stderr (see :func:`flasync.tracking.journal.recover`)."""
    from flasync.tracking.journal import recover
    from flasync.tracking.spool import SpoolError

    try:
        recovered = recover(resume_id, uri)
    except SpoolError as exc:
        raise ConfigError(f"--resume {resume_id}: {exc}") from None
    except Exception as exc:  # the store failed during the replay: its progress is kept for the next try
        reason = tracking.redact_uri(str(exc)).splitlines()[0][:300] if str(exc) else type(exc).__name__
        raise ConfigError(f"--resume {resume_id}: its journal could not be replayed into {uri}: {reason}") from None
    replayed = recovered.replayed
    if replayed is not None:
        print(
            f"flasync: run {resume_id}'s journal {recovered.journal} replayed into MLflow run {recovered.run_id} "
            f"({replayed.metrics} metric rows, {replayed.artifacts} checkpoints)",
            file=sys.stderr,
            flush=True,
        )
    return recovered.run_id, replayed


def resolve(args: argparse.Namespace) -> RunConfig:
    """Load the run's config from its file, ``--set`` and the tracking and logging flags."""
    overrides = list(args.overrides)
    if args.tracking_uri:
        overrides.append(f"tracking.uri={args.tracking_uri}")
    if args.experiment:
        overrides.append(f"tracking.experiment={args.experiment}")
    if args.run_name:
        overrides.append(f"tracking.run_name={args.run_name}")
    if getattr(args, "register", None) is not None:
        overrides.append(f"tracking.register={args.register}")
    if args.no_tracking:
        overrides.append("tracking.enabled=false")
    if args.log_level:
        overrides.append(f"tracking.log_level={args.log_level}")
    config = load_config(args.config, overrides)
    if not args.no_system_metrics and config.tracking.enabled:
        config = config.model_copy(update={"tracking": config.tracking.model_copy(update={"system_metrics": True})})
    return config


def print_summary(
    summary: RunSummary,
    config: RunConfig,
    ui_command: str | None,
    ui_url: str | None = None,
    *,
    resumed: bool = False,
    registered: str | None = None,
) -> None:
    """Print a finished run's summary: accuracy, updates, versions, time, bytes, weights hash, the best version,
    the MLflow run and what was registered (``registered``: the registry's one-line account)."""
    # A resumed run's counts are the whole run's, its wall seconds and rate this process's.
    here = " in this process" if resumed else ""
    lines = [
        "",
        f"flasync run finished ({summary.stop_reason})",
        f"  accuracy        {summary.accuracy:.4f}   loss {summary.loss:.4f}"
        if math.isfinite(summary.accuracy)
        else f"  loss            {summary.loss:.4f}",
        f"  updates         {summary.updates_accepted} accepted, {summary.updates_dropped} dropped, "
        f"{summary.updates_failed} failed ({summary.updates_per_s:.1f}/s{here})",
        f"  versions        {summary.versions}   staleness mean {summary.staleness_mean:.2f}, "
        f"max {summary.staleness_max}",
        f"  time            {time_line(summary, config.clock, resumed=resumed)}",
        f"  bytes           up {format_bytes(summary.upload_bytes)}, down {format_bytes(summary.download_bytes)}",
        f"  weights sha256  {summary.weights_sha256}",
    ]
    if summary.best_metric:
        best = "none evaluated" if summary.best_version is None else f"version {summary.best_version}"
        value = f" ({summary.best_value:.4f})" if summary.best_version is not None else ""
        lines.append(f"  best            {best} by {summary.best_metric}{value}")
    if math.isfinite(summary.privacy_epsilon):
        lines.append(f"  privacy         epsilon {summary.privacy_epsilon:.3g} at delta {config.privacy.delta:g}")
    if summary.peak_rss_bytes:
        profile = f"  profile         peak RSS {format_bytes(summary.peak_rss_bytes)}, alerts {summary.alerts}"
        if summary.stragglers:
            profile += f", server idle {100 * summary.server_idle_fraction:.0f}%, slowest clients "
            profile += ", ".join(str(c) for c in summary.stragglers[:3])
        lines.append(profile)
    if summary.run_id:
        lines.append(f"  MLflow run      {summary.run_id} (experiment {config.tracking.experiment!r})")
    if registered:
        lines.append(f"  registry        {registered}")
    if ui_command:
        lines.append(f"  open the UI     {ui_command}")
        if ui_url:
            lines.append(f"  then browse     {ui_url}")
    if summary.run_id and summary.stragglers:
        lines.append(f"  full profile    flasync report {summary.run_id}")
    print("\n".join(lines), flush=True)


def time_line(summary: RunSummary, clock: str, *, resumed: bool = False) -> str:
    """Return the summary's time line, naming the clock the run ran on: the wall seconds this process ran and, on the
    virtual clock, the simulated seconds; on the wall clock, the run's own clock is the wall clock (a resumed run's
    reads on from its checkpoint, so it says the seconds since the run first started); then the real seconds to the
    first accepted update."""
    here = " in this process" if resumed else ""
    if clock == "virtual":
        line = f"wall {summary.wall_s:.2f} s{here}, simulated {summary.simulated_s:.1f} s (virtual clock)"
    else:
        line = f"wall {summary.wall_s:.2f} s{here} (wall clock"
        line += f", {summary.simulated_s:.1f} s since the run started)" if resumed else ")"
    if math.isfinite(summary.first_update_s):
        line += f", first update {summary.first_update_s:.3f} s"
    return line


def _stopping(config: RunConfig) -> str:
    """Say what a first signal's clean stop does with ``config``: no MLflow run nor checkpoint without tracking."""
    if not config.tracking.enabled:
        return "stopping (tracking is off: no checkpoint)"
    saved = "checkpoint, " if config.checkpoint.on_interrupt else ""
    return f"stopping ({saved}flush, MLflow run KILLED)"


def no_checkpoint(config: RunConfig) -> str:
    """What a second signal's message adds: that no checkpoint was written (when one could have been)."""
    return "; no checkpoint written" if config.tracking.enabled else ""


def print_partial(summary: RunSummary | None, why: str) -> None:
    """Print a stopped run's partial summary on one line (nothing when it stopped before it started)."""
    if summary is None:
        return
    if math.isfinite(summary.accuracy):
        evaluated = f"accuracy {summary.accuracy:.4f}, loss {summary.loss:.4f}"
    elif math.isfinite(summary.loss):
        evaluated = f"loss {summary.loss:.4f}"
    else:
        evaluated = "not evaluated yet"
    print(
        f"flasync run stopped ({why}) at version {summary.versions}: {evaluated}; {summary.updates_accepted} updates "
        f"accepted, {summary.updates_dropped} dropped, {summary.updates_failed} failed; wall {summary.wall_s:.1f} s",
        flush=True,
    )


async def run_with_signals(federation: Federation, received: list[str]) -> RunSummary:
    """Run ``federation``; the first SIGINT/SIGTERM asks it to stop cleanly, a second one cancels it."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_signal(name: str) -> None:
        received.append(name)
        if len(received) > 1:
            print(f"flasync: {name} received again; stopping at once", file=sys.stderr, flush=True)
            task.cancel()
        else:
            print(f"flasync: {name} received; {_stopping(federation.config)}", file=sys.stderr, flush=True)
            federation.request_stop(name)

    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - not on the main thread / Windows
            pass
    try:
        return await federation.run()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
