"""The ``flasync`` program: its parser, the dispatch to a command, one-line errors and ``console()``."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import NoReturn

from flasync._version import __version__
from flasync.cli import client, compare, config, data, report, run, serve, sweep, tracking
from flasync.cli.shared import Parser, UsageError
from flasync.core.errors import FlasyncError
from flasync.tracking import _server


def _build_parser() -> Parser:
    parser = Parser(
        prog="flasync",
        description="Asynchronous federated learning: FedBuff, FedAsync and FedAvg with virtual time and MLflow.",
    )
    parser.add_argument("--version", action="version", version=f"flasync {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    run.add_run_parser(commands)
    sweep.add_sweep_parser(commands)
    tracking.add_tracking_commands(commands)
    serve.add_serve_parser(commands)
    client.add_client_parser(commands)
    report.add_report_parser(commands)
    compare.add_compare_parser(commands)
    config.add_config_commands(commands)
    data.add_data_commands(commands)
    return parser


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
    except UsageError as exc:
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
        return tracking.command_tracking(args)
    if args.command == "report":
        return report.command_report(args)
    if args.command == "sweep":
        return sweep.command_sweep(args)
    if args.command == "compare":
        return compare.command_compare(args)
    if args.command == "config":
        return config.command_config(args)
    if args.command == "data":
        return data.command_data(args)
    if args.command == "serve":
        return serve.command_serve(args, process_ends=process_ends)
    if args.command == "client":
        return client.command_client(args, process_ends=process_ends)
    return run.command_run(args, process_ends=process_ends)


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

    A tracked command's MLflow writer process starts the writer server that later commands' writers are forked
    from, MLflow imported (:func:`flasync.tracking._server.fork_server`); ``FLASYNC_WRITER_SERVER=0`` keeps it off.
    """
    os.environ.setdefault(_server.VARIABLE, "1")
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
