"""What a tracked run hands MLflow's writer process: its model, and the modules to import ahead for it.

The writer process (see :class:`tracking.MlflowTracker`) runs beside the training process, on another core and with
its own GIL. Exporting the model there, in a helper process of its own on Linux (``torch.export`` and
MLflow's pytorch flavour: about two seconds to import, and a first export that costs one more), prepared while the
run trains, takes that work off the end of the run. :func:`mlflow_tracker` builds the tracker a config asks for, the
same for the runtime and the command line; :func:`redacted` is the config its params and artifacts show.
"""

from __future__ import annotations

from flasync import tracking
from flasync.config import RunConfig
from flasync.runtime.runs_view import RUNS_VIEW

__all__ = ["MODEL_BUILDER", "mlflow_tracker", "preload", "redacted"]

MODEL_BUILDER = "flasync.training.models:build"
"""Rebuilds the trained model from its class name, arguments and flat weights; run by the writer process."""


def preload(config: RunConfig) -> tuple[str, ...]:
    """Return what the writer process should import and warm up ahead for ``config``'s model (nothing if it logs
    none): see ``preload`` of :class:`tracking.MlflowTracker`."""
    if config.tracking.log_model:
        return ("flasync.training.models", "flasync.tracking._model:warm_up")
    return ()


def mlflow_tracker(config: RunConfig) -> tracking.MlflowTracker:
    """Return the tracker of ``config``'s ``tracking`` section: its store, system monitor, runs view and what its writer
    process imports ahead for the model."""
    cfg = config.tracking
    return tracking.MlflowTracker(
        cfg.uri,
        system_metrics=cfg.system_metrics,
        system_metrics_interval_s=cfg.system_metrics_interval_s,
        runs_view=RUNS_VIEW,
        preload=preload(config),
    )


def redacted(config: RunConfig) -> RunConfig:
    """Return ``config`` with credentials in its tracking URI replaced (for params and artifacts)."""
    uri = config.tracking.uri
    if uri is None or tracking.redact_uri(uri) == uri:
        return config
    return config.model_copy(update={"tracking": config.tracking.model_copy(update={"uri": tracking.redact_uri(uri)})})
