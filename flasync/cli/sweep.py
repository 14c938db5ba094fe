"""``flasync sweep``: a grid or a search of experiments, each an MLflow child run of one parent run; Ctrl-C, then
``--resume``. A config file's ``[sweep]`` section (:mod:`flasync.config.sweep`) gives the same settings as the flags,
which override it."""

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
from flasync.config import apply_override, config_data
from flasync.config.sweep import MAX_TRIALS, SweepConfig, sweep_section, value_text
from flasync.core.errors import ConfigError
from flasync.core.loops import run_loop

if TYPE_CHECKING:
    from flasync.runtime.federation import Federation, RunSummary
    from flasync.runtime.sweep import Plan, PointTask, SweepOutcome
    from flasync.runtime.sweep_runs import SweepParent


def add_sweep_parser(commands: Any) -> None:
    """Add ``flasync sweep [CONFIG] --grid PATH=VALUES ... [--set PATH=VALUE] [--parallel N] [--objective KEY:DIR]
    [--trials N] [--resume [RUN_ID]]``."""
    sweep = commands.add_parser(
        "sweep",
        help="run a grid or a search of experiments as MLflow child runs of one parent run",
        description=(
            "Run one experiment per point of a grid (the cartesian product of the --grid options), or per trial of "
            "a search (the config's [sweep.search], with Optuna), each an MLflow child run of one parent run, which "
            "logs the table of results and a comparison plot. The config's [sweep] section sets what the flags "
            "set; a flag overrides it. Ctrl-C stops the current run with a checkpoint; --resume continues the sweep."
        ),
    )
    sweep.add_argument(
        "config", nargs="?", help="a .toml or .yaml run config, with a [sweep] section or not (default: built-in)"
    )
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
    sweep.add_argument(
        "--parallel", type=int, metavar="N", help="runs at once, in N worker processes (default: sweep.parallel, 1)"
    )
    sweep.add_argument(
        "--objective",
        metavar="KEY:DIR",
        help="what the best run is chosen by and a search optimizes, e.g. server/eval/loss:min "
        "(default: sweep.objective, server/eval/accuracy:max)",
    )
    sweep.add_argument("--trials", type=int, metavar="N", help="a search's number of trials (sweep.search.trials)")
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

    for flag, value in (("--parallel", args.parallel), ("--trials", args.trials)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if args.trials is not None and args.trials > MAX_TRIALS:
        raise UsageError(f"--trials {args.trials}: a search has at most {MAX_TRIALS} trials")
    uri = tracking.resolve_tracking_uri(args.tracking_uri)
    plan, parallel = (None, args.parallel or 1) if args.resume else _plan(args, uri)  # refused before the store
    try:
        tracking.check_local_store(uri)
    except tracking.StoreNotWritableError as exc:
        raise UsageError(str(exc)) from None
    parent, plan = _parent(args, uri, plan, parallel)
    if args.resume is not None and args.parallel is None:  # as it was started: a search's batches stay the same
        parallel = parent.parallel or parallel
    level = args.log_level or plan.template.tracking.log_level
    tracking.configure_logging(fmt=args.log_format, level=level)
    _quiet_optuna(plan)
    sweep = Sweep(
        plan,
        parallel=parallel,
        runner=_run_with_signals,
        worker_init=functools.partial(tracking.configure_logging, fmt=args.log_format, level=level),
        on_start=_Progress(parent),
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


def _plan(args: argparse.Namespace, uri: str) -> tuple[Plan, int]:
    """Build the sweep's plan from its config and its ``[sweep]`` section, then the flags: ``--set`` after the
    section's ``set``, a ``--grid`` in place of the section's axis of its field, ``--objective``, ``--trials``,
    ``--parallel`` in place of the section's; return it and the runs at once."""
    from flasync.runtime.sweep import SweepPlan, grid_axis, parse_axis
    from flasync.runtime.sweep_search import SearchPlan

    base = config_data(args.config)
    own = [o for o in args.overrides if o.strip().startswith("sweep.")]  # --set sweep.search.trials=5
    section = _section(base, own)
    for key, value in section.set.items():
        apply_override(base, f"{key}={value_text(value)}")
    for override in [*(o for o in args.overrides if o not in own), *_tracking_overrides(args)]:
        apply_override(base, override)
    tables = base.setdefault("tracking", {})
    if isinstance(tables, dict):
        # Each child run's model is not logged unless asked for (its weights are): exporting it cost a
        # third of a default run.
        tables.setdefault("log_model", False)
    objective = args.objective or section.objective
    parallel = args.parallel or section.parallel
    search = section.search
    if args.trials is not None:
        if search is None:
            raise ConfigError("--trials: the sweep is not a search (the config has no [sweep.search])")
        search = search.model_copy(update={"trials": args.trials})
    if search is not None:
        if args.grid:
            raise ConfigError("--grid: the config's [sweep] is a search; a sweep is a grid or a search, not both")
        return SearchPlan(base, search, uri, objective), parallel
    axes = {key: grid_axis(key, values) for key, values in section.grid.items()}
    given = [parse_axis(spec) for spec in args.grid]
    keys = [axis.key for axis in given]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ConfigError(f"--grid {twice[0]} is given twice; list all its values in one --grid")
    axes |= {axis.key: axis for axis in given}
    return SweepPlan(base, list(axes.values()), uri, objective), parallel


def _section(base: dict[str, Any], overrides: list[str]) -> SweepConfig:
    """Take the ``[sweep]`` section out of ``base`` with ``--set sweep.*`` applied, validated (an empty one when the
    config has none)."""
    table = {"sweep": base.pop("sweep", None) or {}}
    for override in overrides:
        apply_override(table, override)
    return sweep_section(table) or SweepConfig()


def _tracking_overrides(args: argparse.Namespace) -> list[str]:
    """Return the ``--set`` overrides the tracking and logging flags stand for."""
    overrides = []
    if args.experiment:
        overrides.append(f"tracking.experiment={args.experiment}")
    if args.log_level:
        overrides.append(f"tracking.log_level={args.log_level}")
    if not args.no_system_metrics:
        overrides.append("tracking.system_metrics=true")
    return overrides


def _quiet_optuna(plan: Plan) -> None:
    """Keep Optuna's informational lines (a study made in memory for each batch of trials) off the console."""
    from flasync.runtime.sweep_search import SearchPlan

    if isinstance(plan, SearchPlan):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)


def _parent(args: argparse.Namespace, uri: str, plan: Plan | None, parallel: int) -> tuple[SweepParent, Plan]:
    """Create the parent run of a new sweep of ``plan``, or reopen the interrupted one ``--resume`` names (``plan``
    is None) or finds."""
    from flasync.runtime.sweep_runs import SweepParent

    if plan is None:
        if args.config or args.grid or args.overrides or args.objective or args.trials:
            raise ConfigError(
                f"--resume {args.resume} takes the sweep from its parent run; drop CONFIG, --grid, --set, "
                "--objective, --trials"
            )
        return SweepParent.reopen(uri, args.resume)
    experiment = plan.template.tracking.experiment
    if args.resume is None:
        return SweepParent.create(uri, experiment, plan, parallel=parallel), plan
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
    """Say which run starts (the line a user, or a test, sees each run begin by), and the parent run once it is open:
    before the first run, or (a new sweep's first run trains while its parent run opens) before a later one.

    Args:
        parent: The sweep's parent run.
    """

    def __init__(self, parent: SweepParent) -> None:
        self._parent = parent
        self._told_size = self._told_parent = False

    def __call__(self, task: PointTask, position: int, total: int) -> None:
        parent = self._parent.opened_run_id
        if not self._told_size:
            self._told_size, self._told_parent = True, bool(parent)
            named = f", MLflow parent run {parent}" if parent else ""
            print(f"flasync sweep: {total} runs{named}", file=sys.stderr, flush=True)
        elif parent and not self._told_parent:
            self._told_parent = True
            print(f"flasync sweep: MLflow parent run {parent}", file=sys.stderr, flush=True)
        how = f" (resuming child run {task.resume_run_id} from its checkpoint)" if task.resume_run_id else ""
        print(f"flasync sweep: run {position}/{total} {task.point.name} started{how}", file=sys.stderr, flush=True)


_ENDED = (("KILLED", "stopped"), ("FAILED", "failed"))
"""How a stopped sweep's header counts the runs it reached that did not finish."""


def _print_table(outcome: SweepOutcome, plan: Plan) -> None:
    """Print the sweep's table, its best run and its parent run."""
    from flasync.runtime.sweep_runs import best_row

    skipped = f", {outcome.skipped} finished before" if outcome.skipped else ""
    if outcome.stopped:  # the runs it reached are not all finished: say how many are
        statuses = [row.status for row in outcome.rows]
        ended = [f"{statuses.count(status)} {word}" for status, word in _ENDED if statuses.count(status)]
        head = f"stopped ({statuses.count('FINISHED')} of {plan.size} runs finished, {', '.join(ended)}{skipped})"
    else:
        head = f"finished ({len(outcome.rows)} of {plan.size} runs{skipped})"
    lines = ["", f"flasync sweep {head}"]
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
    best = best_row(outcome.rows, plan.objective)
    if best is not None:
        lines.append(f"  best            {best.point} ({plan.objective} {best.objective:.6g}, run {best.run_id})")
    lines.append(f"  MLflow parent   {outcome.parent_run_id} (table: sweep/table.csv, plot: sweep/accuracy.svg)")
    print("\n".join(lines), flush=True)


def _fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else "-"
