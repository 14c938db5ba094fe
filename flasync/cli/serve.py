"""``flasync serve``: one federation served to remote clients over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
from typing import TYPE_CHECKING, Any

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
from flasync.core.bus import EventBus, OverflowPolicy
from flasync.core.errors import RunInterrupted
from flasync.core.events import ModelPublished
from flasync.core.loops import run_loop

if TYPE_CHECKING:
    from flasync.observe.summary import RunSummary
    from flasync.runtime import checkpoint
    from flasync.runtime.federation import Federation


def add_serve_parser(commands: Any) -> None:
    """Add ``flasync serve CONFIG``."""
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
    serve.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    serve.add_argument("--experiment", help="MLflow experiment name")
    serve.add_argument("--run-name", help="MLflow run name ({seed}, {time} and {id} are filled in)")
    serve.add_argument("--no-tracking", action="store_true", help="turn MLflow off (structured logs still print)")
    serve.add_argument("--no-system-metrics", action="store_true", help="turn off MLflow's CPU/GPU/memory monitor")
    serve.add_argument("--log-format", choices=["console", "json"], default="console", help="log line format")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="lowest level printed")


def command_serve(args: argparse.Namespace, *, process_ends: bool = False) -> int:
    """Run ``flasync serve``: exit 0 when the served run finishes, 130 or 143 when a signal stops it."""
    if args.ssl_certfile and not args.ssl_keyfile:
        raise UsageError("--ssl-certfile needs --ssl-keyfile")
    resume: checkpoint.ResumePoint | None = None
    tracker: tracking.Tracker | None = None
    if args.resume:
        config, resume, tracker = resolve_resume(args)
    elif args.config is None:
        raise UsageError("serve needs a CONFIG (or --resume RUN_ID)")
    else:
        config = resolve(args)
    if not config.remote.enabled:
        raise UsageError(f"{args.config}: set remote.enabled = true (and remote.tokens_file) to serve remote clients")
    if config.tracking.enabled and resume is None:
        try:
            tracking.check_local_store(tracking.resolve_tracking_uri(config.tracking.uri))
        except tracking.StoreNotWritableError as exc:
            raise UsageError(str(exc)) from None
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
                run=lambda f: _run_settled(f, received, settle=process_ends),
                on_ready=ready,
            ),
            process_ends=process_ends,
        )
    except RunInterrupted as exc:
        print_partial(federation.summary, exc.reason)
        if federation.summary is not None and federation.transport is not None:  # refusals until the signal
            print(remote_line(federation.transport.statistics(), resumed=resume is not None), flush=True)
        hint = f"; resume with: python -m flasync serve --resume {exc.run_id}" if exc.checkpoint and exc.run_id else ""
        print(f"flasync: {exc}{hint}", file=sys.stderr)
        return stopped_status(exc.reason)
    except asyncio.CancelledError:
        print_partial(federation.summary, "second signal")
        print(f"flasync: stopped at once (second signal){no_checkpoint(config)}", file=sys.stderr)
        return SIGNAL_STATUS.get(received[-1] if received else "SIGINT", 130)
    except OSError as exc:
        raise UsageError(f"cannot serve on {args.host}:{args.port}: {exc}") from None
    registered = federation.registration.message if federation.registration is not None else None
    print_summary(summary, config, None, resumed=resume is not None, registered=registered)
    if federation.transport is not None:
        print(remote_line(federation.transport.statistics(), resumed=resume is not None), flush=True)
    return 0


FULL_COLLECTION_EVERY = 100
"""Collections of the garbage collector's middle generation between two full ones in a served run
(:func:`settle_heap`; CPython's default is 10)."""


async def _run_settled(federation: Federation, received: list[str], *, settle: bool) -> RunSummary:
    """Run ``federation`` as :func:`run_with_signals` does; with ``settle`` (the process ends with the run), freeze
    the heap once the run has started (:func:`settle_heap`)."""
    if not settle:
        return await run_with_signals(federation, received)
    # Not a TaskGroup: the run's own exceptions (RunInterrupted) must reach the caller as they are, not in a group.
    settling = asyncio.create_task(settle_heap(federation.bus), name="flasync-settle-heap")
    try:
        return await run_with_signals(federation, received)
    finally:
        settling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await settling


async def settle_heap(bus: EventBus) -> None:
    """Once the run on ``bus`` has published its first model, collect the garbage, freeze what is left for good and
    make full collections rarer.

    The command line freezes the imports' objects as its process starts (:func:`~flasync.core.loops.run_loop`);
    a served run then builds its data, model, executor and MLflow run, hundreds of thousands of objects more, that
    every full collection of the cyclic garbage collector would walk again, a pause of every request each time.
    Once the first model is published those objects live as long as the process; what is frozen has just been
    found alive. What is left to walk are the objects of the tasks in flight (a task, a coroutine and futures per
    device's task, each living as long as the device trains): they outlive the young generations, so under load
    a full collection would come every second or two, each pausing every request while it walks them all. A
    full collection then waits for :data:`FULL_COLLECTION_EVERY` collections of the middle generation instead of
    CPython's 10 (what a full collection frees, cyclic garbage that outlived the young generations, waits longer;
    everything else is freed as before). Only for a process that ends with its run: a frozen object that becomes
    cyclic garbage later is never collected.

    Args:
        bus: The run's event bus (subscribed to before the run starts).
    """
    with bus.subscribe(ModelPublished, capacity=1, policy=OverflowPolicy.DROP_OLDEST, name="heap settling") as first:
        async for _ in first:
            gc.collect()
            gc.freeze()
            young, middle, _ = gc.get_threshold()
            gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
            return


def remote_line(statistics: dict[str, Any], *, resumed: bool = False) -> str:
    """Return the summary's line about the remote clients: updates received and requests refused, by reason.

    Args:
        statistics: :meth:`~flasync.clients.remote.transport.RemoteTransport.statistics`.
        resumed: Whether this process resumed the run (its counts are its own).
    """
    refused = statistics["refused"]
    reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(refused.items())) or "none"
    here = " in this process" if resumed else ""
    return f"  remote          {statistics['uploads']} updates received{here}; requests refused: {reasons}"
