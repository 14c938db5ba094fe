"""The exceptions flasync raises."""

from __future__ import annotations

__all__ = [
    "BusClosed",
    "BusFull",
    "ConfigError",
    "DataError",
    "DecodeError",
    "FlasyncError",
    "TrainingError",
]


class FlasyncError(Exception):
    """Base class of every error flasync raises on purpose."""


class ConfigError(FlasyncError, ValueError):
    """A run configuration (file, ``--set`` override or Python object) is invalid."""


class DataError(FlasyncError, ValueError):
    """A data set or a partition of it cannot be used (labels out of range, empty clients, ...)."""


class DecodeError(FlasyncError, ValueError):
    """Bytes received from a client do not decode to a valid update."""


class TrainingError(FlasyncError, RuntimeError):
    """Local training of one client failed; the run accounts for it and goes on."""


class BusClosed(FlasyncError):
    """Publishing on, or receiving from, an event bus that has been closed."""


class BusFull(FlasyncError):
    """``publish_nowait`` found a subscriber with the ``block`` policy whose queue is full."""
