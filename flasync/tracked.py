"""What a tracked run hands MLflow's writer process: its model, its plots, and the modules to import ahead for them.

The writer process (see :class:`tracking.MlflowTracker`) runs beside the training process, on another core and with
its own GIL. Exporting the model there, in a helper process of its own on Linux (``torch.export`` and
MLflow's pytorch flavour: about two seconds to import, and a first export that costs one more), prepared while the
run trains, takes that work off the end of the run. The plots are drawn elsewhere too (in the writer's other helper,
or by a one-shot process while a writer process without helpers exports the model):
matplotlib imported and drawing in the training process would set off full garbage collections that stop its every
thread, an embedding service's event loop too (see :mod:`tracking._files`). :func:`mlflow_tracker` builds the
tracker a config asks for, the same for the runtime and the command line.
"""

from __future__ import annotations

import tracking
from flasync.config import RunConfig
from flasync.runs_view import RUNS_VIEW

__all__ = ["MODEL_BUILDER", "PLOTS_WRITER", "files_preload", "mlflow_tracker", "preload"]

MODEL_BUILDER = "flasync.models:build"
"""Rebuilds the trained model from its class name, arguments and flat weights; run by the writer process."""

PLOTS_WRITER = "flasync.plots:write_plots"
"""Draws the run's profile (a JSON file) as PNG files; run by the writer process (its helper, if it has one), or by
a one-shot one (without a writer process, or while a new writer process without a helper exports the model)."""


def preload(config: RunConfig) -> tuple[str, ...]:
    """Return what the writer process should import and warm up ahead for ``config``'s model (nothing if it logs
    none): see ``preload`` of :class:`tracking.MlflowTracker`."""
    if config.tracking.log_model:
        return ("flasync.models", "tracking._model:warm_up")
    return ()


def mlflow_tracker(config: RunConfig) -> tracking.MlflowTracker:
    """Return the tracker of ``config``'s ``tracking`` section: its store, system monitor, runs view and what its writer
    process imports ahead for the model and the plots."""
    cfg = config.tracking
    return tracking.MlflowTracker(
        cfg.uri,
        system_metrics=cfg.system_metrics,
        system_metrics_interval_s=cfg.system_metrics_interval_s,
        runs_view=RUNS_VIEW,
        preload=preload(config),
        files_preload=files_preload(config),
    )


def files_preload(config: RunConfig) -> tuple[str, ...]:
    """Return what the writer process should import ahead for ``config``'s plots (nothing if it draws none): see
    ``files_preload`` of :class:`tracking.MlflowTracker`."""
    if config.diagnostics.profile and config.diagnostics.plots:
        return ("flasync.plots:warm_up_plots",)
    return ()
