"""``flasync compare``: a side-by-side table (and chart) of MLflow runs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flasync.cli.shared import TRACKING_URI_HELP, UsageError

DEFAULT_LAST = 50
"""How many of an experiment's latest runs are compared without ``--last`` (as
:data:`flasync.tracking.compare.DEFAULT_LAST`: the parser does not import MLflow)."""


def add_compare_parser(commands: Any) -> None:
    """Add ``flasync compare [RUN_ID ...] [--experiment NAME] [--last N] [--filter STRING] [--target-accuracy A]
    [--plot PATH]``."""
    compare = commands.add_parser(
        "compare",
        help="compare runs side by side",
        description="Print a side-by-side table of MLflow runs: final accuracy, time to a target accuracy, bytes, "
        "updates, staleness and the config fields that differ. Without run ids: the latest runs of --experiment "
        "(--last of them, those matching --filter), sweeps' parent runs left out (their child runs are compared).",
    )
    compare.add_argument(
        "run_ids",
        nargs="*",
        metavar="RUN_ID",
        help="runs to compare, by MLflow run id or the id each printed first (default: the experiment's)",
    )
    compare.add_argument("--experiment", help="compare the runs of this experiment (default: flasync)")
    compare.add_argument(
        "--last",
        type=int,
        metavar="N",
        help=f"compare the experiment's N latest runs (default: {DEFAULT_LAST})",
    )
    compare.add_argument(
        "--filter",
        metavar="STRING",
        help="compare only the experiment's runs matching this MLflow search filter, e.g. "
        "\"params.`server.kind` = 'fedavg'\" or \"tags.aggregator = 'fedbuff'\"",
    )
    compare.add_argument(
        "--target-accuracy",
        type=float,
        help="accuracy for the time-to-target rows (default: the lowest final accuracy of the runs)",
    )
    compare.add_argument(
        "--plot", metavar="PATH", help="also write an SVG chart of accuracy against time (a .svg file)"
    )
    compare.add_argument("--tracking-uri", help=TRACKING_URI_HELP)


def command_compare(args: argparse.Namespace) -> int:
    """Run ``flasync compare``: print the table of the runs (and write the chart of --plot); exit 0."""
    from flasync.tracking.compare import comparison_table, default_target, fetch_runs, plot_comparison
    from flasync.tracking.report import RunLookupError, open_store

    target = args.target_accuracy
    if target is not None and not 0.0 < target <= 1.0:
        raise UsageError(f"--target-accuracy must be in (0, 1], got {target}")
    if args.run_ids and args.experiment is not None:
        raise UsageError("compare takes run ids or --experiment, not both")
    if args.run_ids and (args.last is not None or args.filter is not None):
        raise UsageError("--last and --filter pick among an experiment's runs: give them without run ids")
    if args.last is not None and args.last < 1:
        raise UsageError(f"--last must be at least 1, got {args.last}")
    if args.filter is not None and not args.filter.strip():
        raise UsageError("--filter: empty filter (leave it out to compare every run)")
    if args.plot is not None:
        if not args.plot.lower().endswith(".svg"):
            raise UsageError(f"--plot: the comparison is an SVG chart, name a .svg file (got {args.plot!r})")
        plot = Path(args.plot)
        if plot.is_dir() or not plot.absolute().parent.is_dir():
            raise UsageError(f"--plot: cannot write {args.plot}: not a file in an existing folder")
    try:
        client = open_store(args.tracking_uri)
        records = fetch_runs(
            client,
            list(dict.fromkeys(args.run_ids)),  # each id once
            experiment=args.experiment,
            last=DEFAULT_LAST if args.last is None else args.last,
            filter_string=args.filter or "",
        )
    except RunLookupError as exc:
        raise UsageError(str(exc)) from None
    if target is None:
        target = default_target(records)
    print(comparison_table(records, target=target), flush=True)
    if args.plot is not None:
        try:
            plot_comparison(records, args.plot, target=target)
        except OSError as exc:
            raise UsageError(f"--plot: cannot write {args.plot}: {exc.strerror or exc}") from None
        print(f"plot written to {args.plot}", flush=True)
    return 0
