"""What a tracked run hands MLflow's writer process: its model, and the modules to import ahead for it.

The writer process (see :class:`tracking.MlflowTracker`) runs beside the training process, on another core and with
its own GIL. Exporting the model there, in a helper process of its own on Linux (``torch.export`` and
MLflow's pytorch flavour: about two seconds to import, and a first export that costs one more), prepared while the
run trains, takes that work off the end of the run. :func:`mlflow_tracker` builds the tracker a config asks for, the
same for the runtime and the command line; :func:`redacted` is the config its params and artifacts show.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flasync import tracking
from flasync.config import RunConfig
from flasync.runtime.runs_view import RUNS_VIEW

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MODEL_BUILDER", "mlflow_tracker", "preload", "redacted", "remember_export"]

MODEL_BUILDER = "flasync.training.models:build"
"""Rebuilds the trained model from its class name, arguments and flat weights; run by the writer process."""


def preload(config: RunConfig) -> tuple[str, ...]:
    """Return what the writer process should import and warm up ahead for ``config``'s model (nothing if it logs
    none): see ``preload`` of :class:`tracking.MlflowTracker`.

    When an earlier run of the same model and data kept its export (:func:`remember_export`), the model is likely
    saved from that export, in milliseconds: then only the model module is named (its helper process is forked, in
    case the export turns out not to fit, but imports neither torch nor its exporter, some three seconds of CPU taken
    from training on a small machine).
    """
    if not config.tracking.log_model:
        return ()
    if tracking.ExportCache(tracking.default_export_cache()).marked(_export_hint(config)):
        return ("flasync.tracking._model",)
    return ("flasync.training.models", "flasync.tracking._model:warm_up")


def remember_export(config: RunConfig, spec: tuple[str, dict[str, Any]], input_example: np.ndarray) -> None:
    """Note, for the next run of ``config``'s model and data, whether the export of the model ``spec`` builds (traced on
    ``input_example``) is kept in the export cache (see :func:`preload`)."""
    name, kwargs = spec
    cache = tracking.ExportCache(tracking.default_export_cache())
    key = cache.key(MODEL_BUILDER, {"model": name, **kwargs}, input_example.tolist(), str(input_example.dtype))
    if cache.get(key) is not None:
        cache.mark(_export_hint(config), key)


def _export_hint(config: RunConfig) -> str:
    """Return what names a run's model and its input example before its data is loaded: its model and data sections
    and its seed (the test split the example is taken from)."""
    sections = {"model": config.model, "data": config.data}
    return json.dumps({**{k: v.model_dump(mode="json") for k, v in sections.items()}, "seed": config.seed})


def mlflow_tracker(config: RunConfig, nest_under: Callable[[], str] | None = None) -> tracking.MlflowTracker:
    """Return the tracker of ``config``'s ``tracking`` section: its store, system monitor, runs view and what its writer
    process imports ahead for the model; its run nested under the one ``nest_under`` returns, if given (asked as the
    run opens, see :class:`tracking.MlflowTracker`)."""
    cfg = config.tracking
    return tracking.MlflowTracker(
        cfg.uri,
        system_metrics=cfg.system_metrics,
        system_metrics_interval_s=cfg.system_metrics_interval_s,
        runs_view=RUNS_VIEW,
        preload=preload(config),
        nest_under=nest_under,
    )


def redacted(config: RunConfig) -> RunConfig:
    """Return ``config`` with credentials in its tracking URI replaced (for params and artifacts)."""
    uri = config.tracking.uri
    if uri is None or tracking.redact_uri(uri) == uri:
        return config
    return config.model_copy(update={"tracking": config.tracking.model_copy(update={"uri": tracking.redact_uri(uri)})})
