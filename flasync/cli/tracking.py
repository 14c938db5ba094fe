"""``flasync tracking``: replay a tracking spool, mark runs whose process is gone as FAILED, print where the UI
shows an experiment's runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flasync import tracking
from flasync.cli.shared import TRACKING_URI_HELP, Parser, UsageError
from flasync.core.errors import ConfigError


def add_tracking_commands(commands: Any) -> None:
    """Add ``flasync tracking replay SPOOL``, ``flasync tracking mark-failed [RUN ...]`` and ``flasync tracking ui``."""
    group = commands.add_parser(
        "tracking",
        help="tracking tools (replay a spool written while MLflow was unreachable)",
        description="Tools for a run's MLflow tracking.",
    )
    actions = group.add_subparsers(dest="tracking_command", metavar="ACTION", parser_class=Parser)
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
    failed.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    failed.add_argument("--force", action="store_true", help="also mark the named runs whose owner cannot be checked")
    ui = actions.add_parser(
        "ui",
        help="print how to open an experiment's training runs in the MLflow UI",
        description="Print the command that serves the store in the MLflow UI and the address of the experiment's "
        "training runs there (MLflow 3 opens its GenAI pages otherwise), with flasync's runs view: evaluation "
        "columns and charts first.",
    )
    ui.add_argument("--experiment", default="flasync", help="the experiment (default: flasync)")
    ui.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    ui.add_argument("--base", default="http://127.0.0.1:5000", help="where the UI is served (mlflow ui's default)")


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
            if _has_checkpoint(client, run_id):
                print(f"{run_id}  FAILED (its process is gone; resume it with: flasync run --resume {run_id})")
            else:
                print(f"{run_id}  FAILED (its process is gone; it wrote no checkpoint, so it cannot be resumed)")
    return 0


def _ui(args: argparse.Namespace) -> int:
    """Run ``flasync tracking ui``: print the UI command and the experiment's address; exit 0."""
    from flasync.tracking.report import RunLookupError, experiment_address, open_store

    try:
        command, url = experiment_address(open_store(args.tracking_uri), args.experiment, args.base)
    except RunLookupError as exc:
        raise ConfigError(str(exc)) from None
    if command is not None:
        print(f"open the UI     {command}")
    print(f"then browse     {url}")
    return 0


def _has_checkpoint(client: Any, run_id: str) -> bool:
    """Tell whether the run has a checkpoint artifact to resume from (a store that cannot list says yes)."""
    try:
        return any(item.path.endswith(".pt") for item in client.list_artifacts(run_id, "checkpoints"))
    except Exception:  # an artifact store that cannot be listed from here: let --resume find out
        return True


def command_tracking(args: argparse.Namespace) -> int:
    """Run ``flasync tracking ACTION``: exit 0 when replayed, 2 for a bad spool, 1 when the store fails."""
    if args.tracking_command == "mark-failed":
        return _mark_failed(args)
    if args.tracking_command == "ui":
        return _ui(args)
    if args.tracking_command != "replay":
        raise UsageError("tracking needs an action: replay, mark-failed or ui (see flasync tracking --help)")
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
