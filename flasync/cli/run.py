"""``flasync run``: one federated experiment on this machine, logged to MLflow."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, Any

import structlog
import yaml

from flasync import tracking
from flasync.cli.running import (
    SIGNAL_STATUS,
    no_checkpoint,
    print_partial,
    print_summary,
    resolve,
    resolve_resume,
    run_with_signals,
    stopped_status,
)
from flasync.cli.shared import TRACKING_URI_HELP, UsageError
from flasync.config import RunConfig
from flasync.core.errors import ConfigError, RunInterrupted
from flasync.core.loops import collections_held, run_loop
from flasync.runtime import tracked

if TYPE_CHECKING:
    from flasync.runtime import checkpoint
    from flasync.tracking.progress import ProgressBar


def add_run_parser(commands: Any) -> None:
    """Add ``flasync run [CONFIG] [--set PATH=VALUE] [--resume RUN_ID] ...``."""
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
    run.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    run.add_argument(
        "--experiment", help="MLflow experiment name (default: the config's tracking.experiment, 'flasync' unless set)"
    )
    run.add_argument("--run-name", help="MLflow run name ({seed}, {time} and {id} are filled in)")
    run.add_argument(
        "--register",
        metavar="NAME",
        help="register the selected model (eval.select's best, else the last) in the MLflow Model Registry as NAME, "
        "alias champion when it beats the current one (config: tracking.register)",
    )
    run.add_argument("--no-tracking", action="store_true", help="turn MLflow off (structured logs still print)")
    run.add_argument("--no-system-metrics", action="store_true", help="turn off MLflow's CPU/GPU/memory monitor")
    run.add_argument("--log-format", choices=["console", "json"], default="console", help="log line format")
    run.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="lowest level printed (default: info)",
    )


def command_run(args: argparse.Namespace, *, process_ends: bool = False) -> int:
    """Run ``flasync run``: exit 0 when the run finishes, 130 or 143 when a signal stops it, 1 when something else
    does (the MLflow run could not be opened, the Ray cluster is gone)."""
    resume: checkpoint.ResumePoint | None = None
    tracker: tracking.Tracker
    if args.resume:
        config, resume, tracker = resolve_resume(args)
    else:
        config = resolve(args)
        if config.remote.enabled and not args.print_config:
            # Remote clients reach a run through the HTTP server: `run` has none and would wait for ever.
            raise ConfigError("remote.enabled: a run with remote clients is served: python -m flasync serve CONFIG")
        if config.tracking.enabled:
            if not args.print_config:
                try:
                    tracking.check_local_store(tracking.resolve_tracking_uri(config.tracking.uri))
                except tracking.StoreNotWritableError as exc:
                    raise UsageError(str(exc)) from None
            tracker = tracked.mlflow_tracker(config)
            if not args.print_config:
                _tell_left_behind()
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
    with collections_held():  # run_loop freezes what the imports leave
        from flasync.runtime.federation import Federation

    received: list[str] = []
    federation = Federation(config, tracker=tracker, resume=resume)
    try:
        try:
            summary = run_loop(run_with_signals(federation, received), process_ends=process_ends)
        finally:
            if bar is not None:
                bar.close()  # finished, failed or interrupted: what follows prints below the bar
    except RunInterrupted as exc:
        print_partial(federation.summary, exc.reason)
        hint = f"; resume with: python -m flasync run --resume {exc.run_id}" if exc.checkpoint and exc.run_id else ""
        print(f"flasync: {exc}{hint}", file=sys.stderr)
        spooled = tracker.replay_command() if isinstance(tracker, tracking.MlflowTracker) else None
        if spooled:
            print(f"flasync: MLflow did not answer; send the spool with: {spooled}", file=sys.stderr)
        return stopped_status(exc.reason)
    except asyncio.CancelledError:
        print_partial(federation.summary, "second signal")
        print(f"flasync: stopped at once (second signal){no_checkpoint(config)}", file=sys.stderr)
        return SIGNAL_STATUS.get(received[-1] if received else "SIGINT", 130)
    url = tracker.ui_url() if isinstance(tracker, tracking.MlflowTracker) else None
    registered = federation.registration.message if federation.registration is not None else None
    print_summary(summary, config, tracker.ui_command(), url, resumed=resume is not None, registered=registered)
    replay_command = tracker.replay_command() if isinstance(tracker, tracking.MlflowTracker) else None
    if replay_command:
        print(f"  tracking spool  MLflow did not answer; send the spool with: {replay_command}", flush=True)
    return 0


def _tell_left_behind(most: int = 3) -> None:
    """Name the runs killed before their MLflow run held all they logged (their journals are left), and how to
    continue or keep each."""
    from flasync.tracking.journal import left_behind

    left = left_behind()
    for path in left[:most]:
        print(
            f"flasync: run {path.stem} was killed (its journal {path} is left): continue it with "
            f"python -m flasync run --resume {path.stem}, or keep what it logged with flasync tracking replay {path}",
            file=sys.stderr,
        )
    if len(left) > most:
        print(f"flasync: and {len(left) - most} more killed runs' journals in {left[0].parent}", file=sys.stderr)


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
