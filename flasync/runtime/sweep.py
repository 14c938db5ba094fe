"""A sweep: one run per point of a grid of config overrides, each an MLflow child run of one parent run.

``--grid server.kind=fedavg,fedbuff --grid seed=0..4`` is the cartesian product of its axes: ten points, each a
list of ``--set`` overrides (values parsed as ``--set`` parses them) applied to one base config. Every point's
config is validated before the first run starts, so a wrong key or value costs no run. A search
(:class:`flasync.runtime.sweep_search.SearchPlan`) draws its points as it goes instead; both are a :class:`Plan`,
which hands :class:`Sweep` its points in batches.

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
import dataclasses
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flasync import tracking
from flasync.config import RunConfig, apply_override, validate
from flasync.config.sweep import parse_objective, value_text
from flasync.core.errors import ConfigError, RunInterrupted
from flasync.core.loops import run_loop
from flasync.runtime import tracked

if TYPE_CHECKING:
    from flasync.runtime.federation import Federation, RunSummary

__all__ = [
    "DEFAULT_OBJECTIVE",
    "MAX_POINTS",
    "PARENT_TAG",
    "VALUES_TAG",
    "GridAxis",
    "Plan",
    "PointTask",
    "Runner",
    "Sweep",
    "SweepOutcome",
    "SweepPlan",
    "SweepPoint",
    "SweepRow",
    "SweepRuns",
    "grid_axis",
    "parse_axis",
    "point_config",
    "run_federation",
    "run_point",
]

PARENT_TAG = "mlflow.parentRunId"
"""The tag by which MLflow nests a child run under its parent (the UI shows them as one expandable row)."""
VALUES_TAG = "flasync.sweep.values"
"""A child run's point: ``{"index": ..., "values": [[key, text], ...]}`` (JSON), from which a search rebuilds it."""

DEFAULT_OBJECTIVE = "server/eval/accuracy:max"
"""What a sweep's best run is chosen by unless told otherwise: the final test accuracy, the higher the better."""

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


def grid_axis(key: str, values: Sequence[Any] | str) -> GridAxis:
    """Return the axis of a ``[sweep] grid`` entry: a text as ``--grid`` takes it (``"0..4"``), or a list of values
    (each written as a ``--set`` text: ``[64, 64]``, ``1.0e-05``).

    Raises:
        ConfigError: As :func:`parse_axis` does for a text.
    """
    if isinstance(values, str):
        return parse_axis(f"{key}={values}")
    texts = tuple(value_text(value) for value in values)
    return GridAxis(key, texts, f"{key}={','.join(texts)}")


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
        index: Its position (0-based) in the grid's order (the last axis varies fastest), or its trial's number.
        values: ``(key, value text)`` per axis, in the axes' order.
        trial: A search's trial (its name starts with its number: two trials may draw the same values).
    """

    index: int
    values: tuple[tuple[str, str], ...]
    trial: bool = False

    @property
    def name(self) -> str:
        """The point's name, also its child run's name: ``server.kind=fedbuff,seed=3`` (a trial's:
        ``trial 3: client.lr=0.01``)."""
        values = ",".join(f"{key}={value}" for key, value in self.values)
        return f"trial {self.index}: {values}" if self.trial else values

    @property
    def overrides(self) -> list[str]:
        """The point's ``--set`` overrides."""
        return [f"{key}={value}" for key, value in self.values]


def point_config(base: Mapping[str, Any], point: SweepPoint, uri: str | None) -> RunConfig:
    """Return the validated config of ``point``: ``base`` with its overrides, named after it, logging to ``uri``.

    Raises:
        ConfigError: The config is not valid (the message names the point), has tracking off or remote clients.
    """
    data = copy.deepcopy(dict(base))
    try:
        for override in point.overrides:
            apply_override(data, override)
        config = validate(data)
    except ConfigError as exc:
        try:  # wrong without the point's values too: the config or its --set, which the error names as run does
            validate(base)  # reads the mapping, changes nothing
        except ConfigError:
            raise exc from None
        raise ConfigError(f"{point.name}: {exc}" if point.trial else f"--grid point {point.name}: {exc}") from None
    if not config.tracking.enabled:
        raise ConfigError("tracking.enabled = false: a sweep's runs are MLflow child runs of one parent run")
    if config.remote.enabled:
        raise ConfigError("remote.enabled: a sweep runs simulated clients only")
    literal = point.name.replace("{", "{{").replace("}", "}}")  # run_name's {fields} are filled in
    named = {"run_name": literal} | ({"uri": uri} if uri is not None else {})
    return config.model_copy(update={"tracking": config.tracking.model_copy(update=named)})


class Plan(Protocol):
    """What a sweep runs: a grid (:class:`SweepPlan`) or a search
    (:class:`flasync.runtime.sweep_search.SearchPlan`)."""

    @property
    def size(self) -> int:
        """How many runs the sweep makes in all."""
        ...

    @property
    def keys(self) -> list[str]:
        """The fields the sweep varies (the table's columns)."""
        ...

    @property
    def objective(self) -> str:
        """``KEY:max`` or ``KEY:min``: what the best run is chosen by."""
        ...

    @property
    def template(self) -> RunConfig:
        """A run's config before the sweep's values are set (its experiment, logging and store are every run's)."""
        ...

    @property
    def key(self) -> str:
        """A digest of the plan: equal for the same sweep given again."""
        ...

    @property
    def grid(self) -> str:
        """The plan in one line (the parent run's ``flasync.sweep.grid`` tag)."""
        ...

    def params(self) -> dict[str, str | int]:
        """Return the parent run's params describing the plan."""
        ...

    def to_json(self) -> dict[str, Any]:
        """Return what the plan is rebuilt from (the parent run keeps it as ``sweep/plan.json``)."""
        ...

    def point_named(self, name: str, tags: Mapping[str, str]) -> SweepPoint | None:
        """Return the point of a child run by its point's name and its tags (None: not one of this plan's)."""
        ...

    def batches(
        self, rows: Mapping[int, SweepRow], unfinished: Sequence[SweepPoint], parallel: int
    ) -> Iterator[list[tuple[SweepPoint, RunConfig]]]:
        """Yield the points still to run, with their configs, a batch at a time; ``rows`` holds every point's
        outcome so far (it grows as each batch runs) and ``unfinished`` the points a run began but did not
        finish."""
        ...


class SweepPlan:
    """What a sweep runs: a base config (a plain mapping, before validation) and its grid's points.

    Args:
        base: The config's tables with the sweep's ``--set`` overrides applied (see
            :func:`flasync.config.config_data`).
        axes: The grid's axes.
        uri: The MLflow store every run logs to (None: the config's); kept out of :meth:`to_json`, since a URI may
            hold credentials.
        objective: ``KEY:max`` or ``KEY:min`` (:data:`flasync.config.sweep.OBJECTIVE_FIELDS`): what the best run is
            chosen by.

    Raises:
        ConfigError: No axis, two axes of one field, more than :data:`MAX_POINTS` points, a point whose config
            is not valid (the message names the point), has tracking off or remote clients, or a wrong objective.
    """

    def __init__(
        self,
        base: Mapping[str, Any],
        axes: Sequence[GridAxis],
        uri: str | None = None,
        objective: str = DEFAULT_OBJECTIVE,
    ) -> None:
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
        try:
            parse_objective(objective)
        except ValueError as exc:
            raise ConfigError(f"objective {objective!r}: {exc}") from None
        self.base: dict[str, Any] = copy.deepcopy(dict(base))
        self.axes = tuple(axes)
        self.uri = uri
        self._objective = objective
        self.points = [
            SweepPoint(i, tuple(zip(keys, combo, strict=True)))
            for i, combo in enumerate(itertools.product(*(axis.values for axis in axes)))
        ]
        self.configs = [point_config(self.base, point, uri) for point in self.points]
        self._by_name = {point.name: point for point in self.points}

    @property
    def size(self) -> int:
        """The number of points."""
        return len(self.points)

    @property
    def keys(self) -> list[str]:
        """The axes' fields."""
        return [axis.key for axis in self.axes]

    @property
    def objective(self) -> str:
        """What the best run is chosen by (``KEY:max`` or ``KEY:min``)."""
        return self._objective

    @property
    def template(self) -> RunConfig:
        """The first point's config."""
        return self.configs[0]

    def params(self) -> dict[str, str | int]:
        """Return the grid as the parent run's params: ``sweep.grid``, ``sweep.points``, ``sweep.axis.<field>``."""
        params: dict[str, str | int] = {"sweep.grid": self.grid, "sweep.points": len(self.points)}
        return params | {f"sweep.axis.{axis.key}": ",".join(axis.values) for axis in self.axes}

    def to_json(self) -> dict[str, Any]:
        """Return what :meth:`from_json` rebuilds the plan from (the parent run keeps it as ``sweep/plan.json``)."""
        data: dict[str, Any] = {"base": self.base, "grid": [axis.spec for axis in self.axes]}
        if self._objective != DEFAULT_OBJECTIVE:
            data["objective"] = self._objective
        return data | {"axes": [[axis.key, list(axis.values)] for axis in self.axes]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], uri: str | None = None) -> SweepPlan:
        """Rebuild a plan from :meth:`to_json`'s mapping (its runs logging to ``uri``)."""
        objective = data.get("objective", DEFAULT_OBJECTIVE)
        if "axes" in data:  # each value as it was (a text of the grid may not split back where it was joined)
            specs = dict(zip((key for key, _ in data["axes"]), data["grid"], strict=True))
            axes = [GridAxis(key, tuple(values), specs[key]) for key, values in data["axes"]]
            return cls(data["base"], axes, uri, objective)
        return cls(data["base"], [parse_axis(spec) for spec in data["grid"]], uri, objective)

    @property
    def key(self) -> str:
        """A digest of the base config and the grid: equal for the same sweep given again (16 hex digits)."""
        data = {key: value for key, value in self.to_json().items() if key != "axes"}
        text = json.dumps(data, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def point_named(self, name: str, tags: Mapping[str, str]) -> SweepPoint | None:
        """Return the grid's point of that name."""
        return self._by_name.get(name)

    def batches(
        self, rows: Mapping[int, SweepRow], unfinished: Sequence[SweepPoint], parallel: int
    ) -> Iterator[list[tuple[SweepPoint, RunConfig]]]:
        """Yield every point without a row, in the grid's order, as one batch."""
        todo = [(point, config) for point, config in zip(self.points, self.configs, strict=True)]
        todo = [(point, config) for point, config in todo if point.index not in rows]
        if todo:
            yield todo

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
        tags: The tags its new child run gets (the sweep's; the parent's id as :data:`PARENT_TAG`, unless
            :func:`run_point` is told how to find it as the run opens).
        resume_run_id: A child run to continue from its newest checkpoint instead (None: a new child run).
        objective: The run summary's field the sweep's objective reads (its row's ``objective``).
    """

    point: SweepPoint
    config: RunConfig
    tags: dict[str, str]
    resume_run_id: str | None = None
    objective: str = "accuracy"


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
        objective: The figure the sweep's objective names (NaN: not reported).
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
    objective: float = math.nan

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


def run_point(
    task: PointTask, runner: Runner = run_federation, nest_under: Callable[[], str] | None = None
) -> SweepRow:
    """Run one point of a sweep as an MLflow child run and return its row; a stop or a failure is a row too.

    ``nest_under`` returns the parent run's id (:data:`PARENT_TAG`) when ``task.tags`` lacks it: asked as the
    child run opens, after its training has begun, so a parent run still opening holds up no training.

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
    trackers: list[tracking.MlflowTracker] = []

    def build() -> Federation:
        tracker = tracked.mlflow_tracker(config, nest_under=None if resume or PARENT_TAG in task.tags else nest_under)
        trackers.append(tracker)
        built.append(Federation(config, tracker=tracker, resume=resume, tags=task.tags if not resume else None))
        return built[-1]

    row = SweepRow(point.index, point.name, dict(point.values), "FAILED", task.resume_run_id)
    try:
        summary = runner(build)
    except (RunInterrupted, asyncio.CancelledError, KeyboardInterrupt) as exc:
        why = exc.reason if isinstance(exc, RunInterrupted) else "SIGINT"
        return _with_summary(row, built, trackers, task.objective, status="KILLED", error=why)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return _with_summary(row, built, trackers, task.objective, status="FAILED", error=error)
    return _with_summary(row, built, trackers, task.objective, status="FINISHED", summary=summary)


def _with_summary(
    row: SweepRow,
    built: list[Federation],
    trackers: list[tracking.MlflowTracker],
    objective: str,
    *,
    status: str,
    error: str = "",
    summary: RunSummary | None = None,
) -> SweepRow:
    """Fill ``row`` from the run's (whole or partial) summary, its ``objective`` from the summary's field of that
    name; its run id from the federation, else from its tracker (a run stopped while its MLflow run was still being
    opened: the federation never learnt the id, the store has the run)."""
    federation = built[-1] if built else None
    summary = summary or (federation.summary if federation is not None else None)
    opened = trackers[-1].run_id if trackers else None
    run_id = (federation.run_id if federation is not None else None) or opened or row.run_id
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
        objective=_figure(getattr(summary, objective, math.nan)),
    )


def _figure(value: object) -> float:
    """Return a summary's figure as a float (NaN for a missing or non-numeric one)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


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

    def finished_rows(self, plan: Plan) -> dict[int, SweepRow]:
        """Return the rows of the points whose child run finished, by point index."""
        ...

    def unfinished_points(self, plan: Plan) -> list[SweepPoint]:
        """Return the points whose child run began but did not finish."""
        ...

    def task(self, plan: Plan, point: SweepPoint, config: RunConfig) -> PointTask:
        """Return the task of a point not finished yet (a new child run, or one to resume); its tags need not hold
        :data:`PARENT_TAG` (the parent run may still be opening)."""
        ...

    def finish(self, plan: Plan, rows: Sequence[SweepRow], status: str) -> None:
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
        plan: Plan,
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
        """Run every point ``parent`` has no finished child run of, batch after batch as the plan hands them out,
        then log the sweep's table on ``parent`` and end it: ``FINISHED`` (``FAILED`` when a child failed), or
        ``KILLED`` when a stop request ended the sweep."""
        if self.parallel == 1:  # torch, while the parent run opens
            importlib.import_module("flasync.runtime.federation")
        outcome = SweepOutcome("")  # the parent run's id once it is open: the first run does not wait for it
        rows: dict[int, SweepRow] = {}
        objective = parse_objective(self.plan.objective)[0]
        try:
            with ExitStack() as pools:
                rows |= parent.finished_rows(self.plan)
                outcome.skipped = len(rows)
                pool: list[ProcessPoolExecutor] = []
                for batch in self.plan.batches(rows, parent.unfinished_points(self.plan), self.parallel):
                    tasks = [parent.task(self.plan, point, config) for point, config in batch]
                    tasks = [dataclasses.replace(task, objective=objective) for task in tasks]
                    if self.parallel == 1 or (len(tasks) <= 1 and not pool):
                        outcome.stopped = self._serial(tasks, rows, parent)
                    else:
                        pool = pool or [pools.enter_context(self._pool())]
                        # A worker process is handed its parent run's id (it cannot wait for the run to open).
                        tasks = [dataclasses.replace(t, tags={PARENT_TAG: parent.run_id, **t.tags}) for t in tasks]
                        outcome.stopped = self._pooled(pool[0], tasks, rows)
                    if outcome.stopped:
                        break
        finally:
            outcome.rows = [rows[i] for i in sorted(rows)]
            stopped = outcome.stopped or (len(rows) < self.plan.size and "stopped")
            failed = any(row.status == "FAILED" for row in outcome.rows)
            outcome.parent_run_id = parent.run_id  # raises what opening it raised: then there is no run to end
            parent.finish(self.plan, outcome.rows, "KILLED" if stopped else "FAILED" if failed else "FINISHED")
        return outcome

    def _pool(self) -> ProcessPoolExecutor:
        """Return ``parallel`` worker processes (spawned: a forked torch is not safe), kept for the whole sweep."""
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(
            self.parallel, mp_context=context, initializer=_start_worker, initargs=(self._worker_init,)
        )

    def _serial(self, tasks: Sequence[PointTask], rows: dict[int, SweepRow], parent: SweepRuns) -> str:
        """Run ``tasks`` one after another in this process, each nested under ``parent`` as its run opens (the first
        trains while the parent run is still being opened); return what stopped them (empty: nothing).

        Raises:
            Exception: What opening the parent run raised (e.g. its experiment is deleted).
        """
        for task in tasks:
            self._on_start(task, task.point.index + 1, self.plan.size)
            try:
                row = run_point(task, self._runner, nest_under=lambda: parent.run_id)
            except KeyboardInterrupt:
                return "SIGINT"
            rows[row.index] = row
            _ = parent.run_id  # raises what opening the parent run raised: the sweep ends with that error
            if row.status == "KILLED":
                return row.error or "stopped"
        return ""

    def _pooled(self, pool: ProcessPoolExecutor, tasks: Sequence[PointTask], rows: dict[int, SweepRow]) -> str:
        """Run ``tasks`` ``parallel`` at a time in ``pool``'s worker processes; a stopped run (Ctrl-C reaches the
        workers too) or a ``KeyboardInterrupt`` here starts no further one, and the running ones end as they do."""
        pending, running = deque(tasks), dict[Future[SweepRow], PointTask]()
        stopped = ""
        while running or (pending and not stopped):
            try:
                while pending and not stopped and len(running) < self.parallel:
                    task = pending.popleft()
                    self._on_start(task, task.point.index + 1, self.plan.size)
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
