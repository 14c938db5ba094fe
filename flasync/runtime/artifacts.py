"""The artifacts a finished run logs: its summary, its profile and the profile's plots, its weights and the trained
model, exported while the rest is logged; and the profile a stopped run logs."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from flasync import tracking
from flasync.core.client_table import HISTOGRAMS_ARTIFACT, TABLE_ARTIFACT, ClientTable
from flasync.observe.plots import render_client_histograms, render_plots
from flasync.observe.summary import RunSummary, json_ready
from flasync.runtime import tracked
from flasync.runtime.prepare import Prepared
from flasync.runtime.run_profile import profile_artifact
from flasync.runtime.run_tracking import example, tag_constants
from flasync.runtime.selection import Best, RunModel, run_models
from flasync.training.diagnostics import TrainingDiagnostics
from flasync.training.exchange import Exchanged, merge_lora
from flasync.training.local import flat_layout

__all__ = ["HISTOGRAMS_PLOT", "link_models", "log_artifacts", "log_client_table", "log_stopped_profile"]

HISTOGRAMS_PLOT = "clients/histograms.svg"
"""The chart of the per-client histograms (:func:`~flasync.observe.plots.render_client_histograms`)."""


def log_stopped_profile(tracker: tracking.Tracker, profile: dict[str, Any], log: Any) -> None:
    """Log the profile of a stopped segment of a run (to :func:`~flasync.runtime.run_profile.profile_artifact`'s
    name); a store that refuses it is a warning, never an error hiding the stop."""
    if isinstance(tracker, tracking.NullTracker):
        return
    name = profile_artifact(profile)
    try:
        tracker.log_bytes(tracking.artifact_bytes(json_ready(profile), name), name)
    except Exception as exc:
        log.warning("tracking.profile_failed", artifact=name, error=f"{type(exc).__name__}: {exc}", metrics=False)


def log_artifacts(
    tracker: tracking.Tracker,
    prepared: Prepared,
    summary: RunSummary,
    log: Any,
    constant: tracking.ConstantSeries | None = None,
    *,
    weights: torch.Tensor,
    profile: dict[str, Any] | None,
    traces: TrainingDiagnostics | None,
    best: Best | None = None,
    clients: ClientTable | None = None,
) -> None:
    """Log the run's artifacts (the summary, the profile and its plots, the weights, the model, with ``best`` the
    best version's model and with ``clients`` the per-client table) and, with ``constant``, its constant metrics as
    tags; the models are exported while the rest is logged."""
    if isinstance(tracker, tracking.NullTracker):
        return
    config = prepared.config
    mlflow_tracker = tracker if isinstance(tracker, tracking.MlflowTracker) else None
    input_example = example(prepared)
    models = run_models(summary, weights, best, config.eval.select) if config.tracking.log_model else []
    started: dict[str, Callable[[], float] | None] = {}
    if mlflow_tracker is not None and prepared.model_spec is not None:
        # The writer process logs each model on a thread of its own (its helper exports it, on Linux) while this
        # process logs the other artifacts.
        started = _start_models(mlflow_tracker, prepared.model_spec, input_example, models, log)
    if mlflow_tracker is not None:
        # The metrics still queued are written while this process serialises the artifacts, not after them.
        mlflow_tracker.send_soon()
    files = {"summary.json": tracking.artifact_bytes(summary.to_dict(), "summary.json")}
    if profile is not None:
        name = profile_artifact(profile)
        files[name] = tracking.artifact_bytes(json_ready(profile), name)
        if config.diagnostics.plots:
            files.update(_plots(profile, log))
    module = _module(prepared, weights)
    buffer = io.BytesIO()
    torch.save({"flat": weights, "state_dict": module.state_dict()}, buffer)
    files["weights.pt"] = buffer.getvalue()
    if clients is not None:
        files.update(_client_files(clients, log))
    if mlflow_tracker is not None:
        mlflow_tracker.log_artifacts(files)  # one job of the writer process, not one per file
    else:
        for artifact_file, data in files.items():
            tracker.log_bytes(data, artifact_file)
    if clients is not None:
        log_client_table(tracker, clients, log)
    if traces is not None:
        for path in traces.traces:
            tracker.log_file(path, "torch_profiler")
    tags = {}
    if summary.alerts and profile is not None:
        tags["alerts"] = ", ".join(f"{k}={v}" for k, v in sorted(profile["alerts"].items()))
    tag_constants(tracker, constant, log, tags)  # done here, the end of the run's call to it finds nothing left
    if any(settle is not None for settle in started.values()):
        # The metrics still queued (the profile's rows among them) are written while the models are exported, not
        # after them, when the run's end would wait for them.
        tracker.flush()
    if mlflow_tracker is not None:
        _finish_models(mlflow_tracker, prepared, input_example, models, started, log)
        link_models(mlflow_tracker, models, log)
        if prepared.model_spec is not None and models:
            tracked.remember_export(config, prepared.model_spec, input_example)


def _client_files(clients: ClientTable, log: Any) -> dict[str, bytes]:
    """Return the per-client histograms' artifacts: the JSON and its chart (a chart that fails is only logged)."""
    histograms = clients.histograms()
    files = {HISTOGRAMS_ARTIFACT: tracking.artifact_bytes(histograms, HISTOGRAMS_ARTIFACT)}
    try:
        files[HISTOGRAMS_PLOT] = render_client_histograms(histograms)
    except Exception as exc:
        log.warning("tracking.plots_failed", error=f"{type(exc).__name__}: {exc}"[:300], metrics=False)
    return files


def log_client_table(tracker: tracking.Tracker, clients: ClientTable, log: Any) -> None:
    """Log the per-client table as :data:`TABLE_ARTIFACT`: with ``MlflowClient.log_table`` on an MLflow run (the UI's
    artifact view shows it as a table), else as the same JSON (``columns`` and ``data``). A store that refuses it is
    a warning, never a failure of the finished run."""
    table = clients.table()
    try:
        if isinstance(tracker, tracking.MlflowTracker) and tracker.run_id:
            import mlflow

            columns = {name: [row[i] for row in table["data"]] for i, name in enumerate(table["columns"])}
            client = mlflow.MlflowClient(tracker.tracking_uri)
            client.log_table(tracker.run_id, data=columns, artifact_file=TABLE_ARTIFACT)
        else:
            tracker.log_bytes(tracking.artifact_bytes(table, TABLE_ARTIFACT), TABLE_ARTIFACT)
    except Exception as exc:
        log.warning("tracking.client_table_failed", error=f"{type(exc).__name__}: {exc}"[:300], metrics=False)


def _module(prepared: Prepared, weights: torch.Tensor) -> torch.nn.Module:
    """Return the run's model with the flat ``weights`` loaded."""
    module = prepared.factory()
    layout = flat_layout(module)
    offset = 0
    with torch.no_grad():
        for tensor in [*(p for _, p in layout.parameters), *(b for _, b in layout.buffers)]:
            n = tensor.numel()
            tensor.copy_(weights[offset : offset + n].view_as(tensor))
            offset += n
    if not isinstance(module, Exchanged):
        return module
    # A partial model's state dict is the user's model's (the frozen part at its initial values, the rest trained),
    # with LoRA adapters merged into the layers they adapt.
    return merge_lora(module.model) if prepared.config.model.adapter is not None else module.model


def _start_models(
    tracker: tracking.MlflowTracker,
    spec: tuple[str, dict[str, Any]],
    input_example: np.ndarray,
    models: list[RunModel],
    log: Any,
) -> dict[str, Callable[[], float] | None]:
    """Start logging each of ``models`` from the builder's ``spec``; return what waits for each by its name (None:
    it could not be started, which is logged)."""
    started: dict[str, Callable[[], float] | None] = {}
    for model in models:
        try:
            started[model.name] = _start_model_from_spec(tracker, spec, input_example, model)
        except Exception as exc:  # a model MLflow cannot serialise must not fail the run
            started[model.name] = None
            _model_failed(log, model, exc)
    return started


def _finish_models(
    tracker: tracking.MlflowTracker,
    prepared: Prepared,
    input_example: np.ndarray,
    models: list[RunModel],
    started: dict[str, Callable[[], float] | None],
    log: Any,
) -> None:
    """Wait for the models started from the builder's spec; log the others (a user's model factory) from here."""
    for model in models:
        if model.name in started and started[model.name] is None:
            continue  # its start failed, and said so
        try:
            settle = started.get(model.name)
            if settle is not None:
                seconds = settle()
            else:
                module = _module(prepared, model.weights)
                seconds = tracker.log_model(module, name=model.name, input_example=input_example, tags=model.tags)
            log.debug("tracking.log_model", model=model.name, seconds=seconds, metrics=False)
        except Exception as exc:  # a model MLflow cannot serialise must not fail the run
            _model_failed(log, model, exc)


def link_models(tracker: tracking.MlflowTracker, models: list[RunModel], log: Any) -> None:
    """Link the run's evaluation metrics to its logged models (:func:`flasync.tracking.model_metrics.link_evaluation`):
    to each model the points of the version it holds (``model``: the last version, which the run evaluates before it
    stops; ``best_model``: the best version), which the model's page in the MLflow UI lists, one row a metric. Done
    once the run's metrics are stored (a flush first); a run whose store is offline (its records spooled) links
    nothing, and a store that refuses is a warning, never a failure of the finished run."""
    if not models or tracker.run_id is None or not tracker.flush() or tracker.offline:
        return
    began = time.perf_counter()
    try:
        linked = tracker.link_models({model.name: model.version for model in models})
    except Exception as exc:
        log.warning("tracking.link_metrics_failed", error=f"{type(exc).__name__}: {exc}"[:300], metrics=False)
        return
    log.debug("tracking.link_metrics", points=linked, seconds=time.perf_counter() - began, metrics=False)


def _model_failed(log: Any, model: RunModel, exc: Exception) -> None:
    """Warn that ``model`` could not be logged."""
    log.warning("tracking.log_model_failed", model=model.name, error=f"{type(exc).__name__}: {exc}", metrics=False)


def _plots(profile: dict[str, Any], log: Any) -> dict[str, bytes]:
    """Draw the profile's charts (SVG, about a millisecond each: see :mod:`flasync.tracking.charts`); return them
    by their artifact paths (under ``plots/``). A failure is only logged (no charts), it must not fail the run."""
    began = time.perf_counter()
    try:
        plots = render_plots(profile)
    except Exception as exc:
        log.warning("tracking.plots_failed", error=f"{type(exc).__name__}: {exc}"[:300], metrics=False)
        return {}
    log.debug("tracking.plots", seconds=time.perf_counter() - began, metrics=False)
    return {f"plots/{name}": image for name, image in plots.items()}


def _start_model_from_spec(
    tracker: tracking.MlflowTracker,
    spec: tuple[str, dict[str, Any]],
    input_example: np.ndarray,
    model: RunModel,
) -> Callable[[], float]:
    """Start logging ``model`` as :func:`flasync.training.models.build` rebuilds it from ``spec`` and its weights
    (in the writer process when there is one, see :meth:`tracking.MlflowTracker.start_model_from`); return what
    waits for it and returns the seconds."""
    name, kwargs = spec
    folder = tempfile.mkdtemp(prefix="flasync-model-")
    try:
        path = os.path.join(folder, "weights.npy")
        np.save(path, model.weights.numpy(), allow_pickle=False)
        settle = tracker.start_model_from(
            tracked.MODEL_BUILDER,
            {"model": name, "weights": path, **kwargs},
            name=model.name,
            input_example=input_example,
            tags=model.tags,
        )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise

    def wait() -> float:
        try:
            return settle()
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the weights, once the model no longer needs them

    return wait
