"""flasync: asynchronous federated learning on asyncio.

Run ``python -m flasync run`` for the default experiment, or embed a run in your own event loop::

    summary = await flasync.Federation(flasync.RunConfig()).run()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flasync._version import __version__
from flasync.core.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DecodeError,
    FlasyncError,
    RunInterrupted,
    TrainingError,
)

if TYPE_CHECKING:
    from flasync.aggregation import Aggregator
    from flasync.config import RunConfig, load_config
    from flasync.runtime.build import AggregatorFactory
    from flasync.runtime.federation import Federation, RunSummary, run
    from flasync.training.local import LocalObjective
    from flasync.training.plugins import ClientPlugin, Extra, Finished, Refusal, ServerPlugin, TaskPart

# Imported on first use: the runtime brings in torch (about a second), which `python -m flasync` should not pay
# before it can say anything, nor `flasync --help`.
_LAZY = {
    "Aggregator": "flasync.aggregation",
    "AggregatorFactory": "flasync.runtime.build",
    "LocalObjective": "flasync.training.local",
    **{
        name: "flasync.training.plugins"
        for name in ("ClientPlugin", "Extra", "Finished", "Refusal", "ServerPlugin", "TaskPart")
    },
    "Federation": "flasync.runtime.federation",
    "RunSummary": "flasync.runtime.federation",
    "run": "flasync.runtime.federation",
    "RunConfig": "flasync.config",
    "load_config": "flasync.config",
}


def console(level: str = "info", *, fmt: str = "console") -> None:
    """Print a run's log lines as ``python -m flasync run`` does: its phases, its progress lines (version, accuracy,
    loss and time left at each evaluation), its warnings, on standard error.

    For a program that embeds flasync; the command line calls it itself. It configures structlog for the whole
    process (flasync's lines are structlog events: a service with a structlog setup of its own keeps that instead).

    Args:
        level: The lowest level printed: ``debug``, ``info``, ``warning`` or ``error``.
        fmt: ``console`` (aligned lines for people) or ``json`` (one object per line, for log collectors).

    Raises:
        ValueError: ``level`` or ``fmt`` is unknown.
    """
    from flasync.tracking.logs import configure_logging

    if fmt not in ("console", "json"):
        raise ValueError(f"fmt must be 'console' or 'json', not {fmt!r}")
    configure_logging(fmt="json" if fmt == "json" else "console", level=level)


def __getattr__(name: str) -> Any:
    """Import the public names that need torch or pydantic on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flasync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "Aggregator",
    "AggregatorFactory",
    "CheckpointError",
    "ClientPlugin",
    "ConfigError",
    "DataError",
    "DecodeError",
    "Extra",
    "Federation",
    "Finished",
    "FlasyncError",
    "LocalObjective",
    "Refusal",
    "RunConfig",
    "RunInterrupted",
    "RunSummary",
    "ServerPlugin",
    "TaskPart",
    "TrainingError",
    "__version__",
    "console",
    "load_config",
    "run",
]
