"""A PyTorch model as an MLflow logged model of a run, saved by the tracker's process or by its writer process.

:meth:`tracking.MlflowTracker.log_model` saves a module it is given; :func:`log_built_model` builds the module from
an importable builder first, which is how the writer process (:mod:`flasync.tracking._child`) logs a model: the module
never
crosses the process boundary (nothing is pickled), only the builder's name and JSON keyword arguments do. Saving
imports ``torch.export`` and MLflow's pytorch flavour (about two seconds) and traces the model; in the writer
process's helper (:func:`save_for`) that runs beside training rather than after it. The trace itself (about 50 ms
of the 60 ms a small model's save takes) can run beside training too: :class:`Exports` exports a model of the same
structure while the run trains, and the save at its end only swaps the final weights into that export.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from flasync.tracking.exports import ExportCache

if TYPE_CHECKING:
    import mlflow
    import torch
    from mlflow.models import Model
    from torch.export import ExportedProgram

__all__ = [
    "Exports",
    "ModelLogged",
    "build",
    "call",
    "describe",
    "log_built_model",
    "log_saved_model",
    "log_to_run",
    "requirements",
    "save_built",
    "save_for",
    "save_model",
    "skip_package_scan",
    "warm_up",
]


def requirements() -> list[str]:
    """Return the pip requirements a logged model states: this MLflow and this torch (nothing inferred)."""
    import mlflow
    import torch

    return [f"mlflow=={mlflow.__version__}", f"torch=={torch.__version__.split('+')[0]}"]


def skip_package_scan() -> None:
    """Spare this process MLflow's scan of every installed package when it saves models (call it where only models
    stating :func:`requirements` are saved: the writer process's helper).

    Given explicit requirements, MLflow's ``save_model`` still checks them against the installed packages, and first
    maps the modules of every installed distribution (``importlib_metadata.packages_distributions``: each one's file
    list, some 0.7 s of CPU for a hundred packages, once per process). The requirements flasync states are the
    installed MLflow and torch, which that check looks up by their distributions' names; here MLflow's map is made
    of those two, so the scan never runs. An MLflow that keeps no such map, or has made it already, is left alone.
    """
    try:
        from mlflow.utils import requirements_utils
    except ImportError:  # pragma: no cover - an MLflow without that module checks as it likes
        return
    if getattr(requirements_utils, "_MODULES_TO_PACKAGES", False) is None:
        setattr(requirements_utils, "_MODULES_TO_PACKAGES", {"mlflow": ["mlflow"], "torch": ["torch"]})  # noqa: B010


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

    if input_example is not None:
        try:
            _save_pt2(model, local, description, input_example)
            return
        except Exception as exc:  # not exportable: fall back to pickle
            shutil.rmtree(local, ignore_errors=True)
            if log is not None:
                log.info("tracking.model_pickled", reason=f"{type(exc).__name__}: {exc}"[:300], metrics=False)
    mlflow.pytorch.save_model(
        model, local, mlflow_model=description, serialization_format="pickle", pip_requirements=requirements()
    )


def _save_pt2(model: torch.nn.Module, local: str, description: Model | None, input_example: Any) -> None:
    """Save ``model`` in MLflow's ``pt2`` format at ``local`` (raising what ``torch.export`` raises).

    An exported program keeps its weights on the device it was exported on: its ``python_function`` flavour is told
    that device, which ``mlflow.pyfunc.load_model`` would otherwise take to be the first GPU wherever CUDA is (and
    refuse to load it there).
    """
    import mlflow.pytorch
    import torch
    from mlflow.models import Model
    from mlflow.models.model import MODEL_CONFIG

    mlflow.pytorch.save_model(
        model,
        local,
        mlflow_model=description,
        serialization_format="pt2",
        input_example=input_example,
        pip_requirements=requirements(),
    )
    path = os.path.join(local, _MLMODEL)
    saved = Model.load(path)
    pyfunc = saved.flavors.get("python_function")
    if pyfunc is not None:
        device = next((t.device for t in itertools.chain(model.parameters(), model.buffers())), torch.device("cpu"))
        pyfunc[MODEL_CONFIG] = {**(pyfunc.get(MODEL_CONFIG) or {}), "device": str(device)}
        saved.save(path)


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


_KEPT_EXPORTS = 4
"""How many prepared exports an :class:`Exports` keeps (the most recently prepared ones)."""
_MLMODEL = "MLmodel"
_DESCRIBED = ("artifact_path", "run_id", "model_uuid", "model_id", "utc_time_created")
"""The fields of an MLflow model's description that say which logged model it is and when it was saved."""


@dataclass(frozen=True)
class _Prepared:
    """A model saved in the ``pt2`` format ahead of its final weights (see :class:`Exports`)."""

    program: ExportedProgram
    """The exported program, whose weights a later save replaces."""
    module: torch.nn.Module
    """The program as a module (sharing its tensors): its outputs check the weights swapped in."""
    classes: tuple[str, ...]
    """The exported model's module classes, in :meth:`torch.nn.Module.modules` order."""
    files: dict[str, bytes]
    """The saved folder's files but the archive, by their paths relative to it."""
    archive: str
    """The archive's path in the folder (``data/model.pt2``)."""
    archive_bytes: int
    """The archive's size as first saved."""
    kwargs: str
    """The builder's arguments it was exported from (JSON)."""

    def fits(self, model: torch.nn.Module, example: torch.Tensor) -> bool:
        """Swap ``model``'s weights into the program and tell whether it is then ``model``'s export: the same module
        classes, the same parameters and buffers (names, shapes, dtypes) and the same outputs on ``example``."""
        import torch

        if _classes(model) != self.classes:
            return False
        tensors = _tensors(model)
        targets = {**self.program.state_dict, **self.program.constants}
        if tensors.keys() != targets.keys():  # a module's extra state, too, is no tensor of the program
            return False
        for name, tensor in tensors.items():
            target = targets[name]
            if not isinstance(target, torch.Tensor) or target.shape != tensor.shape or target.dtype != tensor.dtype:
                return False
        with torch.no_grad():
            values = {name: tensor.detach().clone() for name, tensor in tensors.items()}
            for name, value in values.items():
                targets[name].copy_(value)
            same = _close(model(example), self.module(example))
            # A forward in training mode updates buffers (batch-norm statistics): the program keeps the model's own.
            for name, value in values.items():
                targets[name].copy_(value)
        return same


class Exports:
    """Models exported ahead of their save, so that saving one with its final weights skips ``torch.export``'s
    trace (about 50 ms of the 60 ms a small model's ``pt2`` save takes).

    :meth:`prepare` builds a model and saves it as :func:`save_model` does, keeping the exported program and the
    saved folder's other files (its signature, input example and environment) for its builder and input example
    (asked again for the same builder, arguments and example, it keeps what it has).
    :meth:`save`, given a model from the same builder and input example, swaps that model's weights into the
    program, checks that the program then computes what the model does, and writes the folder: what
    :func:`save_model` would have written, but for the description's own fields (which logged model, when). A model
    of another structure is refused, and saved as :func:`save_model` does by the caller. The most recent
    :data:`_KEPT_EXPORTS` exports are kept; one prepare or save runs at a time (a save waits for a prepare still
    going on, whose export it then uses).
    """

    def __init__(self, kept: int = _KEPT_EXPORTS) -> None:
        self._kept = kept
        self._lock = threading.Lock()
        self._prepared: OrderedDict[tuple[str, str, str], _Prepared] = OrderedDict()

    def __len__(self) -> int:
        """Return how many exports are kept."""
        return len(self._prepared)

    def prepare(
        self,
        *,
        builder: str,
        kwargs: Mapping[str, Any],
        input_example: Sequence[Any],
        input_dtype: str = "float32",
        cache: str | None = None,
    ) -> None:
        """Build the model ``builder(**kwargs)`` returns (its weights do not matter) and export it for the models
        :meth:`save` is later given from ``builder`` with ``input_example``.

        Args:
            builder: ``package.module:name`` of a callable returning the ``nn.Module`` (see :func:`call`).
            kwargs: Its keyword arguments (JSON values).
            input_example: A batch of inputs as nested lists (made an array of ``input_dtype``).
            input_dtype: The NumPy dtype of the inputs.
            cache: The folder of an :class:`~flasync.tracking.exports.ExportCache` that keeps the export for later
                processes too (None: only this object keeps it).

        Raises:
            Exception: What building, exporting or saving the model raises (nothing is kept then).
        """
        import numpy as np
        import torch

        key = _export_key(builder, input_example, input_dtype)
        arguments = json.dumps(dict(kwargs), sort_keys=True)
        with self._lock:
            kept = self._prepared.get(key)
            if kept is not None and kept.kwargs == arguments:  # the same model as a run before (a sweep, a service)
                self._prepared.move_to_end(key)
                return
        model = build(builder, kwargs)
        with self._lock, tempfile.TemporaryDirectory(prefix="tracking-export-") as tmp:
            local = os.path.join(tmp, "model")
            _save_pt2(model, local, None, np.asarray(input_example, dtype=input_dtype))
            files: dict[str, bytes] = {}
            archives: list[str] = []
            for root, _, names in os.walk(local):
                for name in names:
                    relative = os.path.relpath(os.path.join(root, name), local)
                    if name.endswith(".pt2"):
                        archives.append(relative)
                    else:
                        with open(os.path.join(root, name), "rb") as file:
                            files[relative] = file.read()
            if len(archives) != 1 or _MLMODEL not in files:
                raise RuntimeError(f"the saved model has {len(archives)} pt2 archives and MLmodel {_MLMODEL in files}")
            archive = os.path.join(local, archives[0])
            program = torch.export.load(archive)
            size = os.path.getsize(archive)
            prepared = _Prepared(program, program.module(), _classes(model), files, archives[0], size, arguments)
            self._prepared[key] = prepared
            self._prepared.move_to_end(key)
            while len(self._prepared) > self._kept:
                self._prepared.popitem(last=False)
            if cache is not None:
                lasting = ExportCache(Path(cache))
                key_there = lasting.key(builder, kwargs, input_example, input_dtype)
                lasting.put(key_there, files, archives[0], archive, program)

    def save(
        self,
        model: torch.nn.Module,
        folder: str,
        *,
        builder: str,
        input_example: Sequence[Any],
        input_dtype: str = "float32",
        description: Model | None = None,
    ) -> bool:
        """Save ``model`` at ``folder`` as :func:`save_model` does, from the export prepared for ``builder`` and
        ``input_example`` (see the class); False, writing nothing, when none was or ``model`` does not fit it.

        Args:
            model: The model, built by ``builder``.
            folder: A folder that does not exist yet.
            builder: The builder that built ``model``.
            input_example: Its batch of inputs as nested lists.
            input_dtype: The NumPy dtype of the inputs.
            description: The MLflow model description of the logged model it is saved for, if any.

        Raises:
            Exception: What writing the folder raises (it may be left partly written).
        """
        import numpy as np
        import torch

        with self._lock:
            prepared = self._prepared.get(_export_key(builder, input_example, input_dtype))
            example = torch.from_numpy(np.asarray(input_example, dtype=input_dtype))
            if prepared is None or not prepared.fits(model, example):
                return False
            os.makedirs(folder)
            for relative, content in prepared.files.items():
                path = os.path.join(folder, relative)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as file:
                    file.write(content)
            archive = os.path.join(folder, prepared.archive)
            os.makedirs(os.path.dirname(archive), exist_ok=True)
            torch.export.save(prepared.program, archive)
            describe(folder, description, os.path.getsize(archive) - prepared.archive_bytes)
            return True


def describe(folder: str, description: Model | None, size_delta: int) -> None:
    """Make the saved model at ``folder`` (saved for another logged model, or none) the one ``description`` describes:
    its own fields (which logged model, when), its size changed by ``size_delta`` bytes (its archive's change)."""
    from mlflow.models import Model

    path = os.path.join(folder, _MLMODEL)
    described = Model.load(path)
    fresh = description if description is not None else Model()
    for field in _DESCRIBED:
        setattr(described, field, getattr(fresh, field))
    if described.model_size_bytes is not None:
        described.model_size_bytes += size_delta
    described.save(path)


def _export_key(builder: str, input_example: Sequence[Any], input_dtype: str) -> tuple[str, str, str]:
    """Return what an :class:`Exports` keeps an export by."""
    return (builder, json.dumps(list(input_example)), input_dtype)


def _classes(model: torch.nn.Module) -> tuple[str, ...]:
    """Return the classes of ``model``'s modules, in :meth:`torch.nn.Module.modules` order."""
    return tuple(f"{type(module).__module__}.{type(module).__qualname__}" for module in model.modules())


def _tensors(model: torch.nn.Module) -> dict[str, Any]:
    """Return ``model``'s parameters and buffers (non-persistent ones too) by name, with any extra state its state
    dict holds."""
    tensors: dict[str, Any] = dict(model.state_dict(keep_vars=True))
    tensors.update(model.named_buffers())
    return tensors


def _close(expected: Any, got: Any) -> bool:
    """Tell whether two outputs (tensors, or tuples and lists of them) are the same up to float rounding."""
    import torch

    if isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor):
        return (
            expected.shape == got.shape
            and expected.dtype == got.dtype
            and bool(torch.allclose(expected, got, rtol=1e-5, atol=1e-6, equal_nan=True))
        )
    if isinstance(expected, (tuple, list)) and isinstance(got, (tuple, list)) and len(expected) == len(got):
        return all(_close(a, b) for a, b in zip(expected, got, strict=True))
    return False


def log_to_run(
    client: mlflow.MlflowClient,
    run_id: str,
    experiment_id: str,
    name: str,
    save: Callable[[str, Model], None],
    tags: Mapping[str, str] | None = None,
) -> str:
    """Create a logged model linked to the run (its output at step 0), with ``tags``, fill it with
    ``save(folder, description)`` and mark it ``READY`` (``FAILED`` if saving or sending fails, then raise); return
    its id."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    logged = client.create_logged_model(
        experiment_id, name=name, source_run_id=run_id, tags=dict(tags) if tags else None
    )
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
    return str(logged.model_id)


class ModelLogged(NamedTuple):
    """A model logged to a run by :func:`log_saved_model` or :func:`log_built_model`."""

    model_id: str
    """The logged model's id (``READY``)."""
    seconds: float
    """How long logging it took."""


def log_saved_model(
    client: mlflow.MlflowClient,
    run_id: str,
    *,
    experiment_id: str,
    saved: str,
    name: str = "model",
    size_delta: int = 0,
    tags: Mapping[str, str] | None = None,
) -> ModelLogged:
    """Log the model saved at ``saved`` (a ``pt2`` folder whose weights were swapped into a kept export, see
    :mod:`flasync.tracking.exports`; ``size_delta``: its archive's size less the kept one's) to the run, described as
    its logged model (see :func:`log_to_run`)."""
    began = time.perf_counter()

    def save(local: str, description: Model) -> None:
        shutil.copytree(saved, local)
        describe(local, description, size_delta)

    model_id = log_to_run(client, run_id, experiment_id, name, save, tags)
    return ModelLogged(model_id, time.perf_counter() - began)


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
    exports: Exports | None = None,
) -> None:
    """Build a model with ``builder(**kwargs)`` and save it as :func:`save_model` does at ``folder``.

    Takes JSON values only (and ``exports``): what the writer's helper process runs for a model job (see
    :mod:`flasync.tracking._child`).

    Args:
        folder: A folder that does not exist yet.
        builder: ``package.module:name`` of a callable returning the ``nn.Module`` with its final weights.
        kwargs: Its keyword arguments (JSON values).
        description: The fields of the logged model's MLflow description (``artifact_path``, ``run_id``,
            ``model_uuid``, ``model_id``), if it is saved for one.
        input_example: A batch of inputs as nested lists (made an array of ``input_dtype``).
        input_dtype: The NumPy dtype of the inputs.
        exports: Exports prepared ahead (see :class:`Exports`): one made for ``builder`` and ``input_example`` is
            used when the model fits it.
    """
    import numpy as np

    described = None
    if description is not None:
        from mlflow.models import Model

        described = Model(
            artifact_path=description["artifact_path"],
            run_id=description["run_id"],
            model_uuid=description["model_uuid"],
            model_id=description["model_id"],
        )
    model = build(builder, kwargs)
    if exports is not None and input_example is not None and not os.path.exists(folder):
        try:
            if exports.save(
                model,
                folder,
                builder=builder,
                input_example=input_example,
                input_dtype=input_dtype,
                description=described,
            ):
                return
        except Exception:  # the export made ahead is only a shortcut: the full save below reports what fails
            shutil.rmtree(folder, ignore_errors=True)
    example = None if input_example is None else np.asarray(input_example, dtype=input_dtype)
    save_model(model, folder, description=described, input_example=example)


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

    What a one-shot process runs (see :mod:`flasync.tracking._files`) when a tracker spools the model of a run whose
    store
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
    exports: Exports | None = None,
    tags: Mapping[str, str] | None = None,
) -> ModelLogged:
    """Build a model with ``builder(**kwargs)`` and log it to the run (see :func:`log_to_run`).

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
        exports: The exports this process prepared ahead (see :class:`Exports`), for a model it saves itself.
        tags: The logged model's tags.
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
            save_for(**request, exports=exports)

    model_id = log_to_run(client, run_id, experiment_id, name, save, tags)
    return ModelLogged(model_id, time.perf_counter() - began)
