"""What a tracked run hands MLflow's writer process: its model, its plots, and the modules to import ahead for them.

The writer process (see :class:`tracking.MlflowTracker`) runs beside the training process, on another core and with
its own GIL. Exporting the model there (``torch.export`` and MLflow's pytorch flavour: about two seconds to import,
and a first export that costs one more), prepared while the run trains, takes that work off the end of the run.
The plots are drawn elsewhere too (there, or by a one-shot process while the writer process exports the model):
matplotlib imported and drawing in the training process would set off full garbage collections that stop its every
thread, an embedding service's event loop too (see :mod:`tracking._files`).
"""

from __future__ import annotations

from flasync.config import RunConfig

__all__ = ["MODEL_BUILDER", "PLOTS_WRITER", "preload", "reused_preload"]

MODEL_BUILDER = "flasync.models:build"
"""Rebuilds the trained model from its class name, arguments and flat weights; run by the writer process."""

PLOTS_WRITER = "flasync.plots:write_plots"
"""Draws the run's profile (a JSON file) as PNG files; run by the writer process, or by a one-shot one (without a
writer process, or while a new writer process exports the model)."""


def preload(config: RunConfig) -> tuple[str, ...]:
    """Return what the writer process should import and warm up ahead for ``config``'s model and plots (nothing if
    it logs neither): see ``preload`` of :class:`tracking.MlflowTracker`."""
    names: tuple[str, ...] = ()
    if config.diagnostics.profile and config.diagnostics.plots and not config.tracking.log_model:
        # With a model to log, a one-shot process draws the plots while the writer process exports the model.
        names += ("flasync.plots:warm_up_plots",)
    if config.tracking.log_model:
        names += ("flasync.models", "tracking._model:warm_up")
    return names


def reused_preload(config: RunConfig) -> tuple[str, ...]:
    """Return what a writer process kept from an earlier run should import ahead besides :func:`preload`: the plots'
    imports when the model is logged too (such a process exports the model in a fraction of a second, then draws
    the plots itself, sooner than a one-shot process could start): see ``reused_preload`` of
    :class:`tracking.MlflowTracker`."""
    if config.diagnostics.profile and config.diagnostics.plots and config.tracking.log_model:
        return ("flasync.plots:warm_up_plots",)
    return ()
