"""What a tracked run hands MLflow's writer process: its model, and the modules to import ahead for it.

The writer process (see :class:`tracking.MlflowTracker`) runs beside the training process, on another core and with
its own GIL. Exporting the model there (``torch.export`` and MLflow's pytorch flavour: about two seconds to import,
and a first export that costs one more), prepared while the run trains, takes that work off the end of the run.
"""

from __future__ import annotations

from flasync.config import RunConfig

__all__ = ["MODEL_BUILDER", "preload"]

MODEL_BUILDER = "flasync.models:build"
"""Rebuilds the trained model from its class name, arguments and flat weights; run by the writer process."""


def preload(config: RunConfig) -> tuple[str, ...]:
    """Return what the writer process should import and warm up ahead for ``config``'s model (nothing if it logs
    none): see ``preload`` of :class:`tracking.MlflowTracker`."""
    if not config.tracking.log_model:
        return ()
    return ("flasync.models", "tracking._model:warm_up")
