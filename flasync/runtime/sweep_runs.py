"""A sweep's MLflow runs: its parent run (the plan, the table, the comparison plot, the best child) and its children,
found again by their tags to resume a sweep.

MLflow nests a run under another when it carries the tag ``mlflow.parentRunId``: the UI then shows the sweep as one
expandable row. Each child also carries ``flasync.sweep`` (the sweep's id) and ``flasync.sweep.point`` (its grid
point's name), by which :meth:`SweepParent.finished_rows` and :meth:`SweepParent.task` tell what is done.
"""

from __future__ import annotations

import csv
import io
import json
import math
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

from flasync import tracking
from flasync._version import __version__
from flasync.config import RunConfig
from flasync.core.errors import ConfigError
from flasync.core.owner import owner_alive
from flasync.runtime.sweep import PointTask, SweepPlan, SweepPoint, SweepRow
from flasync.tracking.charts import Panel, Stairs, render
from flasync.tracking.store import artifact_location, ensure_experiment, sqlite_path

if TYPE_CHECKING:
    import mlflow
    from mlflow.entities import Run

__all__ = [
    "KEY_TAG",
    "PARENT_TAG",
    "PLAN_ARTIFACT",
    "POINT_TAG",
    "SWEEP_TAG",
    "SweepParent",
    "best_row",
    "table_csv",
]

PARENT_TAG = "mlflow.parentRunId"
"""The tag by which MLflow nests a child run under its parent."""
SWEEP_TAG = "flasync.sweep"
"""The sweep's id, on the parent and on every child."""
POINT_TAG = "flasync.sweep.point"
"""A child's grid point (its name, e.g. ``server.kind=fedbuff,seed=3``)."""
KEY_TAG = "flasync.sweep.key"
"""The parent's digest of the plan (:attr:`SweepPlan.key`): the same sweep given again finds its parent by it."""
PLAN_ARTIFACT = "sweep/plan.json"
"""The parent's copy of the plan, which ``--resume PARENT_RUN_ID`` rebuilds the sweep from."""
_CHECKPOINTS = "checkpoints"
_COLUMNS = ("accuracy", "loss", "wall_s", "updates_per_s")


class SweepParent:
    """The MLflow parent run of a sweep, and its view of the child runs under it.

    Args:
        client: A client of the store.
        run_id: The parent run.
        experiment_id: Its experiment (where its children are too).
        sweep_id: The sweep's id (tag :data:`SWEEP_TAG`).
    """

    def __init__(self, client: mlflow.MlflowClient, run_id: str, experiment_id: str, sweep_id: str) -> None:
        """Hold the run's ids."""
        self._client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.sweep_id = sweep_id

    @classmethod
    def create(cls, uri: str, experiment: str, plan: SweepPlan, *, parallel: int) -> SweepParent:
        """Create the parent run of a new sweep of ``plan``: its tags, its grid as params and ``sweep/plan.json``."""
        client = _client(uri)
        experiment_id = ensure_experiment(client, experiment, artifact_location(uri, experiment))
        sweep_id = uuid.uuid4().hex[:8]
        tags = {
            SWEEP_TAG: sweep_id,
            KEY_TAG: plan.key,
            "flasync.sweep.grid": plan.grid,
            "flasync.version": __version__,
        }
        run = client.create_run(experiment_id, run_name=f"sweep-{sweep_id}", tags=tags)
        run_id = run.info.run_id
        params = {"sweep.grid": plan.grid, "sweep.points": len(plan.points), "sweep.parallel": parallel}
        params |= {f"sweep.axis.{axis.key}": ",".join(axis.values)[:6000] for axis in plan.axes}
        for key, value in params.items():
            client.log_param(run_id, key, value)
        client.log_text(run_id, json.dumps(plan.to_json(), indent=2, default=str), PLAN_ARTIFACT)
        return cls(client, run_id, experiment_id, sweep_id)

    @classmethod
    def reopen(cls, uri: str, run_id: str) -> tuple[SweepParent, SweepPlan]:
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
        if run.info.status == "FINISHED":
            raise ConfigError(f"--resume {run_id}: the sweep already FINISHED; there is nothing to resume")
        if run.info.status == "RUNNING" and owner_alive(tags):
            raise ConfigError(f"--resume {run_id}: the sweep is still running; stop it first (Ctrl-C)")
        plan = SweepPlan.from_json(json.loads(_read_text(client, run_id, PLAN_ARTIFACT)), uri)
        client.update_run(run_id, status="RUNNING")
        return cls(client, run_id, run.info.experiment_id, tags[SWEEP_TAG]), plan

    @staticmethod
    def find_unfinished(uri: str, experiment: str, plan: SweepPlan) -> str | None:
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

    def children(self) -> dict[str, Run]:
        """Return the parent's active child runs by grid point (a finished one before others of its point)."""
        runs = self._client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{PARENT_TAG}` = '{self.run_id}'", max_results=50_000
        )
        found: dict[str, Run] = {}
        for run in sorted(runs, key=lambda r: (r.info.status == "FINISHED", r.info.start_time or 0)):
            point = run.data.tags.get(POINT_TAG)
            if point is not None:
                found[point] = run
        return found

    def finished_rows(self, plan: SweepPlan) -> dict[int, SweepRow]:
        """Return the rows of the points whose child run finished, by point index (read from their
        ``summary.json``)."""
        children = self.children()
        rows: dict[int, SweepRow] = {}
        for point in plan.points:
            run = children.get(point.name)
            if run is not None and run.info.status == "FINISHED":
                summary = json.loads(_read_text(self._client, run.info.run_id, "summary.json"))
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
                )
        return rows

    def task(self, plan: SweepPlan, point: SweepPoint, config: RunConfig) -> PointTask:
        """Return the task of a point not finished yet: to resume its child run from the run's checkpoint, else to
        start a new child run (an earlier one without a checkpoint is deleted, so each point has one child run).

        Raises:
            ConfigError: The point's child run is still running in another process.
        """
        tags = {PARENT_TAG: self.run_id, SWEEP_TAG: self.sweep_id, POINT_TAG: point.name}
        tags |= {f"sweep.{key}": value for key, value in point.values}
        run = self.children().get(point.name)
        if run is None:
            return PointTask(point, config, tags)
        run_id = run.info.run_id
        if run.info.status == "RUNNING" and owner_alive(run.data.tags) is not False:
            raise ConfigError(f"child run {run_id} ({point.name}) is still running; stop it first")
        if any(a.path.endswith(".pt") for a in self._client.list_artifacts(run_id, _CHECKPOINTS)):
            return PointTask(point, config, tags, resume_run_id=run_id)
        self._client.delete_run(run_id)
        return PointTask(point, config, tags)

    def finish(self, plan: SweepPlan, rows: Sequence[SweepRow], status: str) -> None:
        """Log the table (``sweep/table.csv``, ``sweep/table.json``), the accuracy plot (``sweep/accuracy.svg``),
        each point's accuracy (metric ``accuracy``, step = point index) and the best child (tags
        ``flasync.sweep.best``, ``flasync.sweep.best_run_id``, metric ``best_accuracy``); end the run with
        ``status``."""
        client, run_id = self._client, self.run_id
        keys = [axis.key for axis in plan.axes]
        client.log_text(run_id, table_csv(rows, keys), "sweep/table.csv")
        client.log_text(run_id, json.dumps([row.to_dict() for row in rows], indent=2), "sweep/table.json")
        if rows:
            client.log_text(run_id, accuracy_chart(rows), "sweep/accuracy.svg")
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        metrics = [Metric("accuracy", row.accuracy, now, row.index) for row in rows if math.isfinite(row.accuracy)]
        best = best_row(rows)
        tags = []
        if best is not None:
            metrics.append(Metric("best_accuracy", best.accuracy, now, 0))
            tags = [RunTag("flasync.sweep.best", best.point), RunTag("flasync.sweep.best_run_id", best.run_id or "")]
        client.log_batch(run_id, metrics=metrics, tags=tags)
        client.set_terminated(run_id, status)


def best_row(rows: Sequence[SweepRow]) -> SweepRow | None:
    """Return the finished row of the highest accuracy (the first of equals), None when none finished."""
    finished = [row for row in rows if row.status == "FINISHED" and math.isfinite(row.accuracy)]
    return max(finished, key=lambda row: row.accuracy, default=None)


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
    return float(value) if isinstance(value, int | float) else math.nan


def _client(uri: str) -> mlflow.MlflowClient:
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def _read_text(client: mlflow.MlflowClient, run_id: str, path: str) -> str:
    """Return a text artifact of a run."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="flasync-sweep-") as folder:
        return Path(client.download_artifacts(run_id, path, folder)).read_text(encoding="utf-8")
