"""``flasync report RUN_ID``: one run's profile summary."""

from __future__ import annotations

import argparse
from typing import Any

from flasync.cli.shared import TRACKING_URI_HELP, UsageError


def add_report_parser(commands: Any) -> None:
    """Add ``flasync report RUN_ID [--tracking-uri URI]``."""
    report = commands.add_parser(
        "report",
        help="print one run's profile (time, clients, bytes, memory, alerts)",
        description="Print the profile summary of one MLflow run (its profile.json artifact and final metrics).",
    )
    report.add_argument("run_id", metavar="RUN_ID", help="the MLflow run id")
    report.add_argument("--tracking-uri", help=TRACKING_URI_HELP)


def command_report(args: argparse.Namespace) -> int:
    """Run ``flasync report``: print the run's profile summary; exit 0."""
    # Imported here: they import MLflow, which `flasync run --no-tracking` never needs.
    from flasync.tracking.report import (
        RunLookupError,
        final_figures,
        format_report,
        get_run,
        load_profile,
        open_store,
    )

    try:
        client = open_store(args.tracking_uri)
        run = get_run(client, args.run_id)
    except RunLookupError as exc:
        raise UsageError(str(exc)) from None
    text = format_report(
        run.info.run_id,
        run.info.run_name or run.info.run_id[:8],
        final_figures(run.data.metrics, run.data.tags),
        load_profile(client, run.info.run_id),
    )
    print(text, flush=True)
    return 0
