"""Structured logging and MLflow tracking for flasync.

Logging goes through structlog: the CLI calls :func:`configure_logging` once, library code builds
loggers with :func:`make_logger`. A :class:`MetricsProcessor` given to such a logger (``metrics=``)
turns the numeric fields of every log call, debug ones included, into MLflow metrics, which a
:class:`MetricWriter` sends in batches from a background thread to the run of a :class:`Tracker`
(:class:`MlflowTracker`, or :class:`NullTracker`).
While the MLflow store cannot be reached, an :class:`MlflowTracker` writes everything to a JSON-lines spool
(:mod:`tracking.spool`) and replays it when the store answers again, or later with :func:`replay`.
Its MLflow writer process outlives a run, idle, for the next tracked run of the process on the same store;
:func:`close_idle_writer` stops it sooner than the process's exit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracking._child import IdleChild, close_idle_writer
    from tracking.logs import LevelFilter, configure_logging, make_logger
    from tracking.metrics import DEFAULT_EXCLUDE, ConstantSeries, MetricRow, MetricsProcessor, metric_key
    from tracking.mlflow_run import MlflowTracker, NullTracker, RunStatus, Tracker, artifact_bytes, yaml_text
    from tracking.spool import ReplayResult, SpoolError, replay
    from tracking.store import (
        DEFAULT_ARTIFACT_ROOT,
        DEFAULT_TRACKING_URI,
        ExperimentDeletedError,
        StoreNotWritableError,
        check_local_store,
        redact_uri,
        resolve_tracking_uri,
    )
    from tracking.writer import MetricWriter, WriterStatistics

# Each name is imported from its module when first used: the MLflow writer process (``python -m tracking._child``)
# imports this package too, and it needs none of them (structlog, YAML and the tracker's modules cost 0.15 s of
# its start-up, on the way to the run's creation).
_MODULES = {
    "IdleChild": "tracking._child",
    "close_idle_writer": "tracking._child",
    "LevelFilter": "tracking.logs",
    "configure_logging": "tracking.logs",
    "make_logger": "tracking.logs",
    "DEFAULT_EXCLUDE": "tracking.metrics",
    "ConstantSeries": "tracking.metrics",
    "MetricRow": "tracking.metrics",
    "MetricsProcessor": "tracking.metrics",
    "metric_key": "tracking.metrics",
    "MlflowTracker": "tracking.mlflow_run",
    "NullTracker": "tracking.mlflow_run",
    "RunStatus": "tracking.mlflow_run",
    "Tracker": "tracking.mlflow_run",
    "artifact_bytes": "tracking.mlflow_run",
    "yaml_text": "tracking.mlflow_run",
    "ReplayResult": "tracking.spool",
    "SpoolError": "tracking.spool",
    "replay": "tracking.spool",
    "DEFAULT_ARTIFACT_ROOT": "tracking.store",
    "DEFAULT_TRACKING_URI": "tracking.store",
    "ExperimentDeletedError": "tracking.store",
    "StoreNotWritableError": "tracking.store",
    "check_local_store": "tracking.store",
    "redact_uri": "tracking.store",
    "resolve_tracking_uri": "tracking.store",
    "MetricWriter": "tracking.writer",
    "WriterStatistics": "tracking.writer",
}


def __getattr__(name: str) -> Any:
    """Import ``name`` from its module on first use (see :data:`_MODULES`)."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'tracking' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULES})


__all__ = [
    "DEFAULT_ARTIFACT_ROOT",
    "DEFAULT_EXCLUDE",
    "DEFAULT_TRACKING_URI",
    "ConstantSeries",
    "ExperimentDeletedError",
    "IdleChild",
    "LevelFilter",
    "MetricRow",
    "MetricWriter",
    "MetricsProcessor",
    "MlflowTracker",
    "NullTracker",
    "ReplayResult",
    "RunStatus",
    "SpoolError",
    "StoreNotWritableError",
    "Tracker",
    "WriterStatistics",
    "artifact_bytes",
    "check_local_store",
    "close_idle_writer",
    "configure_logging",
    "make_logger",
    "metric_key",
    "redact_uri",
    "replay",
    "resolve_tracking_uri",
    "yaml_text",
]
