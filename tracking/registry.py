"""The MLflow Model Registry: register a run's logged model and move the alias ``champion`` to it when it is better.

A run's model is registered as a new version of a registered model (made if missing): its source is the logged
model's artifact location, and the logged model lists the version (its tag ``mlflow.modelVersions``, as
``mlflow.register_model`` keeps it). The version is tagged with the run, the model version it holds, the metric it
was selected by (key, direction and value) and the training data's digest. The alias :data:`CHAMPION` moves to the
new version only when its value is strictly better than the one the current champion's tags state for the same
metric and direction; a tie, another metric, or a champion without those tags keeps the alias where it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flasync.tracking.model_metrics import latest_ready_model

if TYPE_CHECKING:
    import mlflow
    from mlflow.entities.model_registry import ModelVersion

__all__ = ["CHAMPION", "Registration", "register_champion"]

CHAMPION = "champion"
"""The alias that names the best registered version."""
_MODEL_VERSIONS = "mlflow.modelVersions"
"""The logged model's tag listing the registered versions made from it (``mlflow.utils.mlflow_tags``)."""


@dataclass(frozen=True, slots=True)
class Registration:
    """What :func:`register_champion` did."""

    name: str
    """The registered model."""
    version: int
    """The registry version made for the run's model."""
    champion: int
    """The version the alias names now (``version`` when it moved)."""
    message: str
    """One line saying it, e.g. ``registered digits version 3, alias champion``."""

    @property
    def moved(self) -> bool:
        """Whether the alias now names the run's version."""
        return self.champion == self.version


def register_champion(
    client: mlflow.MlflowClient,
    name: str,
    *,
    run_id: str,
    model_name: str,
    metric: str,
    direction: str,
    value: float,
    tags: Mapping[str, str],
) -> Registration:
    """Register the run's logged model ``model_name`` under ``name`` and move :data:`CHAMPION` to it if it is better.

    Args:
        client: The store's client.
        name: The registered model's name.
        run_id: The run that logged the model.
        model_name: The logged model's name in the run (``model``, ``best_model``).
        metric: The metric key the model was selected by, e.g. ``server/eval/accuracy``.
        direction: ``max`` or ``min``: whether a larger or a smaller value is better.
        value: The metric's value for this model.
        tags: Further tags of the registered version (the model version it holds, the data set's digest).

    Raises:
        LookupError: The run has no logged model of that name.
        mlflow.MlflowException: What the store refuses.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    run = client.get_run(run_id)
    logged = latest_ready_model(client, run_id, model_name, run.info.experiment_id)
    if logged is None:
        raise LookupError(f"the run {run_id} has no logged model {model_name!r} to register")
    model_id, location = logged.model_id, logged.artifact_location
    digest = next((d.dataset.digest for d in run.inputs.dataset_inputs), "") if run.inputs else ""
    version_tags = {
        **tags,
        "flasync.run_id": run_id,
        "flasync.metric": metric,
        "flasync.direction": direction,
        "flasync.value": repr(value),
        **({"flasync.dataset_digest": digest} if digest else {}),
    }
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    champion = _champion(client, name)
    # The logged model's artifact location as the source, not ``models:/<model_id>``: a SQL registry resolves that
    # URI through the process's global tracking URI (MLflow 3), which need not be this client's store.
    made = client.create_model_version(name, source=location, run_id=run_id, tags=version_tags, model_id=model_id)
    version = int(made.version)
    _link(client, logged.tags.get(_MODEL_VERSIONS), model_id, name, version)
    kept = _keeps(champion, metric, direction, value)
    if champion is None or kept is None:
        client.set_registered_model_alias(name, CHAMPION, str(version))
        return Registration(name, version, version, f"registered {name} version {version}, alias {CHAMPION}")
    return Registration(name, version, int(champion.version), f"registered {name} version {version}; {kept}")


def _link(client: mlflow.MlflowClient, listed: str | None, model_id: str, name: str, version: int) -> None:
    """Add the registered version to the logged model's list of them (its tag ``mlflow.modelVersions``, which
    MLflow's UI shows on the model's page, as ``mlflow.register_model`` keeps it)."""
    versions = json.loads(listed) if listed else []
    versions.append({"name": name, "version": version})
    client.set_logged_model_tags(model_id, {_MODEL_VERSIONS: json.dumps(versions)})


def _champion(client: mlflow.MlflowClient, name: str) -> ModelVersion | None:
    """Return the version the alias names (None: no version has it)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def _keeps(champion: ModelVersion | None, metric: str, direction: str, value: float) -> str | None:
    """Return why ``champion`` keeps the alias against a model of ``value`` (None: it does not)."""
    if champion is None:
        return None
    tags = champion.tags or {}
    old = f"kept {CHAMPION} version {champion.version}"
    if tags.get("flasync.metric") != metric or tags.get("flasync.direction") != direction:
        held = f"{tags.get('flasync.metric', 'no metric')}:{tags.get('flasync.direction', '?')}"
        return f"{old} (it was selected by {held}, not {metric}:{direction})"
    try:
        theirs = float(tags["flasync.value"])
    except (KeyError, ValueError):
        return f"{old} (it has no flasync.value tag)"
    if math.isnan(value):
        return f"{old} ({metric} of this run is NaN)"
    if math.isnan(theirs) or (value > theirs if direction == "max" else value < theirs):
        return None
    sign = "=" if value == theirs else ">" if theirs > value else "<"
    return f"{old} ({theirs:.4g} {sign} {value:.4g})"
