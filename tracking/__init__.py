"""Structured logging and MLflow tracking for flasync.

Logging goes through structlog: the CLI calls :func:`configure_logging` once, library code builds
loggers with :func:`make_logger`. A :class:`MetricsProcessor` given to such a logger (``metrics=``)
turns the numeric fields of every log call, debug ones included, into MLflow metrics, which a
:class:`MetricWriter` sends in batches from a background thread to the run of a :class:`Tracker`
(:class:`MlflowTracker`, or :class:`NullTracker`).
While the MLflow store cannot be reached, an :class:`MlflowTracker` writes everything to a JSON-lines spool
(:mod:`flasync.tracking.spool`) and replays it when the store answers again, or later with :func:`replay`.
Its MLflow writer process outlives a run, idle, for the next tracked run of the process on the same store;
:func:`close_idle_writer` stops it sooner than the process's exit, :func:`warm_idle_writer` starts one ahead.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flasync.tracking._child import IdleChild, close_idle_writer, warm_idle_writer
    from flasync.tracking.exports import ExportCache, default_export_cache
    from flasync.tracking.logs import LevelFilter, configure_logging, make_logger
    from flasync.tracking.metrics import (
        DEFAULT_EXCLUDE,
        FINISHED_TAG_PREFIX,
        ConstantSeries,
        MetricRow,
        MetricsProcessor,
        metric_key,
    )
    from flasync.tracking.mlflow_run import MlflowTracker, NullTracker, RunStatus, Tracker, artifact_bytes, yaml_text
    from flasync.tracking.model_metrics import EVALUATION_PREFIXES, link_evaluation
    from flasync.tracking.spool import ReplayResult, SpoolError, replay
    from flasync.tracking.store import (
        DEFAULT_ARTIFACT_ROOT,
        DEFAULT_TRACKING_URI,
        ExperimentDeletedError,
        StoreNotWritableError,
        check_local_store,
        redact_uri,
        resolve_tracking_uri,
    )
    from flasync.tracking.writer import MetricWriter, WriterStatistics

# Each name is imported from its module when first used: the MLflow writer process (``python -m tracking._child``)
# imports this package too, and it needs none of them (structlog, YAML and the tracker's modules cost 0.15 s of
# its start-up, on the way to the run's creation).
_MODULES = {
    "IdleChild": "flasync.tracking._child",
    "close_idle_writer": "flasync.tracking._child",
    "warm_idle_writer": "flasync.tracking._child",
    "ExportCache": "flasync.tracking.exports",
    "default_export_cache": "flasync.tracking.exports",
    "LevelFilter": "flasync.tracking.logs",
    "configure_logging": "flasync.tracking.logs",
    "make_logger": "flasync.tracking.logs",
    "DEFAULT_EXCLUDE": "flasync.tracking.metrics",
    "ConstantSeries": "flasync.tracking.metrics",
    "MetricRow": "flasync.tracking.metrics",
    "MetricsProcessor": "flasync.tracking.metrics",
    "metric_key": "flasync.tracking.metrics",
    "FINISHED_TAG_PREFIX": "flasync.tracking.metrics",
    "EVALUATION_PREFIXES": "flasync.tracking.model_metrics",
    "link_evaluation": "flasync.tracking.model_metrics",
    "MlflowTracker": "flasync.tracking.mlflow_run",
    "NullTracker": "flasync.tracking.mlflow_run",
    "RunStatus": "flasync.tracking.mlflow_run",
    "Tracker": "flasync.tracking.mlflow_run",
    "artifact_bytes": "flasync.tracking.mlflow_run",
    "yaml_text": "flasync.tracking.mlflow_run",
    "ReplayResult": "flasync.tracking.spool",
    "SpoolError": "flasync.tracking.spool",
    "replay": "flasync.tracking.spool",
    "DEFAULT_ARTIFACT_ROOT": "flasync.tracking.store",
    "DEFAULT_TRACKING_URI": "flasync.tracking.store",
    "ExperimentDeletedError": "flasync.tracking.store",
    "StoreNotWritableError": "flasync.tracking.store",
    "check_local_store": "flasync.tracking.store",
    "redact_uri": "flasync.tracking.store",
    "resolve_tracking_uri": "flasync.tracking.store",
    "MetricWriter": "flasync.tracking.writer",
    "WriterStatistics": "flasync.tracking.writer",
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
    "EVALUATION_PREFIXES",
    "FINISHED_TAG_PREFIX",
    "ConstantSeries",
    "ExperimentDeletedError",
    "ExportCache",
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
    "default_export_cache",
    "link_evaluation",
    "make_logger",
    "metric_key",
    "redact_uri",
    "replay",
    "resolve_tracking_uri",
    "warm_idle_writer",
    "yaml_text",
]
