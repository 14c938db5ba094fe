"""The exceptions flasync raises."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BusClosed",
    "BusFull",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "DecodeError",
    "FlasyncError",
    "InjectedFault",
    "RunInterrupted",
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


class InjectedFault(FlasyncError, RuntimeError):
    """A failure the run's fault model injected on purpose (``faults.crash``)."""


class CheckpointError(FlasyncError, ValueError):
    """A checkpoint cannot be found, read or applied to this run."""


class RunInterrupted(FlasyncError):
    """The run was stopped by a signal (or :meth:`flasync.Federation.request_stop`) before its stop condition.

    Attributes:
        reason: What stopped it, e.g. ``"SIGINT"``.
        run_id: The MLflow run (ended as ``KILLED``), if tracking was on.
        checkpoint: The artifact path of the checkpoint written, if any.
        summary: The run's partial summary (:meth:`flasync.RunSummary.to_dict`) up to the stop, if the run had
            started (``Federation.summary`` holds it as a ``RunSummary``).
    """

    def __init__(
        self,
        reason: str,
        *,
        run_id: str | None = None,
        checkpoint: str | None = None,
        summary: dict[str, Any] | None = None,
    ) -> None:
        """Describe the interruption."""
        where = f"; checkpoint {checkpoint} in MLflow run {run_id}" if checkpoint and run_id else ""
        super().__init__(f"interrupted ({reason}){where}")
        self.reason = reason
        self.run_id = run_id
        self.checkpoint = checkpoint
        self.summary = summary
