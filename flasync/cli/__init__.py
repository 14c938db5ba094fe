"""The ``flasync`` command line: ``run``, ``report``, ``compare``, ``serve`` and ``client``.

Exit status: 0 on success, 2 for bad input (config file, ``--set``, flags, data, model, unknown run or experiment,
a run to resume) with a one-line message on stderr, 1 for an unexpected failure, 130 when interrupted by SIGINT
(Ctrl-C) and 143 by SIGTERM.

The first SIGINT or SIGTERM asks the run to stop: it finishes the message at hand, cancels the clients, flushes
every metric, writes a checkpoint and ends the MLflow run as ``KILLED`` (with tracking on); ``flasync run --resume
RUN_ID`` continues it. A second signal stops at once (still ``KILLED``, no checkpoint). Either way the partial
summary is printed on one line.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import structlog
import yaml

from flasync import tracking
from flasync._version import __version__
from flasync.config import RunConfig, apply_override, load_config, validate
from flasync.core.errors import ConfigError, FlasyncError, RunInterrupted
from flasync.core.loops import run_loop
from flasync.runtime import tracked

if TYPE_CHECKING:
    from flasync.runtime import checkpoint
    from flasync.runtime.federation import Federation, RunSummary
    from flasync.tracking.progress import ProgressBar

__all__ = ["console", "main"]

_TRACKING_URI_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db)"


class _UsageError(Exception):
    """A malformed command line."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit 2."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing the usage block."""
        raise _UsageError(f"{message} (see {self.prog} --help)")


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="flasync",
        description="Asynchronous federated learning: FedBuff, FedAsync and FedAvg with virtual time and MLflow.",
    )
    parser.add_argument("--version", action="version", version=f"flasync {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = commands.add_parser(
        "run",
        help="run an experiment (default: digits, 100 clients, FedBuff on the virtual clock)",
        description="Run one federated experiment and log it to MLflow.",
    )
    run.add_argument("config", nargs="?", help="a .toml or .yaml run config (default: the built-in experiment)")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override one field, e.g. --set server.buffer_size=20 (repeatable)",
    )
    run.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    run.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue an interrupted MLflow run from its latest checkpoint (its config is used; --set stop.* only)",
    )
    run.add_argument("--tracking-uri", help=_TRACKING_URI_HELP)
    run.add_argument(
        "--experiment", help="MLflow experiment name (default: the config's tracking.experiment, 'flasync' unless set)"
    )
    run.add_argument("--run-name", help="MLflow run name")
    run.add_argument("--no-tracking", action="store_true", help="turn MLflow off (structured logs still print)")
    run.add_argument("--no-system-metrics", action="store_true", help="turn off MLflow's CPU/GPU/memory monitor")
    run.add_argument("--log-format", choices=["console", "json"], default="console", help="log line format")
    run.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="lowest level printed (default: info)",
    )
    _add_tracking_commands(commands)
    _add_remote_commands(commands)
    report = commands.add_parser(
        "report",
        help="print one run's profile (time, clients, bytes, memory, alerts)",
        description="Print the profile summary of one MLflow run (its profile.json artifact and final metrics).",
    )
    report.add_argument("run_id", metavar="RUN_ID", help="the MLflow run id")
    report.add_argument("--tracking-uri", help=_TRACKING_URI_HELP)
    compare = commands.add_parser(
        "compare",
        help="compare runs side by side",
        description="Print a side-by-side table of MLflow runs: final accuracy, time to a target accuracy, bytes, "
        "updates, staleness and the config fields that differ. Without run ids: the runs of --experiment.",
    )
    compare.add_argument("run_ids", nargs="*", metavar="RUN_ID", help="runs to compare (default: the experiment's)")
    compare.add_argument("--experiment", help="compare the runs of this experiment (default: flasync)")
    compare.add_argument(
        "--target-accuracy",
        type=float,
        help="accuracy for the time-to-target rows (default: the lowest final accuracy of the runs)",
    )
    compare.add_argument(
        "--plot", metavar="PATH", help="also write an SVG chart of accuracy against time (a .svg file)"
    )
    compare.add_argument("--tracking-uri", help=_TRACKING_URI_HELP)
    return parser


def _add_tracking_commands(commands: Any) -> None:
    """Add ``flasync tracking replay SPOOL [--tracking-uri URI]``."""
    group = commands.add_parser(
        "tracking",
        help="tracking tools (replay a spool written while MLflow was unreachable)",
        description="Tools for a run's MLflow tracking.",
    )
    actions = group.add_subparsers(dest="tracking_command", metavar="ACTION", parser_class=_Parser)
    replay = actions.add_parser(
        "replay",
        help="send a tracking spool (.jsonl) to MLflow",
        description="Send the records of a tracking spool to an MLflow store: the run is created, or continued "
        "where an earlier replay into the same store stopped (safe to rerun).",
    )
    replay.add_argument("spool", metavar="SPOOL", help="the spool file printed by the run")
    replay.add_argument("--tracking-uri", help="the target store (default: the one the run was tracking to)")
    failed = actions.add_parser(
        "mark-failed",
        help="mark RUNNING runs whose process is gone (killed, out of memory) as FAILED",
        description="Mark as FAILED the RUNNING runs whose owning process is gone from this host (a run killed with "
        "SIGKILL or by the OOM killer stays RUNNING). Their checkpoints stay: `flasync run --resume RUN` continues "
        "one. Runs of other hosts are left alone unless named with --force.",
    )
    failed.add_argument("runs", nargs="*", metavar="RUN", help="only these runs (default: every RUNNING run)")
    failed.add_argument("--experiment", help="only runs of this experiment")
    failed.add_argument("--tracking-uri", help=_TRACKING_URI_HELP)
    failed.add_argument("--force", action="store_true", help="also mark the named runs whose owner cannot be checked")


def _add_remote_commands(commands: Any) -> None:
    """Add ``flasync serve CONFIG`` and ``flasync client --server URL --token-file F``."""
    serve = commands.add_parser(
        "serve",
        help="serve a run to remote clients over HTTP (a config with remote.enabled = true)",
        description="Run one federation whose clients connect over HTTP (long-poll for tasks, binary updates), "
        "under uvicorn; log it to MLflow like `flasync run`.",
    )
    serve.add_argument(
        "config", nargs="?", help="a .toml or .yaml run config with remote.enabled = true and clock = 'wall'"
    )
    serve.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue an interrupted served run from its latest checkpoint (its config is used; --set stop.* only)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="TCP port (default: 8080; 0: any free port)")
    serve.add_argument("--ssl-certfile", help="PEM certificate: serve HTTPS (with --ssl-keyfile)")
    serve.add_argument("--ssl-keyfile", help="PEM private key of --ssl-certfile")
    serve.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    serve.add_argument("--tracking-uri", help=_TRACKING_URI_HELP)
    serve.add_argument("--experiment", help="MLflow experiment name")
    serve.add_argument("--run-name", help="MLflow run name")
    serve.add_argument("--no-tracking", action="store_true", help="turn MLflow off (structured logs still print)")
    serve.add_argument("--no-system-metrics", action="store_true", help="turn off MLflow's CPU/GPU/memory monitor")
    serve.add_argument("--log-format", choices=["console", "json"], default="console", help="log line format")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="lowest level printed")
    client = commands.add_parser(
        "client",
        help="train as a remote client of `flasync serve`",
        description="Ask a flasync server for tasks, train them locally and upload the updates until the run ends.",
    )
    client.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8080")
    client.add_argument("--token-file", required=True, help="a file holding this client's bearer token")
    client.add_argument(
        "--data",
        help="a .npz file with arrays x and y (default: this client's partition of the server's configured data)",
    )
    client.add_argument("--cafile", help="CA bundle that signs the server's certificate (HTTPS)")
    client.add_argument("--max-tasks", type=int, help="stop after answering this many tasks")
    client.add_argument("--poll-s", type=float, default=20.0, help="how long one request for a task waits")
    client.add_argument("--give-up-s", type=float, default=120.0, help="fail after the server is unreachable this long")
    client.add_argument("--threads", type=int, default=1, help="torch CPU threads for local training (default: 1)")


def _command_serve(args: argparse.Namespace, *, process_ends: bool = False) -> int:
    if args.ssl_certfile and not args.ssl_keyfile:
        raise _UsageError("--ssl-certfile needs --ssl-keyfile")
    resume: checkpoint.ResumePoint | None = None
    tracker: tracking.Tracker | None = None
    if args.resume:
        config, resume, tracker = _resolve_resume(args)
    elif args.config is None:
        raise _UsageError("serve needs a CONFIG (or --resume RUN_ID)")
    else:
        config = _resolve(args)
    if not config.remote.enabled:
        raise _UsageError(f"{args.config}: set remote.enabled = true (and remote.tokens_file) to serve remote clients")
    if config.tracking.enabled and resume is None:
        try:
            tracking.check_local_store(tracking.resolve_tracking_uri(config.tracking.uri))
        except tracking.StoreNotWritableError as exc:
            raise _UsageError(str(exc)) from None
    tracking.configure_logging(fmt=args.log_format, level=config.tracking.log_level)
    from flasync.runtime.federation import Federation
    from flasync.runtime.serve import serve

    federation = Federation(config, tracker=tracker, resume=resume)
    received: list[str] = []
    scheme = "https" if args.ssl_certfile else "http"

    def ready(port: int) -> None:
        print(f"flasync: serving on {scheme}://{args.host}:{port}", file=sys.stderr, flush=True)

    try:
        summary = run_loop(
            serve(
                federation,
                host=args.host,
                port=args.port,
                ssl_certfile=args.ssl_certfile,
                ssl_keyfile=args.ssl_keyfile,
                run=lambda f: _run_with_signals(f, received),
                on_ready=ready,
            ),
            process_ends=process_ends,
        )
    except RunInterrupted as exc:
        _print_partial(federation.summary, exc.reason)
        hint = f"; resume with: python -m flasync serve --resume {exc.run_id}" if exc.checkpoint and exc.run_id else ""
        print(f"flasync: {exc}{hint}", file=sys.stderr)
        return _SIGNAL_STATUS.get(exc.reason, 130)
    except asyncio.CancelledError:
        _print_partial(federation.summary, "second signal")
        print(f"flasync: stopped at once (second signal){_no_checkpoint(config)}", file=sys.stderr)
        return _SIGNAL_STATUS.get(received[-1] if received else "SIGINT", 130)
    except OSError as exc:
        raise _UsageError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    _print_summary(summary, config, None, resumed=resume is not None)
    return 0


def _command_client(args: argparse.Namespace, *, process_ends: bool = False) -> int:
    if not args.server.startswith(("http://", "https://")):
        raise _UsageError(f"--server: expected an http:// or https:// address, got {args.server!r}")
    try:
        with open(args.token_file, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise _UsageError(f"--token-file: cannot read {args.token_file}: {type(exc).__name__}") from None
    if not token:
        raise _UsageError(f"--token-file: {args.token_file} is empty")
    import numpy as np
    import torch

    from flasync.clients.remote.client import Client
    from flasync.data import ArrayData

    torch.set_num_threads(max(1, args.threads))
    dataset = None
    if args.data:
        try:
            with np.load(args.data, allow_pickle=False) as arrays:
                labels = np.array(arrays["y"], dtype=np.int64)
                dataset = ArrayData(
                    x=torch.from_numpy(np.array(arrays["x"], dtype=np.float32)),
                    y=torch.from_numpy(labels),
                    num_classes=int(labels.max()) + 1 if labels.size else 1,
                )
        except (OSError, KeyError, ValueError) as exc:
            raise _UsageError(f"--data: {args.data} needs arrays x and y ({type(exc).__name__}: {exc})") from None
    verify: Any = True
    if args.cafile:
        import ssl

        try:
            verify = ssl.create_default_context(cafile=args.cafile)
        except (OSError, ssl.SSLError) as exc:
            raise _UsageError(f"--cafile: cannot load {args.cafile}: {type(exc).__name__}") from None
    client = Client(
        args.server,
        token,
        dataset,
        verify=verify,
        poll_s=args.poll_s,
        give_up_s=args.give_up_s,
        on_status=lambda line: print(f"flasync client: {line}", file=sys.stderr, flush=True),
    )
    stats = run_loop(client.run(max_tasks=args.max_tasks), process_ends=process_ends)
    print(
        f"flasync client {stats.client_id}: {stats.uploads} updates delivered of {stats.tasks} tasks, "
        f"{stats.dropped} dropped, {stats.failures} failed, {stats.retries} retries, "
        f"{_format_bytes(stats.download_bytes)} down, {_format_bytes(stats.upload_bytes)} up"
        + (" (the run ended)" if stats.finished else ""),
        flush=True,
    )
    return 0


def _mark_failed(args: argparse.Namespace) -> int:
    """Run ``flasync tracking mark-failed``: exit 0, printing one line per run looked at."""
    from flasync.core.owner import HOST_TAG, owner_alive
    from flasync.tracking.report import RunLookupError, open_store

    try:
        client = open_store(args.tracking_uri)
    except RunLookupError as exc:
        raise ConfigError(str(exc)) from None
    if args.runs:
        runs = [client.get_run(run_id) for run_id in args.runs]
    else:
        experiments = list(client.search_experiments())
        if args.experiment:
            experiments = [e for e in experiments if e.name == args.experiment]
            if not experiments:
                raise ConfigError(f"--experiment: no experiment {args.experiment!r} in the store")
        runs = client.search_runs([e.experiment_id for e in experiments], filter_string="attributes.status = 'RUNNING'")
    if not runs:
        print("no RUNNING run to look at")
    for run in runs:
        run_id, tags = run.info.run_id, run.data.tags
        alive = owner_alive(tags)
        if run.info.status != "RUNNING":
            print(f"{run_id}  {run.info.status}: left as it is")
        elif alive:
            print(f"{run_id}  RUNNING: its process is alive; left as it is")
        elif alive is None and not (args.force and args.runs):
            host = tags.get(HOST_TAG, "an unknown host")
            print(f"{run_id}  RUNNING on {host}: cannot check it here (name it with --force)")
        else:
            client.set_terminated(run_id, "FAILED")
            print(f"{run_id}  FAILED (its process is gone; resume it with: flasync run --resume {run_id})")
    return 0


def _command_tracking(args: argparse.Namespace) -> int:
    """Run ``flasync tracking ACTION``: exit 0 when replayed, 2 for a bad spool, 1 when the store fails."""
    if args.tracking_command == "mark-failed":
        return _mark_failed(args)
    if args.tracking_command != "replay":
        raise _UsageError("tracking needs an action: replay or mark-failed (see flasync tracking --help)")
    from flasync.tracking.spool import SpoolError, replay

    try:
        result = replay(
            args.spool,
            args.tracking_uri,
            on_rejected=lambda record, exc: print(
                f"flasync: warning: the store refused a {record['type']} record: {str(exc).splitlines()[0]}",
                file=sys.stderr,
            ),
        )
    except SpoolError as exc:
        print(f"flasync: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        first = (str(exc).splitlines() or [""])[0][:300]
        print(
            f"flasync: error: replay of {args.spool} stopped: {type(exc).__name__}: {first} "
            "(progress is kept; run the same command again to continue)",
            file=sys.stderr,
        )
        return 1
    if result.partial:
        print(
            "flasync: warning: the run was live in its own store before it spooled; what it logged there is not in "
            f"the spool, so run {result.run_id} holds only the records after the failure",
            file=sys.stderr,
        )
    print(
        f"replayed {result.records} record(s) into run {result.run_id} at {tracking.redact_uri(result.tracking_uri)}: "
        f"{result.params} params, {result.tags} tags, {result.metrics} metric values, {result.artifacts} artifacts, "
        f"{result.datasets} dataset inputs, "
        f"status {result.status or '-'}; {result.already} record(s) were already replayed, "
        f"{result.rejected} refused by the store",
        flush=True,
    )
    return 0


_SIGNAL_STATUS = {"SIGINT": 130, "SIGTERM": 143}


def _resolve_resume(args: argparse.Namespace) -> tuple[RunConfig, checkpoint.ResumePoint, tracking.MlflowTracker]:
    """Fetch the run's checkpoint and config; only ``stop.*`` may be overridden."""
    if args.config:
        raise ConfigError(f"--resume takes the config from run {args.resume}'s checkpoint; drop {args.config}")
    if args.no_tracking:
        raise ConfigError("--resume continues an MLflow run; it cannot be combined with --no-tracking")
    for override in args.overrides:
        if not override.strip().startswith("stop."):
            raise ConfigError(f"--set {override!r}: with --resume only stop.* may change")
    uri = tracking.resolve_tracking_uri(args.tracking_uri)
    from flasync.runtime import checkpoint  # torch: imported once the command needs it

    config, state, status, tags, artifact = checkpoint.fetch(args.resume, uri)
    if status == "FINISHED":
        raise ConfigError(f"MLflow run {args.resume} already FINISHED; there is nothing to resume")
    if status == "RUNNING":
        from flasync.core.owner import HOST_TAG, PID_TAG, owner_alive

        alive = owner_alive(tags)
        if alive:
            raise ConfigError(
                f"MLflow run {args.resume} is still running (process {tags[PID_TAG]} on {tags[HOST_TAG]}); "
                "stop it first (Ctrl-C writes a checkpoint) and resume it then"
            )
        if alive is None:
            raise ConfigError(
                f"MLflow run {args.resume} is RUNNING and its process cannot be checked from here; if it is gone, "
                f"mark it failed with: flasync tracking mark-failed {args.resume} --force"
            )
    data = config.model_dump(mode="json")
    data["tracking"] |= {"uri": uri, "system_metrics": not args.no_system_metrics}
    if args.log_level:
        data["tracking"]["log_level"] = args.log_level
    for override in args.overrides:
        apply_override(data, override)
    resumed = validate(data)
    return resumed, checkpoint.ResumePoint(args.resume, state, artifact), tracked.mlflow_tracker(resumed)


def _resolve(args: argparse.Namespace) -> RunConfig:
    overrides = list(args.overrides)
    if args.tracking_uri:
        overrides.append(f"tracking.uri={args.tracking_uri}")
    if args.experiment:
        overrides.append(f"tracking.experiment={args.experiment}")
    if args.run_name:
        overrides.append(f"tracking.run_name={args.run_name}")
    if args.no_tracking:
        overrides.append("tracking.enabled=false")
    if args.log_level:
        overrides.append(f"tracking.log_level={args.log_level}")
    config = load_config(args.config, overrides)
    if not args.no_system_metrics and config.tracking.enabled:
        config = config.model_copy(update={"tracking": config.tracking.model_copy(update={"system_metrics": True})})
    return config


def _format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _print_summary(
    summary: RunSummary,
    config: RunConfig,
    ui_command: str | None,
    ui_url: str | None = None,
    *,
    resumed: bool = False,
) -> None:
    # A resumed run's counts are the whole run's, its wall seconds and rate this process's.
    here = " in this process" if resumed else ""
    lines = [
        "",
        f"flasync run finished ({summary.stop_reason})",
        f"  accuracy        {summary.accuracy:.4f}   loss {summary.loss:.4f}",
        f"  updates         {summary.updates_accepted} accepted, {summary.updates_dropped} dropped, "
        f"{summary.updates_failed} failed ({summary.updates_per_s:.1f}/s{here})",
        f"  versions        {summary.versions}   staleness mean {summary.staleness_mean:.2f}, "
        f"max {summary.staleness_max}",
        f"  time            wall {summary.wall_s:.2f} s{here}, "
        f"simulated {summary.simulated_s:.1f} s ({config.clock} clock)"
        + (f", first update {summary.first_update_s:.3f} s" if math.isfinite(summary.first_update_s) else ""),
        f"  bytes           up {_format_bytes(summary.upload_bytes)}, down {_format_bytes(summary.download_bytes)}",
        f"  weights sha256  {summary.weights_sha256}",
    ]
    if math.isfinite(summary.privacy_epsilon):
        lines.append(f"  privacy         epsilon {summary.privacy_epsilon:.3g} at delta {config.privacy.delta:g}")
    if summary.peak_rss_bytes:
        profile = f"  profile         peak RSS {_format_bytes(summary.peak_rss_bytes)}, alerts {summary.alerts}"
        if summary.stragglers:
            profile += f", server idle {100 * summary.server_idle_fraction:.0f}%, slowest clients "
            profile += ", ".join(str(c) for c in summary.stragglers[:3])
        lines.append(profile)
    if summary.run_id:
        lines.append(f"  MLflow run      {summary.run_id} (experiment {config.tracking.experiment!r})")
    if ui_command:
        lines.append(f"  open the UI     {ui_command}")
        if ui_url:
            lines.append(f"  then browse     {ui_url}")
    if summary.run_id and summary.stragglers:
        lines.append(f"  full profile    flasync report {summary.run_id}")
    print("\n".join(lines), flush=True)


def _stopping(config: RunConfig) -> str:
    """Say what a first signal's clean stop does with ``config``: no MLflow run nor checkpoint without tracking."""
    if not config.tracking.enabled:
        return "stopping (tracking is off: no checkpoint)"
    saved = "checkpoint, " if config.checkpoint.on_interrupt else ""
    return f"stopping ({saved}flush, MLflow run KILLED)"


def _no_checkpoint(config: RunConfig) -> str:
    """What a second signal's message adds: that no checkpoint was written (when one could have been)."""
    return "; no checkpoint written" if config.tracking.enabled else ""


def _print_partial(summary: RunSummary | None, why: str) -> None:
    """Print a stopped run's partial summary on one line (nothing when it stopped before it started)."""
    if summary is None:
        return
    evaluated = (
        f"accuracy {summary.accuracy:.4f}, loss {summary.loss:.4f}"
        if math.isfinite(summary.accuracy)
        else "not evaluated yet"
    )
    print(
        f"flasync run stopped ({why}) at version {summary.versions}: {evaluated}; {summary.updates_accepted} updates "
        f"accepted, {summary.updates_dropped} dropped, {summary.updates_failed} failed; wall {summary.wall_s:.1f} s",
        flush=True,
    )


async def _run_with_signals(federation: Federation, received: list[str]) -> RunSummary:
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


def _command_run(args: argparse.Namespace, *, process_ends: bool = False) -> int:
    resume: checkpoint.ResumePoint | None = None
    tracker: tracking.Tracker
    if args.resume:
        config, resume, tracker = _resolve_resume(args)
    else:
        config = _resolve(args)
        if config.remote.enabled and not args.print_config:
            # Remote clients reach a run through the HTTP server: `run` has none and would wait for ever.
            raise ConfigError("remote.enabled: a run with remote clients is served: python -m flasync serve CONFIG")
        if config.tracking.enabled:
            if not args.print_config:
                try:
                    tracking.check_local_store(tracking.resolve_tracking_uri(config.tracking.uri))
                except tracking.StoreNotWritableError as exc:
                    raise _UsageError(str(exc)) from None
            tracker = tracked.mlflow_tracker(config)
        else:
            tracker = tracking.NullTracker()
    if args.print_config:
        print(_determinism_note(config), end="")
        shown = config.tracking.uri and tracking.redact_uri(config.tracking.uri)
        dump = config.model_dump(mode="json")
        dump["tracking"]["uri"] = shown
        if config.partition.kind == "by_column" and "num_clients" not in config.population.model_fields_set:
            del dump["population"]["num_clients"]  # the run takes it from the data
        print(yaml.safe_dump(dump, sort_keys=False), end="")
        return 0
    bar = _progress_bar(args.log_format)
    tracking.configure_logging(fmt=args.log_format, level=config.tracking.log_level, progress=bar)
    tracker.prepare()  # MLflow's writer process imports MLflow and opens the store while this one imports torch
    # The first line comes before torch is imported (about a second on 2 cores).
    structlog.get_logger("flasync").info("run.phase", phase="loading flasync and torch")
    from flasync.runtime.federation import Federation

    received: list[str] = []
    federation = Federation(config, tracker=tracker, resume=resume)
    try:
        try:
            summary = run_loop(_run_with_signals(federation, received), process_ends=process_ends)
        finally:
            if bar is not None:
                bar.close()  # finished, failed or interrupted: what follows prints below the bar
    except RunInterrupted as exc:
        _print_partial(federation.summary, exc.reason)
        hint = f"; resume with: python -m flasync run --resume {exc.run_id}" if exc.checkpoint and exc.run_id else ""
        print(f"flasync: {exc}{hint}", file=sys.stderr)
        spooled = tracker.replay_command() if isinstance(tracker, tracking.MlflowTracker) else None
        if spooled:
            print(f"flasync: MLflow did not answer; send the spool with: {spooled}", file=sys.stderr)
        return _SIGNAL_STATUS.get(exc.reason, 130)
    except asyncio.CancelledError:
        _print_partial(federation.summary, "second signal")
        print(f"flasync: stopped at once (second signal){_no_checkpoint(config)}", file=sys.stderr)
        return _SIGNAL_STATUS.get(received[-1] if received else "SIGINT", 130)
    url = tracker.ui_url() if isinstance(tracker, tracking.MlflowTracker) else None
    _print_summary(summary, config, tracker.ui_command(), url, resumed=resume is not None)
    replay_command = tracker.replay_command() if isinstance(tracker, tracking.MlflowTracker) else None
    if replay_command:
        print(f"  tracking spool  MLflow did not answer; send the spool with: {replay_command}", flush=True)
    return 0


def _progress_bar(log_format: str) -> ProgressBar | None:
    """Return a progress bar for the evaluations when standard output is a terminal (else plain lines)."""
    if log_format != "console" or not _is_tty(sys.stdout):
        return None
    from flasync.tracking.progress import ProgressBar

    return ProgressBar(redirect_stderr=_is_tty(sys.stderr))


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _command_report(args: argparse.Namespace) -> int:
    # Imported here: they import MLflow, which `flasync run --no-tracking` never needs.
    from flasync.tracking.report import RunLookupError, format_report, get_run, load_profile, open_store

    try:
        client = open_store(args.tracking_uri)
        run = get_run(client, args.run_id)
    except RunLookupError as exc:
        raise _UsageError(str(exc)) from None
    text = format_report(
        run.info.run_id,
        run.info.run_name or run.info.run_id[:8],
        dict(run.data.metrics),
        load_profile(client, run.info.run_id),
    )
    print(text, flush=True)
    return 0


def _command_compare(args: argparse.Namespace) -> int:
    from flasync.tracking.compare import comparison_table, default_target, fetch_runs, plot_comparison
    from flasync.tracking.report import RunLookupError, open_store

    target = args.target_accuracy
    if target is not None and not 0.0 < target <= 1.0:
        raise _UsageError(f"--target-accuracy must be in (0, 1], got {target}")
    if args.run_ids and args.experiment is not None:
        raise _UsageError("compare takes run ids or --experiment, not both")
    if args.plot is not None:
        if not args.plot.lower().endswith(".svg"):
            raise _UsageError(f"--plot: the comparison is an SVG chart, name a .svg file (got {args.plot!r})")
        plot = Path(args.plot)
        if plot.is_dir() or not plot.absolute().parent.is_dir():
            raise _UsageError(f"--plot: cannot write {args.plot}: not a file in an existing folder")
    try:
        client = open_store(args.tracking_uri)
        records = fetch_runs(client, list(dict.fromkeys(args.run_ids)), experiment=args.experiment)  # each id once
    except RunLookupError as exc:
        raise _UsageError(str(exc)) from None
    if target is None:
        target = default_target(records)
    print(comparison_table(records, target=target), flush=True)
    if args.plot is not None:
        try:
            plot_comparison(records, args.plot, target=target)
        except OSError as exc:
            raise _UsageError(f"--plot: cannot write {args.plot}: {exc.strerror or exc}") from None
        print(f"plot written to {args.plot}", flush=True)
    return 0


def _determinism_note(config: RunConfig) -> str:
    """Return YAML comments saying what the run's final weights depend on besides this config."""
    import torch

    if config.clock == "wall":
        return "# clock = wall: real time orders the updates, so weights_sha256 is not reproducible\n"
    return (
        "# Under the virtual clock, weights_sha256 depends on this config (seed, data, model, server, codecs, and\n"
        f"# executor.threads_per_worker = {config.executor.threads_per_worker}; not on executor.workers), on the torch "
        f"build ({torch.__version__})\n"
        f"# and on its CPU kernels: torch's own (capability {torch.backends.cpu.get_cpu_capability()}; "
        "ATEN_CPU_CAPABILITY pins them)\n# and MKL's matrix products (their path follows the CPU's model and maker).\n"
    )


def main(argv: Sequence[str] | None = None, *, process_ends: bool = False) -> int:
    """Run the command line; return the exit status.

    Args:
        argv: The arguments (default: the process's).
        process_ends: The process ends after this command (:func:`console`): a federation's loop may then keep
            the heap that exists at its start frozen for good (see :func:`flasync.core.loops.run_loop`).
    """
    parser = _build_parser()
    try:
        with _download_bars_off():
            return _dispatch(parser, argv, process_ends)
    except _UsageError as exc:
        print(f"flasync: error: {exc}", file=sys.stderr)
        return 2
    except FlasyncError as exc:
        print(f"flasync: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flasync: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of the output went away (`flasync compare | head`): what it did not read is not wanted. Python
        # would report the failed flush of stdout at exit; pointing it at /dev/null leaves nothing to report.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # a shell's status for a process ended by SIGPIPE


def _dispatch(parser: argparse.ArgumentParser, argv: Sequence[str] | None, process_ends: bool) -> int:
    """Parse ``argv`` and run its command (see :func:`main`); errors propagate."""
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "tracking":
        return _command_tracking(args)
    if args.command == "report":
        return _command_report(args)
    if args.command == "compare":
        return _command_compare(args)
    if args.command == "serve":
        return _command_serve(args, process_ends=process_ends)
    if args.command == "client":
        return _command_client(args, process_ends=process_ends)
    return _command_run(args, process_ends=process_ends)


@contextlib.contextmanager
def _download_bars_off() -> Iterator[None]:
    """Keep MLflow from drawing its artifact progress bars (tqdm's, where installed) for the command: a one-file
    checkpoint or profile would get three lines of them among flasync's own progress lines and one-line errors. A
    user's own ``MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR`` is left as it is."""
    if _BARS in os.environ:
        yield
        return
    os.environ[_BARS] = "false"
    try:
        yield
    finally:
        os.environ.pop(_BARS, None)


_BARS = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


def console() -> NoReturn:
    """Run the command line as a program (``python -m flasync``, the ``flasync`` script) and exit with its status.

    Once the command is done - its output written, every thread it started finished, the ``atexit`` handlers run
    - the process ends without the interpreter's teardown: freeing the modules a tracked run loads (torch, MLflow,
    SQLAlchemy) one object at a time took 2 s of a default run's 10 (0.7 s without tracking), and frees
    nothing the operating system would not.
    """
    status = main(process_ends=True)
    # What a normal exit runs, in its order: the threading module's exit hooks (they end idle thread pools' workers,
    # such as the one MLflow's artifact repository keeps, which would otherwise wait for work forever) and the join
    # of every other non-daemon thread; then the atexit handlers (logging's flush, temporary folders' finalizers).
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more can be written
            stream.flush()
    os._exit(status)
