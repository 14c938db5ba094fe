"""A sweep: one run per point of a grid of config overrides, each an MLflow child run of one parent run.

``--grid server.kind=fedavg,fedbuff --grid seed=0..4`` is the cartesian product of its axes: ten points, each a
list of ``--set`` overrides (values parsed as ``--set`` parses them) applied to one base config. Every point's
config is validated before the first run starts, so a wrong key or value costs no run.

The runs go one after another in this process (:class:`Sweep` with ``parallel=1``), or ``parallel`` at a time in
worker processes; either way each process keeps its one MLflow writer process idle between its runs, so a run after
the first does not start another (see :data:`flasync.tracking.IdleChild`). A run a stop request ends (Ctrl-C) is
``KILLED`` with its checkpoint and ends the sweep; :meth:`Sweep.run` on the same parent again skips the points whose
child run ``FINISHED``, resumes the others from their checkpoints (or starts them again) and runs the rest. The
parent run and its children's bookkeeping are :mod:`flasync.runtime.sweep_runs`'.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib
import itertools
import json
import math
import multiprocessing
import multiprocessing.util
import re
import signal
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flasync import tracking
from flasync.config import RunConfig, apply_override, validate
from flasync.core.errors import ConfigError, RunInterrupted
from flasync.core.loops import run_loop
from flasync.runtime import tracked

if TYPE_CHECKING:
    from flasync.runtime.federation import Federation, RunSummary

__all__ = [
    "MAX_POINTS",
    "GridAxis",
    "PointTask",
    "Runner",
    "Sweep",
    "SweepOutcome",
    "SweepPlan",
    "SweepPoint",
    "SweepRow",
    "SweepRuns",
    "parse_axis",
    "run_federation",
    "run_point",
]

MAX_POINTS = 10_000
"""The most points a sweep may have (a range such as ``seed=0..1000000`` is refused, not started)."""

_FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")


@dataclass(frozen=True, slots=True)
class GridAxis:
    """One ``--grid`` option: a config field and the values it takes, as ``--set`` texts.

    Attributes:
        key: The dotted field path (``server.kind``).
        values: Each value's text (``fedavg``, ``3``, ``[64, 64]``), parsed as a ``--set`` value is.
        spec: The option as given.
    """

    key: str
    values: tuple[str, ...]
    spec: str


def parse_axis(spec: str) -> GridAxis:
    """Parse ``PATH=VALUES``: a comma list (``fedavg,fedbuff``; commas inside brackets belong to a list value)
    or an inclusive integer range (``0..4``).

    Raises:
        ConfigError: The option is not ``PATH=VALUES``, its path is not a dotted field path, a value is empty, or
            its range is not ``a..b`` with integers ``a <= b``.
    """
    key, sep, raw = spec.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key or not raw:
        raise ConfigError(f"--grid {spec!r}: expected PATH=VALUES, e.g. seed=0..4 or server.kind=fedavg,fedbuff")
    if not _FIELD_PATH.fullmatch(key):
        raise ConfigError(f"--grid {spec!r}: {key!r} is not a dotted field path")
    ranged = _RANGE.fullmatch(raw.replace(" ", ""))
    if ranged is not None:
        low, high = int(ranged.group(1)), int(ranged.group(2))
        if low > high:
            raise ConfigError(f"--grid {spec!r}: the range {low}..{high} is empty (its start is above its end)")
        if high - low >= MAX_POINTS:
            raise ConfigError(f"--grid {spec!r}: {high - low + 1} values; a sweep has at most {MAX_POINTS} points")
        return GridAxis(key, tuple(str(v) for v in range(low, high + 1)), spec)
    if ".." in raw and "[" not in raw:
        raise ConfigError(f"--grid {spec!r}: a range is two integers, a..b (e.g. seed=0..4)")
    values = tuple(v.strip() for v in _split_top_level(raw))
    if any(not v for v in values):
        raise ConfigError(f"--grid {spec!r}: an empty value in {raw!r}")
    return GridAxis(key, values, spec)


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` at the commas outside brackets and braces (``[64, 64],[32]`` is two values)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One run of a sweep: its place in the grid and the value each axis takes.

    Attributes:
        index: Its position (0-based) in the grid's order: the last axis varies fastest.
        values: ``(key, value text)`` per axis, in the axes' order.
    """

    index: int
    values: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        """The point's name, also its child run's name: ``server.kind=fedbuff,seed=3``."""
        return ",".join(f"{key}={value}" for key, value in self.values)

    @property
    def overrides(self) -> list[str]:
        """The point's ``--set`` overrides."""
        return [f"{key}={value}" for key, value in self.values]


class SweepPlan:
    """What a sweep runs: a base config (a plain mapping, before validation) and its grid's points.

    Args:
        base: The config's tables with the sweep's ``--set`` overrides applied (see
            :func:`flasync.config.config_data`).
        axes: The grid's axes.
        uri: The MLflow store every run logs to (None: the config's); kept out of :meth:`to_json`, since a URI may
            hold credentials.

    Raises:
        ConfigError: No axis, two axes of one field, more than :data:`MAX_POINTS` points, or a point whose config
            is not valid (the message names the point), has tracking off or remote clients.
    """

    def __init__(self, base: Mapping[str, Any], axes: Sequence[GridAxis], uri: str | None = None) -> None:
        """Build the points and validate each one's config."""
        if not axes:
            raise ConfigError("a sweep needs a grid: --grid PATH=VALUES (e.g. --grid seed=0..4)")
        keys = [axis.key for axis in axes]
        twice = sorted({key for key in keys if keys.count(key) > 1})
        if twice:
            raise ConfigError(f"--grid {twice[0]} is given twice; list all its values in one --grid")
        size = math.prod(len(axis.values) for axis in axes)
        if size > MAX_POINTS:
            raise ConfigError(f"the grid has {size} points; a sweep has at most {MAX_POINTS}")
        self.base: dict[str, Any] = copy.deepcopy(dict(base))
        self.axes = tuple(axes)
        self.uri = uri
        self.points = [
            SweepPoint(i, tuple(zip(keys, combo, strict=True)))
            for i, combo in enumerate(itertools.product(*(axis.values for axis in axes)))
        ]
        self.configs = [self._config(point) for point in self.points]

    def _config(self, point: SweepPoint) -> RunConfig:
        data = copy.deepcopy(self.base)
        try:
            for override in point.overrides:
                apply_override(data, override)
            config = validate(data)
        except ConfigError as exc:
            raise ConfigError(f"--grid point {point.name}: {exc}") from None
        if not config.tracking.enabled:
            raise ConfigError("tracking.enabled = false: a sweep's runs are MLflow child runs of one parent run")
        if config.remote.enabled:
            raise ConfigError("remote.enabled: a sweep runs simulated clients only")
        literal = point.name.replace("{", "{{").replace("}", "}}")  # run_name's {fields} are filled in
        named = {"run_name": literal} | ({"uri": self.uri} if self.uri is not None else {})
        return config.model_copy(update={"tracking": config.tracking.model_copy(update=named)})

    def to_json(self) -> dict[str, Any]:
        """Return what :meth:`from_json` rebuilds the plan from (the parent run keeps it as ``sweep/plan.json``)."""
        return {"base": self.base, "grid": [axis.spec for axis in self.axes]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], uri: str | None = None) -> SweepPlan:
        """Rebuild a plan from :meth:`to_json`'s mapping (its runs logging to ``uri``)."""
        return cls(data["base"], [parse_axis(spec) for spec in data["grid"]], uri)

    @property
    def key(self) -> str:
        """A digest of the base config and the grid: equal for the same sweep given again (16 hex digits)."""
        text = json.dumps(self.to_json(), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def grid(self) -> str:
        """The grid as the command line gave it: ``server.kind=fedavg,fedbuff seed=0..4``."""
        return " ".join(axis.spec for axis in self.axes)


@dataclass(frozen=True, slots=True)
class PointTask:
    """One run to do (picklable for a worker process).

    Attributes:
        point: The grid point.
        config: Its validated config (tracking URI and run name set).
        tags: The tags its new child run gets (the parent's id as ``mlflow.parentRunId``, the sweep's).
        resume_run_id: A child run to continue from its newest checkpoint instead (None: a new child run).
    """

    point: SweepPoint
    config: RunConfig
    tags: dict[str, str]
    resume_run_id: str | None = None


@dataclass(frozen=True, slots=True)
class SweepRow:
    """A point's outcome: one row of the sweep's table.

    Attributes:
        index: The point's position in the grid.
        point: The point's name.
        values: Each axis's value text, by key.
        status: ``FINISHED``, ``KILLED`` (stopped, resumable) or ``FAILED``.
        run_id: Its MLflow child run (None: it stopped before the run opened).
        accuracy: Final test accuracy (NaN: not evaluated).
        loss: Final test loss.
        wall_s: Real seconds of its run (of its last segment when resumed).
        updates_per_s: Accepted updates per real second.
        error: Why it stopped or failed (empty when it finished).
    """

    index: int
    point: str
    values: dict[str, str]
    status: str
    run_id: str | None
    accuracy: float = math.nan
    loss: float = math.nan
    wall_s: float = math.nan
    updates_per_s: float = math.nan
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Return the row as a JSON-ready mapping (NaN as None)."""
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


Runner = Callable[[Callable[[], "Federation"]], "RunSummary"]
"""Runs the federation its argument builds, to its summary (the command line's also turns signals into a clean stop:
a stopped run raises :class:`~flasync.core.errors.RunInterrupted`)."""


def run_federation(build: Callable[[], Federation]) -> RunSummary:
    """Build and run a federation in a new event loop, built inside it (as :func:`flasync.run` does)."""

    async def main() -> RunSummary:
        return await build().run()

    return run_loop(main(), builds_inside=True)


def run_point(task: PointTask, runner: Runner = run_federation) -> SweepRow:
    """Run one point of a sweep as an MLflow child run and return its row; a stop or a failure is a row too.

    Raises:
        CheckpointError: ``task.resume_run_id``'s checkpoint cannot be read.
    """
    from flasync.runtime import checkpoint
    from flasync.runtime.federation import Federation

    config, point = task.config, task.point
    resume = None
    if task.resume_run_id is not None:
        fetched = checkpoint.fetch(task.resume_run_id, config.tracking.uri or "")
        resume = checkpoint.ResumePoint(task.resume_run_id, fetched.state, fetched.artifact)
    built: list[Federation] = []

    def build() -> Federation:
        built.append(
            Federation(
                config, tracker=tracked.mlflow_tracker(config), resume=resume, tags=task.tags if not resume else None
            )
        )
        return built[-1]

    row = SweepRow(point.index, point.name, dict(point.values), "FAILED", task.resume_run_id)
    try:
        summary = runner(build)
    except (RunInterrupted, asyncio.CancelledError, KeyboardInterrupt) as exc:
        why = exc.reason if isinstance(exc, RunInterrupted) else "SIGINT"
        return _with_summary(row, built, status="KILLED", error=why)
    except Exception as exc:
        return _with_summary(row, built, status="FAILED", error=f"{type(exc).__name__}: {exc}")
    return _with_summary(row, built, status="FINISHED", summary=summary)


def _with_summary(
    row: SweepRow, built: list[Federation], *, status: str, error: str = "", summary: RunSummary | None = None
) -> SweepRow:
    """Fill ``row`` from the run's (whole or partial) summary."""
    federation = built[-1] if built else None
    summary = summary or (federation.summary if federation is not None else None)
    run_id = (federation.run_id if federation is not None else None) or row.run_id
    if summary is None:
        return SweepRow(row.index, row.point, row.values, status, run_id, error=error)
    return SweepRow(
        row.index,
        row.point,
        row.values,
        status,
        summary.run_id or run_id,
        accuracy=summary.accuracy,
        loss=summary.loss,
        wall_s=summary.wall_s,
        updates_per_s=summary.updates_per_s,
        error=error,
    )


@dataclass(slots=True)
class SweepOutcome:
    """What :meth:`Sweep.run` did.

    Attributes:
        parent_run_id: The sweep's MLflow parent run.
        rows: One row per point that has run (skipped finished ones included), in the grid's order.
        stopped: What stopped the sweep before its end (empty: every point ran).
        skipped: The points whose child run had finished before this call.
    """

    parent_run_id: str
    rows: list[SweepRow] = field(default_factory=list)
    stopped: str = ""
    skipped: int = 0


class SweepRuns(Protocol):
    """Where a sweep's runs are kept: its parent run and the child runs under it (MLflow's is
    :class:`flasync.runtime.sweep_runs.SweepParent`)."""

    @property
    def run_id(self) -> str:
        """The parent run's id."""
        ...

    def finished_rows(self, plan: SweepPlan) -> dict[int, SweepRow]:
        """Return the rows of the points whose child run finished, by point index."""
        ...

    def task(self, plan: SweepPlan, point: SweepPoint, config: RunConfig) -> PointTask:
        """Return the task of a point not finished yet (a new child run, or one to resume)."""
        ...

    def finish(self, plan: SweepPlan, rows: Sequence[SweepRow], status: str) -> None:
        """Log the sweep's table on the parent run and end it with ``status``."""
        ...


class Sweep:
    """Run a plan's points as child runs of one MLflow parent run, ``parallel`` at a time.

    Args:
        plan: What to run.
        parallel: Runs at once: 1 runs them in this process, more in as many spawned worker processes.
        runner: Runs one federation (a module-level function where ``parallel > 1``: it is pickled).
        worker_init: Called first in each worker process (configure its logging); picklable.
        on_start: Told of each run as it starts: its task, its position (1-based) and the number of points.
    """

    def __init__(
        self,
        plan: SweepPlan,
        *,
        parallel: int = 1,
        runner: Runner = run_federation,
        worker_init: Callable[[], None] | None = None,
        on_start: Callable[[PointTask, int, int], None] | None = None,
    ) -> None:
        """Hold the settings; nothing runs yet."""
        if parallel < 1:
            raise ConfigError(f"--parallel {parallel}: must be at least 1")
        self.plan = plan
        self.parallel = parallel
        self._runner = runner
        self._worker_init = worker_init
        self._on_start = on_start or (lambda task, position, total: None)

    def run(self, parent: SweepRuns) -> SweepOutcome:
        """Run every point ``parent`` has no finished child run of, then log the sweep's table on ``parent`` and end
        it: ``FINISHED`` (``FAILED`` when a child failed), or ``KILLED`` when a stop request ended the sweep."""
        if self.parallel == 1:  # torch, while the parent run opens
            importlib.import_module("flasync.runtime.federation")
        outcome = SweepOutcome(parent.run_id)
        rows: dict[int, SweepRow] = {}
        try:
            rows |= parent.finished_rows(self.plan)
            outcome.skipped = len(rows)
            tasks = [parent.task(self.plan, point, config) for point, config in zip(*self._todo(rows), strict=True)]
            run = self._serial if self.parallel == 1 or len(tasks) <= 1 else self._pooled
            outcome.stopped = run(tasks, rows)
        finally:
            outcome.rows = [rows[i] for i in sorted(rows)]
            stopped = outcome.stopped or (len(rows) < len(self.plan.points) and "stopped")
            failed = any(row.status == "FAILED" for row in outcome.rows)
            parent.finish(self.plan, outcome.rows, "KILLED" if stopped else "FAILED" if failed else "FINISHED")
        return outcome

    def _todo(self, done: Mapping[int, SweepRow]) -> tuple[list[SweepPoint], list[RunConfig]]:
        todo = [i for i in range(len(self.plan.points)) if i not in done]
        return [self.plan.points[i] for i in todo], [self.plan.configs[i] for i in todo]

    def _serial(self, tasks: Sequence[PointTask], rows: dict[int, SweepRow]) -> str:
        """Run ``tasks`` one after another in this process; return what stopped them (empty: nothing)."""
        for task in tasks:
            self._on_start(task, task.point.index + 1, len(self.plan.points))
            try:
                row = run_point(task, self._runner)
            except KeyboardInterrupt:
                return "SIGINT"
            rows[row.index] = row
            if row.status == "KILLED":
                return row.error or "stopped"
        return ""

    def _pooled(self, tasks: Sequence[PointTask], rows: dict[int, SweepRow]) -> str:
        """Run ``tasks`` ``parallel`` at a time in worker processes; a stopped run (Ctrl-C reaches the workers too)
        or a ``KeyboardInterrupt`` here starts no further one, and the running ones end as they do."""
        pending, running = deque(tasks), dict[Future[SweepRow], PointTask]()
        stopped = ""
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            self.parallel, mp_context=context, initializer=_start_worker, initargs=(self._worker_init,)
        ) as pool:
            while running or (pending and not stopped):
                try:
                    while pending and not stopped and len(running) < self.parallel:
                        task = pending.popleft()
                        self._on_start(task, task.point.index + 1, len(self.plan.points))
                        running[pool.submit(_run_in_worker, task, self._runner)] = task
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                except KeyboardInterrupt:
                    stopped = stopped or "SIGINT"
                    continue
                for future in finished:
                    row = _row_of(future, running.pop(future))
                    rows[row.index] = row
                    if row.status == "KILLED":
                        stopped = stopped or row.error or "stopped"
        return stopped


def _row_of(future: Future[SweepRow], task: PointTask) -> SweepRow:
    """Return a worker's row, or a ``FAILED`` one when the worker itself failed (its process died)."""
    try:
        return future.result()
    except Exception as exc:
        point = task.point
        return SweepRow(
            point.index, point.name, dict(point.values), "FAILED", task.resume_run_id, error=f"{type(exc).__name__}"
        )


def _start_worker(init: Callable[[], None] | None) -> None:
    """Set up a worker process: Ctrl-C stops the run it is doing (the runner's signal handlers), never the worker
    between runs; then the caller's ``init``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A pool's worker ends without running atexit handlers: the writer process it kept idle is stopped here.
    multiprocessing.util.Finalize(None, tracking.close_idle_writer, exitpriority=10)
    if init is not None:
        init()


def _run_in_worker(task: PointTask, runner: Runner) -> SweepRow:
    """Run one point in a worker process, ignoring Ctrl-C again once it is done (a runner's handlers put Python's
    back)."""
    try:
        return run_point(task, runner)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
