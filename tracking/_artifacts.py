"""A tracked run's artifacts and models: files, bytes, plots and tables, data set inputs, logged models."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from flasync.tracking import _files, _model
from flasync.tracking._writers import RunWriters
from flasync.tracking.exports import ExportCache, default_export_cache, save_from_cache
from flasync.tracking.failover import Failover, RunIdentity
from flasync.tracking.spool import SpoolWriter, dataset_input

if TYPE_CHECKING:
    import mlflow
    import torch

__all__ = ["RunArtifacts", "artifact_bytes", "yaml_text"]


class RunArtifacts:
    """Store a run's artifacts and models: through the writer process where there is one, else from this process,
    or into the spool while the store fails.

    Args:
        run: The run the artifacts belong to.
        writers: The writer process's owner (:meth:`RunWriters.child_job`).
        failover: Routes records to the store or the spool.
        check_started: Waits for the run being opened; raises RuntimeError when there is none.
        log: Where warnings go.
    """

    def __init__(
        self,
        run: RunIdentity,
        writers: RunWriters,
        failover: Failover,
        *,
        check_started: Callable[[], None],
        log: Any,
    ) -> None:
        """Hold the parts the artifacts go through."""
        self._run = run
        self._writers = writers
        self._failover = failover
        self._check_started = check_started
        self._log = log
        self._deferred = itertools.count(1)
        """Numbers the writer process's deferred jobs (see :meth:`start_model_from`)."""
        self._exports = ExportCache(default_export_cache())
        """Models exported by earlier processes (see :mod:`flasync.tracking.exports`)."""

    def log_file(self, path: str | Path, artifact_path: str | None) -> None:
        """Store a local file or folder as an artifact in folder ``artifact_path``."""
        self._check_started()
        local = os.fspath(path)
        if self._writers.child_job({"op": "file", "path": os.path.abspath(local), "folder": artifact_path}):
            return

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            client.log_artifact(run_id, local, artifact_path)

        self._failover.deliver(send, lambda spool: spool.artifact_path(local, artifact_path))

    def log_artifacts(self, files: Mapping[str, bytes]) -> None:
        """Store several artifacts, with a writer process in one job (see
        :meth:`flasync.tracking.MlflowTracker.log_artifacts`)."""
        self._check_started()
        names = {artifact_file: _artifact_name(artifact_file) for artifact_file in files}
        if not files:
            return
        if self._writers.has_child:
            with tempfile.TemporaryDirectory(prefix="tracking-") as tmp:
                entries = []
                for local, artifact_file in _local_files(Path(tmp), names):
                    local.write_bytes(files[artifact_file])
                    entries.append([str(local), names[artifact_file][0] or None])
                if self._writers.child_job({"op": "files", "files": entries}):
                    return
        for artifact_file, data in files.items():  # storing a file twice replaces it: those stored already are kept
            self._deliver_bytes(data, artifact_file, *names[artifact_file])

    def _deliver_bytes(self, data: bytes, artifact_file: str, folder: str, name: str) -> None:
        """Store ``data`` as the artifact ``artifact_file`` (``folder/name``) from this process, or spool it."""

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            with tempfile.TemporaryDirectory(prefix="tracking-") as tmp:
                local = Path(tmp, name)
                local.write_bytes(data)
                client.log_artifact(run_id, str(local), folder or None)

        self._failover.deliver(send, lambda spool: spool.artifact_bytes(data, artifact_file))

    def log_dataset(self, name: str, digest: str, source: str, profile: Mapping[str, Any], context: str) -> None:
        """Record a data set as an MLflow dataset input of the run."""
        self._check_started()
        text = json.dumps(dict(profile), default=str)
        dataset = {"name": name, "digest": digest, "source": source, "profile": text, "context": context}
        if self._writers.child_job({"op": "dataset", "dataset": dataset}):
            return

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            client.log_inputs(run_id, datasets=[dataset_input(name, digest, source, text, context)])

        self._failover.deliver(send, lambda spool: spool.dataset(name, digest, source, text, context))

    def link_models(self, models: Mapping[str, int]) -> int:
        """Link the run's evaluation points of each step to its logged model of that name
        (:func:`flasync.tracking.model_metrics.link_models`); return the points linked. The writer process does it
        where there is one (the store is open there), else this process; nothing while the store fails (the run's
        records go to the spool). Call it once the run's metrics are written (:meth:`RunWriters.flush`).

        Raises:
            Exception: What the store raises when this process links.
        """
        self._check_started()
        if self._failover.offline:
            return 0
        reply = self._writers.child_reply({"op": "link", "models": dict(models)})
        if reply is not None:
            return int(reply)
        from flasync.tracking.model_metrics import link_models

        run_id = self._run.run_id
        assert run_id is not None
        return link_models(self._run.connect(self._log), run_id, models)

    def log_model(
        self, model: torch.nn.Module, name: str, input_example: Any, tags: Mapping[str, str] | None = None
    ) -> float:
        """Store a PyTorch model as an MLflow logged model of the run; return the seconds taken.

        With an ``input_example`` (a small batch of inputs, a NumPy array) the model is saved in MLflow's ``pt2``
        format (``torch.export``: loading it runs no pickle, and its signature comes from the example); a model
        ``torch.export`` cannot trace, or no example, falls back to the ``pickle`` format (loading it unpickles the
        model class, which must be importable; MLflow warns about that).

        ``mlflow.pytorch.log_model`` accepts a ``run_id`` but always writes through the global
        tracking URI, so it is not used: the model is saved locally with
        ``mlflow.pytorch.save_model`` (explicit pip requirements, nothing inferred) and sent with
        this tracker's client as a logged model linked to the run (its output at step 0).
        While the store is failing, the saved model folder is spooled as the run artifact ``model/``
        instead (replayed as a plain artifact folder, not as a logged model).
        """
        began = time.perf_counter()
        self._check_started()

        send = self._model_sender(model, name, input_example, tags)

        def spool(writer: SpoolWriter) -> None:
            with tempfile.TemporaryDirectory(prefix="tracking-model-") as tmp:
                local = os.path.join(tmp, name)
                _model.save_model(model, local, input_example=input_example, log=self._log)
                writer.artifact_path(local, None)

        self._failover.deliver(send, spool)
        return time.perf_counter() - began

    def _model_sender(
        self, model: torch.nn.Module, name: str, input_example: Any, tags: Mapping[str, str] | None
    ) -> Callable[[str, mlflow.MlflowClient], None]:
        """Return what logs ``model`` to a run of the store as an MLflow logged model (see :meth:`log_model`)."""

        def send(run_id: str, client: mlflow.MlflowClient) -> None:
            _model.log_to_run(
                client,
                run_id,
                str(self._run.experiment_id),
                name,
                lambda local, description: _model.save_model(
                    model, local, description=description, input_example=input_example, log=self._log
                ),
                tags,
            )

        return send

    def log_model_from(
        self,
        builder: str,
        kwargs: Mapping[str, Any],
        name: str,
        input_example: Any,
        tags: Mapping[str, str] | None = None,
    ) -> float:
        """Store the model ``builder(**kwargs)`` returns as an MLflow logged model; return the seconds waited.

        With a writer process, the process builds, exports and sends the model (``torch.export`` and MLflow's
        pytorch flavour are imported and the model traced there, on another core, ideally preloaded: see
        ``preload``); otherwise, or if that fails, this process sends it as :meth:`log_model` does, except while
        the store fails: then a one-shot process saves it for the spool (see
        :func:`flasync.tracking._model.save_built`).
        """
        began = time.perf_counter()
        self._check_started()
        arguments = _model_arguments(builder, kwargs, name, input_example)
        if not self._writers.child_job(self._model_request(arguments, tags)):
            self._model_here(arguments, input_example, tags)
        return time.perf_counter() - began

    def start_model_from(
        self,
        builder: str,
        kwargs: Mapping[str, Any],
        name: str,
        input_example: Any,
        tags: Mapping[str, str] | None = None,
    ) -> Callable[[], float]:
        """Begin what :meth:`log_model_from` does and return what waits for it.

        The writer process does the model's job on a thread of its own, so what this process sends meanwhile (files,
        tags, metrics) is answered beside the export. Without a writer process the
        model is logged before this returns.
        """
        self._check_started()
        arguments = _model_arguments(builder, kwargs, name, input_example)

        def here() -> None:
            self._model_here(arguments, input_example, tags)

        kept = self._saved_from_cache(arguments) if self._writers.has_child else None
        if kept is None:
            return self._start_deferred("model", self._model_request(arguments, tags), here)
        saved, delta = kept
        request = self._model_request({"name": name, "saved": str(saved), "size_delta": delta}, tags)
        settle = self._start_deferred("model", request, here)

        def settled() -> float:
            try:
                return settle()
            finally:
                shutil.rmtree(saved.parent, ignore_errors=True)

        return settled

    def _saved_from_cache(self, arguments: Mapping[str, Any]) -> tuple[Path, int] | None:
        """Save the model :func:`_model_arguments` describes here, from the export an earlier process kept for it
        (see :mod:`flasync.tracking.exports`): its final weights swapped into a copy of the kept folder, in a new
        temporary folder; return the saved folder and its archive's size less the kept one's, or None when no export
        is kept for it or it does not fit."""
        example = arguments["input_example"]
        if example is None:
            return None
        builder, kwargs = arguments["builder"], arguments["kwargs"]
        entry = self._exports.get(self._exports.key(builder, kwargs, example, arguments["input_dtype"]))
        if entry is None:
            return None
        try:
            model = _model.build(builder, kwargs)
        except Exception:  # the writer process's job reports what fails
            return None
        tensors = {name: tensor.detach().cpu().numpy() for name, tensor in model.state_dict().items()}
        folder = Path(tempfile.mkdtemp(prefix="tracking-model-"), "model")
        if save_from_cache(entry, tensors, folder):
            self._log.debug("tracking.model_from_cache", folder=str(entry.folder), metrics=False)
            archive = entry.archive
            return folder, (folder / archive).stat().st_size - (entry.folder / archive).stat().st_size
        shutil.rmtree(folder.parent, ignore_errors=True)
        return None

    def prepare_model_from(self, builder: str, kwargs: Mapping[str, Any], input_example: Any) -> None:
        """Have the writer process export the model ``builder(**kwargs)`` returns now, in the background.

        The model's weights do not matter (e.g. the initial ones): that later save swaps the final weights into
        this export, which skips ``torch.export``'s trace at the run's end, if the model has the same structure (the
        same module classes, parameters and buffers, and then the same outputs on ``input_example``; see
        :class:`flasync.tracking._model.Exports`). Otherwise, or if this export fails, or without a writer process, that
        save exports the model itself, as it would have.
        """
        self._check_started()
        if input_example is None:
            return  # such a model is pickled: there is no export to make ahead
        arguments = _model_arguments(builder, kwargs, "model", input_example)
        del arguments["name"]
        example, dtype = arguments["input_example"], arguments["input_dtype"]
        if self._exports.get(self._exports.key(builder, kwargs, example, dtype)) is not None:
            return  # an earlier process kept this export: the model is saved here from it (see start_model_from)
        arguments["cache"] = str(self._exports.root)  # the helper keeps its export for later processes
        # Deferred and detached: the writer process answers at once and exports on a thread of its own; the model's
        # job waits for it (in the helper), the end of a run stopped before its model does not.
        job = f"prepare-{next(self._deferred)}"
        self._writers.child_job({"op": "prepare", "model": arguments, "defer": job, "detached": True})

    def _start_deferred(self, kind: str, request: Mapping[str, Any], here: Callable[[], None]) -> Callable[[], float]:
        """Have the writer process begin ``request`` as a deferred job and return what waits for it (see
        :meth:`start_model_from`); ``here`` does the job in this process instead, at once when there is no writer
        process, or when the settled job failed. The function returned gives the seconds since this call."""
        began = time.perf_counter()
        job = f"{kind}-{next(self._deferred)}"
        if not self._writers.child_job({**request, "defer": job}):
            here()
            seconds = time.perf_counter() - began
            return lambda: seconds

        def settle() -> float:
            if not self._writers.child_job({"op": "settle", "id": job}):
                here()
            return time.perf_counter() - began

        return settle

    def _model_request(self, arguments: Mapping[str, Any], tags: Mapping[str, str] | None) -> dict[str, Any]:
        """Return the writer process's job logging the model :func:`_model_arguments` describes, with ``tags``."""
        model = {"experiment_id": str(self._run.experiment_id), **arguments}
        if tags:
            model["tags"] = dict(tags)
        return {"op": "model", "model": model}

    def _model_here(self, arguments: Mapping[str, Any], input_example: Any, tags: Mapping[str, str] | None) -> None:
        """Log the model :func:`_model_arguments` describes from this process (see :meth:`log_model_from`)."""
        name = str(arguments["name"])
        model = _model.build(arguments["builder"], arguments["kwargs"])  # a builder that fails is the caller's error

        send = self._model_sender(model, name, input_example, tags)

        def spool(writer: SpoolWriter) -> None:
            # The store fails: a one-shot process saves the model, so this one never imports torch.export and
            # MLflow's pytorch flavour (their objects would set off full garbage collections here).
            with tempfile.TemporaryDirectory(prefix="tracking-model-") as tmp:
                try:
                    _files.write_elsewhere("flasync.tracking._model:save_built", tmp, arguments)
                except RuntimeError as exc:
                    self._log.info("tracking.model_saved_here", reason=str(exc)[:300], metrics=False)
                    shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
                    _model.save_model(model, os.path.join(tmp, name), input_example=input_example)
                writer.artifact_path(os.path.join(tmp, name), None)

        self._failover.deliver(send, spool)


# libyaml's emitter where PyYAML was built with it: the same text as the pure-Python SafeDumper, a fifth of its CPU
# (a run's config: 0.7 ms instead of 3.4 ms, on a thread beside training).
_YAML_DUMPER: type = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def yaml_text(data: Any, *, indent: int | None = None) -> str:
    """Return ``data`` (plain YAML types) as ``yaml.safe_dump`` writes it, keys in their order."""
    return yaml.dump(data, Dumper=_YAML_DUMPER, indent=indent, sort_keys=False)


def artifact_bytes(data: Mapping[str, Any], artifact_file: str) -> bytes:
    """Return ``data`` as the content :meth:`MlflowTracker.log_dict` stores: YAML for ``.yaml``/``.yml``, indented
    JSON otherwise (values JSON cannot encode written as their ``str``; NaN and infinities as JavaScript's)."""
    if artifact_file.endswith((".yaml", ".yml")):
        text = yaml_text(json.loads(json.dumps(dict(data), default=str)), indent=2)
    else:
        text = json.dumps(data, indent=2, default=str, allow_nan=True)
    return text.encode()


def _local_files(tmp: Path, names: Mapping[str, tuple[str, str]]) -> list[tuple[Path, str]]:
    """Return where each artifact of ``names`` (its path in the run -> its folder and file name) is written before the
    writer process stores it, with that path: a file named as the artifact, in ``tmp`` or, for a name taken there
    already (``a/x.svg`` beside ``b/x.svg``), in the first numbered folder of ``tmp`` without it (made here). Each
    folder costs a ``mkdir`` and an ``rmdir``, which some disks make milliseconds each."""
    taken: list[set[str]] = []
    placed = []
    for artifact_file, (_, name) in names.items():
        slot = next((i for i, used in enumerate(taken) if name not in used), len(taken))
        if slot == len(taken):
            taken.append(set())
            if slot:
                Path(tmp, str(slot)).mkdir()
        taken[slot].add(name)
        placed.append((Path(tmp, str(slot), name) if slot else Path(tmp, name), artifact_file))
    return placed


def _artifact_name(artifact_file: str) -> tuple[str, str]:
    """Return the folder (``""``: the root) and the file name of an artifact's path inside its run.

    Raises:
        ValueError: The path names no file.
    """
    folder, name = os.path.split(artifact_file.strip("/"))
    if not name:
        raise ValueError(f"artifact_file {artifact_file!r} names no file")
    return folder, name


def _model_arguments(builder: str, kwargs: Mapping[str, Any], name: str, input_example: Any) -> dict[str, Any]:
    """Return the JSON arguments of a model's job (see :func:`flasync.tracking._model.log_built_model`)."""
    return {
        "builder": builder,
        "kwargs": dict(kwargs),
        "name": name,
        "input_example": None if input_example is None else input_example.tolist(),
        "input_dtype": "float32" if input_example is None else str(input_example.dtype),
    }
