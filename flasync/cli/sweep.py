"""``flasync sweep``: a grid of experiments, each an MLflow child run of one parent run; Ctrl-C, then ``--resume``."""

from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flasync import tracking
from flasync.cli.running import run_with_signals, stopped_status
from flasync.cli.shared import TRACKING_URI_HELP, UsageError
from flasync.config import config_data
from flasync.core.errors import ConfigError
from flasync.core.loops import run_loop

if TYPE_CHECKING:
    from flasync.runtime.federation import Federation, RunSummary
    from flasync.runtime.sweep import PointTask, SweepOutcome, SweepPlan
    from flasync.runtime.sweep_runs import SweepParent


def add_sweep_parser(commands: Any) -> None:
    """Add ``flasync sweep [CONFIG] --grid PATH=VALUES ... [--set PATH=VALUE] [--parallel N] [--resume [RUN_ID]]``."""
    sweep = commands.add_parser(
        "sweep",
        help="run a grid of experiments as MLflow child runs of one parent run",
        description=(
            "Run one experiment per point of a grid (the cartesian product of the --grid options) in one process, "
            "each an MLflow child run of one parent run, which logs the table of results and a comparison plot. "
            "Ctrl-C stops the current run with a checkpoint; --resume continues the sweep."
        ),
    )
    sweep.add_argument("config", nargs="?", help="a .toml or .yaml run config (default: the built-in experiment)")
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="PATH=VALUES",
        help="a field and its values: a comma list (server.kind=fedavg,fedbuff) or an integer range (seed=0..4); "
        "repeatable, the runs are every combination",
    )
    sweep.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override one field of every run, e.g. --set stop.max_versions=20 (repeatable)",
    )
    sweep.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at once, in N worker processes")
    sweep.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="PARENT_RUN_ID",
        help="continue an interrupted sweep: by its parent run's id, or (without one) the newest unfinished sweep "
        "of the same config and grid; finished runs are skipped, the interrupted one resumes from its checkpoint",
    )
    sweep.add_argument("--tracking-uri", help=TRACKING_URI_HELP)
    sweep.add_argument("--experiment", help="MLflow experiment name (default: the config's tracking.experiment)")
    sweep.add_argument("--no-system-metrics", action="store_true", help="turn off MLflow's CPU/GPU/memory monitor")
    sweep.add_argument("--log-format", choices=["console", "json"], default="console", help="log line format")
    sweep.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="lowest level printed (default: the config's tracking.log_level)",
    )


def command_sweep(args: argparse.Namespace) -> int:
    """Run ``flasync sweep``: exit 0 when every run finished, 1 when one failed, 130 or 143 when a signal stopped
    the sweep (``--resume`` continues it)."""
    from flasync.runtime.sweep import Sweep

    if args.parallel < 1:
        raise UsageError(f"--parallel {args.parallel}: must be at least 1")
    uri = tracking.resolve_tracking_uri(args.tracking_uri)
    plan = None if args.resume else _plan(args, uri)  # a bad grid is refused before the store is touched
    try:
        tracking.check_local_store(uri)
    except tracking.StoreNotWritableError as exc:
        raise UsageError(str(exc)) from None
    parent, plan = _parent(args, uri, plan)
    level = args.log_level or plan.configs[0].tracking.log_level
    tracking.configure_logging(fmt=args.log_format, level=level)
    sweep = Sweep(
        plan,
        parallel=args.parallel,
        runner=_run_with_signals,
        worker_init=functools.partial(tracking.configure_logging, fmt=args.log_format, level=level),
        on_start=_Progress(),
    )
    outcome = sweep.run(parent)
    _print_table(outcome, plan)
    if outcome.stopped:
        print(
            f"flasync: sweep stopped ({outcome.stopped}); resume with: python -m flasync sweep --resume "
            f"{outcome.parent_run_id}" + (f" --tracking-uri {tracking.redact_uri(uri)}" if args.tracking_uri else ""),
            file=sys.stderr,
        )
        return stopped_status(outcome.stopped)
    return 1 if any(row.status == "FAILED" for row in outcome.rows) else 0


def _plan(args: argparse.Namespace, uri: str) -> SweepPlan:
    """Build the sweep's plan from its config, ``--set``, ``--grid`` and the tracking and logging flags."""
    from flasync.runtime.sweep import SweepPlan, parse_axis

    overrides = list(args.overrides)
    if args.experiment:
        overrides.append(f"tracking.experiment={args.experiment}")
    if args.log_level:
        overrides.append(f"tracking.log_level={args.log_level}")
    if not args.no_system_metrics:
        overrides.append("tracking.system_metrics=true")
    base = config_data(args.config, overrides)
    section = base.setdefault("tracking", {})
    if isinstance(section, dict):
        # Each child run's model is not logged unless asked for (its weights are): exporting it cost a
        # third of a default run.
        section.setdefault("log_model", False)
    return SweepPlan(base, [parse_axis(spec) for spec in args.grid], uri)


def _parent(args: argparse.Namespace, uri: str, plan: SweepPlan | None) -> tuple[SweepParent, SweepPlan]:
    """Create the parent run of a new sweep of ``plan``, or reopen the interrupted one ``--resume`` names (``plan``
    is None) or finds."""
    from flasync.runtime.sweep_runs import SweepParent

    if plan is None:
        if args.config or args.grid or args.overrides:
            raise ConfigError(f"--resume {args.resume} takes the sweep from its parent run; drop CONFIG, --grid, --set")
        return SweepParent.reopen(uri, args.resume)
    experiment = plan.configs[0].tracking.experiment
    if args.resume is None:
        return SweepParent.create(uri, experiment, plan, parallel=args.parallel), plan
    found = SweepParent.find_unfinished(uri, experiment, plan)
    if found is None:
        raise ConfigError(f"--resume: no unfinished sweep of this config and grid in experiment {experiment!r}")
    return SweepParent.reopen(uri, found)


def _run_with_signals(build: Callable[[], Federation]) -> RunSummary:
    """Run one federation of the sweep; the first SIGINT/SIGTERM stops it cleanly (checkpoint, ``KILLED``)."""
    received: list[str] = []

    async def main() -> RunSummary:
        return await run_with_signals(build(), received)

    return run_loop(main(), builds_inside=True)


class _Progress:
    """Say which run starts (the line a user, or a test, sees each run begin by), and the parent run before the
    first one."""

    def __init__(self) -> None:
        self._told_parent = False

    def __call__(self, task: PointTask, position: int, total: int) -> None:
        from flasync.runtime.sweep_runs import PARENT_TAG

        if not self._told_parent:
            self._told_parent = True
            parent = task.tags.get(PARENT_TAG) or "-"
            print(f"flasync sweep: {total} runs, MLflow parent run {parent}", file=sys.stderr, flush=True)
        how = f" (resuming child run {task.resume_run_id} from its checkpoint)" if task.resume_run_id else ""
        print(f"flasync sweep: run {position}/{total} {task.point.name} started{how}", file=sys.stderr, flush=True)


def _print_table(outcome: SweepOutcome, plan: SweepPlan) -> None:
    """Print the sweep's table, its best run and its parent run."""
    from flasync.runtime.sweep_runs import best_row

    done = "stopped" if outcome.stopped else "finished"
    skipped = f", {outcome.skipped} finished before" if outcome.skipped else ""
    lines = ["", f"flasync sweep {done} ({len(outcome.rows)} of {len(plan.points)} runs{skipped})"]
    width = max([len("point"), *(len(row.point) for row in outcome.rows)])
    lines.append(f"  {'point':<{width}}  status    accuracy  loss     wall_s  updates/s  run")
    for row in outcome.rows:
        lines.append(
            f"  {row.point:<{width}}  {row.status:<8}  {_fmt(row.accuracy, 4):>8}  {_fmt(row.loss, 4):>7}  "
            f"{_fmt(row.wall_s, 2):>6}  {_fmt(row.updates_per_s, 1):>9}  {row.run_id or '-'}"
        )
    for row in outcome.rows:
        if row.status == "FAILED":
            lines.append(f"  failed          {row.point}: {row.error}")
    best = best_row(outcome.rows)
    if best is not None:
        lines.append(f"  best            {best.point} (accuracy {best.accuracy:.4f}, run {best.run_id})")
    lines.append(f"  MLflow parent   {outcome.parent_run_id} (table: sweep/table.csv, plot: sweep/accuracy.svg)")
    print("\n".join(lines), flush=True)


def _fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "-"
