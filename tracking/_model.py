"""A PyTorch model as an MLflow logged model of a run, saved by the tracker's process or by its writer process.

:meth:`tracking.MlflowTracker.log_model` saves a module it is given; :func:`log_built_model` builds the module from
an importable builder first, which is how the writer process (:mod:`tracking._child`) logs a model: the module never
crosses the process boundary (nothing is pickled), only the builder's name and JSON keyword arguments do. Saving
imports ``torch.export`` and MLflow's pytorch flavour (about two seconds) and traces the model; in the writer
process's helper (:func:`save_for`) that runs beside training rather than after it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlflow
    import torch
    from mlflow.models import Model

__all__ = [
    "build",
    "call",
    "log_built_model",
    "log_to_run",
    "requirements",
    "save_built",
    "save_for",
    "save_model",
    "warm_up",
]


def requirements() -> list[str]:
    """Return the pip requirements a logged model states: this MLflow and this torch (nothing inferred)."""
    import mlflow
    import torch

    return [f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}"]


def save_model(
    model: torch.nn.Module,
    local: str,
    *,
    description: Model | None = None,
    input_example: Any = None,
    log: Any = None,
) -> None:
    """Save ``model`` in MLflow's ``pt2`` format (``torch.export``) at ``local``, or as a pickle when it cannot be
    exported or there is no ``input_example``.

    Args:
        model: The model.
        local: A folder that does not exist yet.
        description: The MLflow model description to complete (of a logged model), if any.
        input_example: A batch of inputs (a NumPy array); its signature becomes the model's.
        log: Where the fallback to pickle is reported (an info event ``tracking.model_pickled``).
    """
    import mlflow.pytorch

    pip = requirements()
    if input_example is not None:
        try:
            mlflow.pytorch.save_model(
                model,
                local,
                mlflow_model=description,
                serialization_format="pt2",
                input_example=input_example,
                pip_requirements=pip,
            )
            return
        except Exception as exc:  # not exportable: fall back to pickle
            shutil.rmtree(local, ignore_errors=True)
            if log is not None:
                log.info("tracking.model_pickled", reason=f"{type(exc).__name__}: {exc}"[:300], metrics=False)
    mlflow.pytorch.save_model(
        model, local, mlflow_model=description, serialization_format="pickle", pip_requirements=pip
    )


def warm_up() -> None:
    """Save a throwaway two-layer model as :func:`save_model` does, into a temporary folder.

    The first model a process saves in the ``pt2`` format costs about 1.4 s more than the next (``torch.export``'s
    first trace, MLflow's first look at the installed packages); the writer process pays it while the run trains,
    so saving the run's model at its end takes some 0.05 s.
    """
    import numpy as np
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    with tempfile.TemporaryDirectory(prefix="tracking-warm-up-") as tmp:
        save_model(model, os.path.join(tmp, "model"), input_example=np.zeros((2, 4), dtype=np.float32))


def log_to_run(
    client: mlflow.MlflowClient,
    run_id: str,
    experiment_id: str,
    name: str,
    save: Callable[[str, Model], None],
) -> None:
    """Create a logged model linked to the run (its output at step 0), fill it with ``save(folder, description)``
    and mark it ``READY`` (``FAILED`` if saving or sending fails, then raise)."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    logged = client.create_logged_model(experiment_id, name=name, source_run_id=run_id)
    try:
        with tempfile.TemporaryDirectory(prefix="tracking-model-") as tmp:
            local = os.path.join(tmp, "model")
            description = Model(
                artifact_path=logged.artifact_location,
                run_id=run_id,
                model_uuid=logged.model_id,
                model_id=logged.model_id,
            )
            save(local, description)
            client.log_model_artifacts(logged.model_id, local)
        client.log_outputs(run_id, [LoggedModelOutput(logged.model_id, step=0)])
        client.finalize_logged_model(logged.model_id, "READY")
    except BaseException:
        with contextlib.suppress(Exception):
            client.finalize_logged_model(logged.model_id, "FAILED")
        raise


def call(target: str, kwargs: Mapping[str, Any]) -> Any:
    """Return ``target(**kwargs)``, ``target`` naming an importable callable as ``package.module:name``."""
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)(**kwargs)


def build(builder: str, kwargs: Mapping[str, Any]) -> torch.nn.Module:
    """Return the module ``builder(**kwargs)`` makes (see :func:`call`)."""
    model: torch.nn.Module = call(builder, kwargs)
    return model


def save_for(
    *,
    folder: str,
    builder: str,
    kwargs: Mapping[str, Any],
    description: Mapping[str, str] | None = None,
    input_example: Sequence[Any] | None = None,
    input_dtype: str = "float32",
) -> None:
    """Build a model with ``builder(**kwargs)`` and save it as :func:`save_model` does at ``folder``.

    Takes JSON values only: what the writer's helper process runs for a model job (see :mod:`tracking._child`).

    Args:
        folder: A folder that does not exist yet.
        builder: ``package.module:name`` of a callable returning the ``nn.Module`` with its final weights.
        kwargs: Its keyword arguments (JSON values).
        description: The fields of the logged model's MLflow description (``artifact_path``, ``run_id``,
            ``model_uuid``, ``model_id``), if it is saved for one.
        input_example: A batch of inputs as nested lists (made an array of ``input_dtype``).
        input_dtype: The NumPy dtype of the inputs.
    """
    import numpy as np

    model = None
    if description is not None:
        from mlflow.models import Model

        model = Model(
            artifact_path=description["artifact_path"],
            run_id=description["run_id"],
            model_uuid=description["model_uuid"],
            model_id=description["model_id"],
        )
    example = None if input_example is None else np.asarray(input_example, dtype=input_dtype)
    save_model(build(builder, kwargs), folder, description=model, input_example=example)


def save_built(
    *,
    folder: str,
    builder: str,
    kwargs: Mapping[str, Any],
    name: str = "model",
    input_example: Sequence[Any] | None = None,
    input_dtype: str = "float32",
) -> None:
    """Build a model with ``builder(**kwargs)`` and save it as :func:`save_model` does into ``folder/name``.

    What a one-shot process runs (see :mod:`tracking._files`) when a tracker spools the model of a run whose store
    fails: ``torch.export`` and MLflow's pytorch flavour are never imported in the tracker's process.

    Args:
        folder: An existing folder.
        builder: ``package.module:name`` of a callable returning the ``nn.Module`` with its final weights.
        kwargs: Its keyword arguments (JSON values).
        name: The saved model's folder inside ``folder``.
        input_example: A batch of inputs as nested lists (made an array of ``input_dtype``).
        input_dtype: The NumPy dtype of the inputs.
    """
    save_for(
        folder=os.path.join(folder, name),
        builder=builder,
        kwargs=kwargs,
        input_example=input_example,
        input_dtype=input_dtype,
    )


def log_built_model(
    client: mlflow.MlflowClient,
    run_id: str,
    *,
    experiment_id: str,
    builder: str,
    kwargs: Mapping[str, Any],
    name: str = "model",
    input_example: Sequence[Any] | None = None,
    input_dtype: str = "float32",
    aside: Callable[[dict[str, Any]], bool] | None = None,
) -> float:
    """Build a model with ``builder(**kwargs)`` and log it to the run (see :func:`log_to_run`); return the seconds.

    Args:
        client: The store's client.
        run_id: The run.
        experiment_id: The run's experiment.
        builder: ``package.module:name`` of a callable returning the ``nn.Module`` with its final weights.
        kwargs: Its keyword arguments (JSON values).
        name: The logged model's name.
        input_example: A batch of inputs as nested lists (made an array of ``input_dtype``).
        input_dtype: The NumPy dtype of the inputs.
        aside: Has :func:`save_for`'s keyword arguments (a JSON object) done in another process; returns False
            when it cannot (then this process builds and saves the model).
    """
    began = time.perf_counter()

    def save(local: str, description: Model) -> None:
        fields = ("artifact_path", "run_id", "model_uuid", "model_id")
        request: dict[str, Any] = {
            "folder": local,
            "builder": builder,
            "kwargs": dict(kwargs),
            "description": {field: getattr(description, field) for field in fields},
            "input_example": None if input_example is None else list(input_example),
            "input_dtype": input_dtype,
        }
        if aside is None or not aside(request):
            save_for(**request)

    log_to_run(client, run_id, experiment_id, name, save)
    return time.perf_counter() - began
