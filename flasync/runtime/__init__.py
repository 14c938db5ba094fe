"""A run from its config, the only code that switches on config kinds: what a run is made of (prepare), how large
its training is on this machine (sizing), its components (build), its names and tags (naming); the federation's
lifecycle, checkpoints, what a tracked run hands MLflow, and serving a run to remote clients."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flasync.runtime.federation import Federation, RunSummary, run, weights_sha256

# Imported on first use: `flasync.runtime.tracked` is read by the command line before torch is imported.
_LAZY = {name: "flasync.runtime.federation" for name in ("Federation", "RunSummary", "run", "weights_sha256")}


def __getattr__(name: str) -> Any:
    """Import the federation's public names on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flasync.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["Federation", "RunSummary", "run", "weights_sha256"]
