"""``flasync report RUN_ID``: one run's profile summary; ``--clients``: its per-client table."""

from __future__ import annotations

import argparse
from typing import Any

from flasync.cli.shared import TRACKING_URI_HELP, UsageError


def add_report_parser(commands: Any) -> None:
    """Add ``flasync report [--clients] RUN_ID [--tracking-uri URI]``."""
    report = commands.add_parser(
        "report",
        help="print one run's profile (time, clients, bytes, memory, alerts)",
        description="Print the profile summary of one MLflow run (its profile.json artifact and final metrics).",
    )
    report.add_argument(
        "run_id", metavar="RUN_ID", help="the MLflow run id, or the id the run printed first (run.started run=ID)"
    )
    report.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    report.add_argument(
        "--clients",
        action="store_true",
        help="print the run's per-client table and histograms instead (a run made with tracking.client_table=true)",
    )


def command_report(args: argparse.Namespace) -> int:
    """Run ``flasync report``: print the run's profile summary (``--clients``: its per-client table); exit 0."""
    # Imported here: they import MLflow, which `flasync run --no-tracking` never needs.
    from flasync.tracking.report import (
        RunLookupError,
        final_figures,
        format_client_table,
        format_report,
        get_run,
        load_client_views,
        load_profile,
        open_store,
    )

    try:
        client = open_store(args.tracking_uri)
        run = get_run(client, args.run_id)
    except RunLookupError as exc:
        raise UsageError(str(exc)) from None
    name = run.info.run_name or run.info.run_id[:8]
    if args.clients:
        views = load_client_views(client, run.info.run_id)
        if views is None:
            raise UsageError(f"run {args.run_id} has no per-client table (run it with tracking.client_table=true)")
        print(format_client_table(run.info.run_id, name, *views), flush=True)
        return 0
    text = format_report(
        run.info.run_id,
        name,
        final_figures(run.data.metrics, run.data.tags),
        load_profile(client, run.info.run_id),
    )
    print(text, flush=True)
    return 0
