"""A sweep's MLflow runs: its parent run (the plan, the table, the comparison plot, the best child) and its children,
found again by their tags to resume a sweep.

MLflow nests a run under another when it carries the tag ``mlflow.parentRunId``: the UI then shows the sweep as one
expandable row. Each child also carries ``flasync.sweep`` (the sweep's id), ``flasync.sweep.point`` (its point's
name) and ``flasync.sweep.values`` (its point's values), by which :meth:`SweepParent.finished_rows` and
:meth:`SweepParent.task` tell what is done, and a search rebuilds its trials.
"""

from __future__ import annotations

import csv
import io
import json
import math
import threading
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flasync import tracking
from flasync._version import __version__
from flasync.config import RunConfig
from flasync.config.sweep import parse_objective
from flasync.core.errors import ConfigError
from flasync.core.owner import owner_alive
from flasync.runtime.runs_view import RUNS_VIEW
from flasync.runtime.sweep import (
    DEFAULT_OBJECTIVE,
    PARENT_TAG,
    VALUES_TAG,
    Plan,
    PointTask,
    SweepPlan,
    SweepPoint,
    SweepRow,
)
from flasync.runtime.sweep_search import SearchPlan
from flasync.tracking.charts import Panel, Stairs, render
from flasync.tracking.metrics import MetricRow
from flasync.tracking.store import sqlite_path

if TYPE_CHECKING:
    import mlflow
    from mlflow.entities import Run

__all__ = [
    "KEY_TAG",
    "PARENT_TAG",
    "PLAN_ARTIFACT",
    "POINT_TAG",
    "SWEEP_TAG",
    "TABLE_METRICS",
    "VALUES_TAG",
    "SweepParent",
    "best_row",
    "load_plan",
    "table_csv",
]

SWEEP_TAG = "flasync.sweep"
"""The sweep's id, on the parent and on every child."""
POINT_TAG = "flasync.sweep.point"
"""A child's grid point (its name, e.g. ``server.kind=fedbuff,seed=3``)."""
KEY_TAG = "flasync.sweep.key"
"""The parent's digest of the plan (:attr:`SweepPlan.key`): the same sweep given again finds its parent by it."""
PLAN_ARTIFACT = "sweep/plan.json"
"""The parent's copy of the plan, which ``--resume PARENT_RUN_ID`` rebuilds the sweep from."""
_CHECKPOINTS = "checkpoints"
_COLUMNS = ("accuracy", "loss", "wall_s", "updates_per_s", "objective")


class SweepParent:
    """The MLflow parent run of a sweep, and its view of the child runs under it.

    The parent is written through an :class:`~flasync.tracking.MlflowTracker` of its own, so a new sweep never
    imports MLflow in its process (its writer process does); only a resumed sweep reads the store here, with an
    ``MlflowClient``, to find its child runs. Once the parent run is open its writer process is handed on
    (:meth:`~flasync.tracking.MlflowTracker.release_writer`) to the child runs of this process, one after the other,
    and taken back to log the sweep's table: one MLflow import, one store opened, for the whole sweep.

    Args:
        tracker: The parent run's tracker, its run open.
        uri: The store.
        sweep_id: The sweep's id (tag :data:`SWEEP_TAG`).
        resumed: The sweep ran before (else it has no child runs to look for).
        plan: ``sweep/plan.json``'s bytes, logged once the run is open (empty: it has it already).
    """

    def __init__(
        self, tracker: tracking.MlflowTracker, uri: str, sweep_id: str, *, resumed: bool, plan: bytes = b""
    ) -> None:
        """Hold the parent run (still opening, for a new sweep: see :attr:`run_id`)."""
        self._tracker = tracker
        self._uri = uri
        self.sweep_id = sweep_id
        self._resumed = resumed
        self._plan = plan
        self._run_id = tracker.run_id or ""
        self._opening = threading.Lock()
        self._store: tuple[mlflow.MlflowClient, str] | None = None
        self._children: dict[str, Run] | None = None
        self.parallel: int | None = None
        """A reopened sweep's runs at once, as it was started (a search draws its trials in batches of as many)."""

    @property
    def run_id(self) -> str:
        """The parent run's id, once it is open (the first call waits for it, logs ``sweep/plan.json`` and hands the
        writer process on to the child runs); thread-safe.

        Raises:
            Exception: What opening the run raised (e.g. the experiment is deleted).
        """
        with self._opening:
            if not self._run_id:
                run_id = self._tracker.opened(None)
                if self._plan:
                    self._tracker.log_bytes(self._plan, PLAN_ARTIFACT)
                self._tracker.release_writer()
                self._run_id = run_id
        return self._run_id

    @property
    def opened_run_id(self) -> str:
        """The parent run's id if it is open already, else ``""`` (never waits)."""
        return self._run_id or self._tracker.run_id or ""

    @classmethod
    def create(cls, uri: str, experiment: str, plan: Plan, *, parallel: int) -> SweepParent:
        """Start creating the parent run of a new sweep of ``plan`` (its tags, its grid as params and
        ``sweep/plan.json``) without waiting for it."""
        sweep_id = uuid.uuid4().hex[:8]
        tags = {
            SWEEP_TAG: sweep_id,
            KEY_TAG: plan.key,
            "flasync.sweep.grid": plan.grid,
            "flasync.version": __version__,
        }
        if plan.objective != DEFAULT_OBJECTIVE:
            tags["flasync.sweep.objective"] = plan.objective
        params = plan.params() | {"sweep.parallel": parallel, "sweep.objective": plan.objective}
        tracker = tracking.MlflowTracker(uri, runs_view=RUNS_VIEW)
        tracker.prepare()
        # Opened in the background: this process imports torch meanwhile, and starts the first child run (see
        # Sweep.run), which takes the parent's writer process once the parent run is open.
        tracker.start(experiment=experiment, run_name=f"sweep-{sweep_id}", params=params, tags=tags, wait=False)
        plan_json = json.dumps(plan.to_json(), indent=2, default=str).encode()
        return cls(tracker, uri, sweep_id, resumed=False, plan=plan_json)

    @classmethod
    def reopen(cls, uri: str, run_id: str) -> tuple[SweepParent, Plan]:
        """Reopen the parent run of an interrupted sweep and rebuild its plan.

        Raises:
            ConfigError: There is no such run, it is no sweep's parent, it finished, or it is still running.
        """
        from mlflow.exceptions import MlflowException

        db = sqlite_path(uri)
        if db is not None and not db.is_file():  # no store to make just to find no run in it
            raise ConfigError(f"--resume {run_id}: no MLflow run {run_id!r}: there is no store at {db}")
        client = _client(uri)
        try:
            run = client.get_run(run_id)
        except MlflowException:
            raise ConfigError(f"--resume {run_id}: no MLflow run {run_id!r} in {tracking.redact_uri(uri)}") from None
        tags = run.data.tags
        if SWEEP_TAG not in tags:
            raise ConfigError(f"--resume {run_id}: MLflow run {run_id} is not a sweep's parent run")
        if POINT_TAG in tags:
            raise ConfigError(
                f"--resume {run_id}: MLflow run {run_id} is one of a sweep's runs, not its parent run: "
                f"--resume {tags.get(PARENT_TAG, '')} resumes the sweep"
            )
        if run.info.status == "FINISHED":
            raise ConfigError(f"--resume {run_id}: the sweep already FINISHED; there is nothing to resume")
        if run.info.status == "RUNNING" and owner_alive(tags) is not False:
            raise ConfigError(f"--resume {run_id}: the sweep is still running; stop it first (Ctrl-C)")
        plan = load_plan(json.loads(_read_text(client, run_id, PLAN_ARTIFACT)), uri)
        tracker = tracking.MlflowTracker(uri, runs_view=RUNS_VIEW)
        tracker.resume(run_id, recomputed=TABLE_METRICS)  # an interrupted finish logged the points it had
        tracker.release_writer()  # for the child runs, until the table is logged
        parent = cls(tracker, uri, tags[SWEEP_TAG], resumed=True)
        parent._store = (client, run.info.experiment_id)
        recorded = run.data.params.get("sweep.parallel", "")
        parent.parallel = int(recorded) if recorded.isdigit() and int(recorded) > 0 else None
        return parent, plan

    @staticmethod
    def find_unfinished(uri: str, experiment: str, plan: Plan) -> str | None:
        """Return the newest parent run of a sweep of ``plan`` in ``experiment`` that did not finish (None: none)."""
        client = _client(uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        runs = client.search_runs(
            [found.experiment_id],
            filter_string=f"tags.`{KEY_TAG}` = '{plan.key}' and attributes.status != 'FINISHED'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return runs[0].info.run_id if runs else None

    def _read(self) -> tuple[mlflow.MlflowClient, str]:
        """Return a client of the store and the parent's experiment id."""
        if self._store is None:
            client = _client(self._uri)
            self._store = (client, client.get_run(self.run_id).info.experiment_id)
        return self._store

    def children(self) -> dict[str, Run]:
        """Return the parent's active child runs by grid point (a finished one before others of its point), as they
        were at the first call; none for a new sweep."""
        if not self._resumed:
            return {}
        if self._children is not None:
            return self._children
        client, experiment_id = self._read()
        runs = client.search_runs(
            [experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{self.run_id}'", max_results=50_000
        )
        found: dict[str, Run] = {}
        for run in sorted(runs, key=lambda r: (r.info.status == "FINISHED", r.info.start_time or 0)):
            point = run.data.tags.get(POINT_TAG)
            if point is not None:
                found[point] = run
        self._children = found
        return found

    def _points(self, plan: Plan) -> list[tuple[SweepPoint, Run]]:
        """Return the plan's points that have a child run, with it, in the points' order."""
        found = []
        for name, run in self.children().items():
            point = plan.point_named(name, run.data.tags)
            if point is not None:
                found.append((point, run))
        return sorted(found, key=lambda pair: pair[0].index)

    def finished_rows(self, plan: Plan) -> dict[int, SweepRow]:
        """Return the rows of the points whose child run finished, by point index (read from their
        ``summary.json``)."""
        field = parse_objective(plan.objective)[0]
        rows: dict[int, SweepRow] = {}
        for point, run in self._points(plan):
            if run.info.status == "FINISHED":
                summary = json.loads(_read_text(self._read()[0], run.info.run_id, "summary.json"))
                rows[point.index] = SweepRow(
                    point.index,
                    point.name,
                    dict(point.values),
                    "FINISHED",
                    run.info.run_id,
                    accuracy=_number(summary.get("accuracy")),
                    loss=_number(summary.get("loss")),
                    wall_s=_number(summary.get("wall_s")),
                    updates_per_s=_number(summary.get("updates_per_s")),
                    objective=_number(summary.get(field)),
                )
        return rows

    def unfinished_points(self, plan: Plan) -> list[SweepPoint]:
        """Return the points whose child run did not finish (stopped, killed or failed), in their order."""
        return [point for point, run in self._points(plan) if run.info.status != "FINISHED"]

    def task(self, plan: Plan, point: SweepPoint, config: RunConfig) -> PointTask:
        """Return the task of a point not finished yet: to resume its child run from the run's checkpoint, else to
        start a new child run (an earlier one without a checkpoint is deleted, so each point has one child run). Its
        tags hold :data:`PARENT_TAG` once :attr:`run_id` has answered; a new sweep's first tasks come while the parent
        run is still opening, and :func:`~flasync.runtime.sweep.run_point` then nests the run as it opens
        (``nest_under``), after the parent handed its writer process on.

        Raises:
            ConfigError: The point's child run is still running in another process.
        """
        tags = {PARENT_TAG: self._run_id, SWEEP_TAG: self.sweep_id, POINT_TAG: point.name}
        tags = {key: value for key, value in tags.items() if value}
        tags[VALUES_TAG] = json.dumps({"index": point.index, "values": [list(pair) for pair in point.values]})
        tags |= {f"sweep.{key}": value for key, value in point.values}
        run = self.children().get(point.name)
        if run is None:
            return PointTask(point, config, tags)
        run_id = run.info.run_id
        if run.info.status == "RUNNING" and owner_alive(run.data.tags) is not False:
            raise ConfigError(f"child run {run_id} ({point.name}) is still running; stop it first")
        client = self._read()[0]
        if any(a.path.endswith(".pt") for a in client.list_artifacts(run_id, _CHECKPOINTS)):
            return PointTask(point, config, tags, resume_run_id=run_id)
        client.delete_run(run_id)
        return PointTask(point, config, tags)

    def finish(self, plan: Plan, rows: Sequence[SweepRow], status: str) -> None:
        """Log the table (``sweep/table.csv``, ``sweep/table.json``), the accuracy plot (``sweep/accuracy.svg``),
        each point's accuracy and objective (metrics ``accuracy`` and ``objective``, step = point index) and the best
        child by the objective (tags ``flasync.sweep.best``, ``flasync.sweep.best_run_id``, metrics
        ``best_objective`` and ``best_accuracy``); end the run with ``status``."""
        tracker = self._tracker
        tracker.log_bytes(table_csv(rows, plan.keys).encode(), "sweep/table.csv")
        tracker.log_bytes(json.dumps([row.to_dict() for row in rows], indent=2).encode(), "sweep/table.json")
        if rows:
            tracker.log_bytes(accuracy_chart(rows).encode(), "sweep/accuracy.svg")
        now = int(time.time() * 1000)
        metrics = [MetricRow("accuracy", row.accuracy, now, row.index) for row in rows if math.isfinite(row.accuracy)]
        metrics += [MetricRow("objective", r.objective, now, r.index) for r in rows if math.isfinite(r.objective)]
        best = best_row(rows, plan.objective)
        if best is not None:
            metrics.append(MetricRow("best_objective", best.objective, now, 0))
            if math.isfinite(best.accuracy):
                metrics.append(MetricRow("best_accuracy", best.accuracy, now, 0))
            tracker.set_tags({"flasync.sweep.best": best.point, "flasync.sweep.best_run_id": best.run_id or ""})
        tracker.log_metrics(metrics)
        tracker.finish("KILLED" if status == "KILLED" else "FAILED" if status == "FAILED" else "FINISHED")


TABLE_METRICS = ("accuracy", "objective", "best_objective", "best_accuracy")
"""The parent run's metrics, logged from the whole table by :meth:`SweepParent.finish`."""


def best_row(rows: Sequence[SweepRow], objective: str = DEFAULT_OBJECTIVE) -> SweepRow | None:
    """Return the finished row of the best ``objective`` value (``KEY:max`` or ``KEY:min``; the first of equals),
    None when none finished with a value."""
    sign = 1.0 if parse_objective(objective)[1] == "max" else -1.0
    finished = [row for row in rows if row.status == "FINISHED" and math.isfinite(row.objective)]
    return max(finished, key=lambda row: sign * row.objective, default=None)


def load_plan(data: dict[str, object], uri: str | None = None) -> Plan:
    """Rebuild a grid's or a search's plan from its ``sweep/plan.json`` (its runs logging to ``uri``).

    Raises:
        ConfigError: The plan's config no longer validates.
    """
    if "search" in data:
        return SearchPlan.from_json(data, uri)
    return SweepPlan.from_json(data, uri)


def table_csv(rows: Sequence[SweepRow], keys: Sequence[str]) -> str:
    """Return the sweep's table as CSV: point, each axis's value, status, the figures and the run id."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["index", "point", *keys, "status", *_COLUMNS, "run_id"])
    for row in rows:
        figures = ["" if not math.isfinite(v) else f"{v:.6g}" for v in (getattr(row, c) for c in _COLUMNS)]
        values = (row.values.get(key, "") for key in keys)
        writer.writerow([row.index, row.point, *values, row.status, *figures, row.run_id])
    return out.getvalue()


def accuracy_chart(rows: Sequence[SweepRow]) -> str:
    """Return an SVG bar chart of each point's final accuracy (bar ``i`` at x = the point's index)."""
    bars = [
        Stairs(values=[row.accuracy], edges=[row.index - 0.4, row.index + 0.4], label=row.point)
        for row in rows
        if math.isfinite(row.accuracy)
    ]
    panel = Panel(series=bars, xlabel="grid point", ylabel="final test accuracy", integer_x=True)
    return render([panel], title="Final accuracy per grid point")


def _number(value: object) -> float:
    """Return a summary's figure as a float (NaN for a missing or non-numeric one)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan


def _client(uri: str) -> mlflow.MlflowClient:
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def _read_text(client: mlflow.MlflowClient, run_id: str, path: str) -> str:
    """Return a text artifact of a run."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="flasync-sweep-") as folder:
        return Path(client.download_artifacts(run_id, path, folder)).read_text(encoding="utf-8")
