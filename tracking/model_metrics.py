"""Link a run's evaluation metrics to its logged models, so that a model's page in the MLflow UI (its Metrics tab)
and ``MlflowClient.search_logged_models`` show the figures of the evaluation that rated it.

MLflow 3 links a metric to a logged model by the metric's ``model_id``; its store then writes the point into the
run's series and into the model's metrics in one ``log_batch``. The points are linked once the run's metrics are
stored: :func:`link_evaluation` reads the run's evaluation series back from the store and sends each point again,
with the same key, value, timestamp and step and the model's id. The store keeps one row per point of a run's series
(the same point sent twice is written once), so the run's series are unchanged and the model gets the points.
Linking after the fact, in ``log_batch`` calls of at most 1000 points, covers every way a point reaches the store
(the writer process's direct SQLite writes, a replayed spool, the segments of a resumed run) and adds nothing to the
metric writer's path while the run trains.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlflow
    from mlflow.entities import LoggedModel

    from flasync.tracking.sqlite_metrics import SqliteMetrics

__all__ = ["EVALUATION_PREFIXES", "latest_ready_model", "link_evaluation", "link_models", "logged_model_id"]

EVALUATION_PREFIXES = ("server/eval/", "client_eval/")
"""The metric keys of the evaluation (the central one, and the clients' reports): those linked to a run's models."""

_MAX_BATCH = 1000
"""Most metrics per ``log_batch`` call (MLflow's limit)."""


def latest_ready_model(
    client: mlflow.MlflowClient, run_id: str, name: str, experiment_id: str | None = None
) -> LoggedModel | None:
    """Return the run's ``READY`` logged model named ``name`` created last (None: there is none); ``experiment_id``:
    the run's experiment, if the caller has it."""
    if experiment_id is None:
        experiment_id = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND name = '{name}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
    )
    return next((model for model in found if str(model.status) == "READY"), None)


def logged_model_id(client: mlflow.MlflowClient, run_id: str, name: str) -> str | None:
    """Return the id of the run's ``READY`` logged model named ``name`` (the latest created; None: there is none)."""
    model = latest_ready_model(client, run_id, name)
    return None if model is None else str(model.model_id)


def link_evaluation(
    client: mlflow.MlflowClient,
    run_id: str,
    model_id: str,
    *,
    step: int | None = None,
    prefixes: Sequence[str] = EVALUATION_PREFIXES,
    max_batch: int = _MAX_BATCH,
    direct: SqliteMetrics | None = None,
) -> int:
    """Link the run's evaluation metrics to the logged model ``model_id`` (see the module); return the points linked.

    Args:
        client: The store's client.
        run_id: The run whose metrics are linked (active: not deleted).
        model_id: The logged model they are linked to (of the run's experiment).
        step: Only the points of this step (a model version: the evaluation of the version the model holds); every
            point of the series when None. NaN points are left out: a logged model's metrics cannot hold NaN (MLflow
            would store 0).
        prefixes: The keys linked: those starting with one of these.
        max_batch: Most points per ``log_batch`` call.
        direct: The store's SQLite writer (the writer process's, see :mod:`flasync.tracking.sqlite_metrics`): the
            points are read from its ``metrics`` table in one query, not through ``client`` (the run, then each
            series: a query each), and linked in one transaction of that connection where the store's tables are
            the shape it knows, not through ``log_batch`` (which reads the run and writes each point again).

    Raises:
        mlflow.MlflowException: What the store refuses.
    """
    from mlflow.entities import Metric

    if direct is not None:
        rows = direct.points(run_id, prefixes, step)
        if direct.link(run_id, model_id, rows):
            return len(rows)
        points = [Metric(*row, model_id=model_id) for row in rows]
    else:
        keys = sorted(key for key in client.get_run(run_id).data.metrics if key.startswith(tuple(prefixes)))
        points = [
            Metric(point.key, point.value, point.timestamp, point.step, model_id=model_id)
            for key in keys
            for point in client.get_metric_history(run_id, key)
            if (step is None or point.step == step) and not math.isnan(point.value)
        ]
    for first in range(0, len(points), max_batch):
        client.log_batch(run_id, metrics=points[first : first + max_batch], synchronous=True)
    return len(points)


def link_models(
    client: mlflow.MlflowClient,
    run_id: str,
    models: Mapping[str, int],
    *,
    logged: Mapping[str, str] | None = None,
    direct: SqliteMetrics | None = None,
) -> int:
    """Link to each of the run's ``READY`` logged models named in ``models`` the evaluation points of its step (the
    version it holds); return the points linked (a name the run has no ready model of links nothing).

    Args:
        client: The store's client.
        run_id: The run.
        models: The step of each model by its name.
        logged: The ids of the run's latest ``READY`` models of some of those names, known to the caller (it logged
            them): no search of the store for them.
        direct: The store's SQLite writer, if it has one: the points are read in one query and linked in one
            transaction (see :func:`link_evaluation`).

    Raises:
        mlflow.MlflowException: What the store refuses.
    """
    known = logged or {}
    linked = 0
    for name, step in models.items():
        model_id = known.get(name) or logged_model_id(client, run_id, name)
        if model_id is not None:
            linked += link_evaluation(client, run_id, model_id, step=step, direct=direct)
    return linked
