"""flasync: asynchronous federated learning on asyncio.

Run ``python -m flasync run`` for the default experiment, or embed a run in your own event loop::

    summary = await flasync.Federation(flasync.RunConfig()).run()
"""

from __future__ import annotations

from flasync._version import __version__
from flasync.config import RunConfig, load_config
from flasync.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DecodeError,
    FlasyncError,
    RunInterrupted,
    TrainingError,
)
from flasync.runtime import Federation, RunSummary, run

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DecodeError",
    "Federation",
    "FlasyncError",
    "RunConfig",
    "RunInterrupted",
    "RunSummary",
    "TrainingError",
    "__version__",
    "load_config",
    "run",
]
