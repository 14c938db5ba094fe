"""Turn the numeric fields of structlog events into MLflow metrics."""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from structlog.typing import EventDict, WrappedLogger

from tracking._keys import safe_key

__all__ = ["DEFAULT_EXCLUDE", "MetricRow", "MetricsProcessor"]


class MetricRow(NamedTuple):
    """One value of one metric: the four fields of an MLflow ``Metric``, as a plain tuple.

    Metrics travel from the event loop to the store as rows: they cost a tenth of an MLflow ``Metric`` to build,
    and importing flasync does not import MLflow (over a second) when nothing is tracked. The tracker turns rows
    into MLflow's entities where it calls the store.
    """

    key: str
    """The metric key, e.g. ``client.train_s``."""
    value: float
    """The value (NaN and infinities allowed)."""
    timestamp: int
    """Wall-clock milliseconds since the epoch."""
    step: int
    """The model version, or the update index for per-update figures."""


DEFAULT_EXCLUDE: frozenset[str] = frozenset(
    {"step", "client_id", "edge_id", "task_id", "base_version", "seq", "pid", "thread"}
)
"""Numeric fields that identify an event rather than measure something; never metrics."""

_MAX_CACHED_KEYS = 10_000
# Types that are never numbers, checked first so that strings skip the slower ABC check.
_NOT_NUMBERS = (str, bool, type(None), bytes, dict, list, tuple)


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


class MetricsProcessor:
    """Emit one metric row per numeric field of each event; a structlog processor.

    An event ``log.debug("client.trained", step=7, train_s=0.8, samples=64, client_id=3)``
    becomes the metrics ``client.trained.train_s = 0.8`` and ``client.trained.samples = 64.0``,
    both at step 7, handed to ``sink`` in one call. Numbers are ``int`` and ``float`` values and
    other real-number scalars (NumPy's), never ``bool``; NaN and infinities pass through (MLflow
    stores them). Fields in ``exclude`` are skipped, so keys are bounded by the event names and
    fields in the code, never by client ids. An event logged with ``metrics=False`` is skipped
    (the key is removed either way). The event is returned unchanged otherwise.

    Put it in ``make_logger(processors_before=[...])`` so that it also sees debug events.

    Args:
        sink: Receives the metrics of one event; must not block (e.g.
            :meth:`~tracking.mlflow_run.MlflowTracker.log_metrics`).
        exclude: Field names that are never metrics.
        drop_keys: Whole metric keys (``event.field``) that are not sent.
        clock_ms: Wall-clock time in milliseconds since the epoch, stamped on every metric.
    """

    __slots__ = ("_clock_ms", "_drop", "_exclude", "_keys", "_sink")

    def __init__(
        self,
        sink: Callable[[list[MetricRow]], None],
        *,
        exclude: Collection[str] = DEFAULT_EXCLUDE,
        drop_keys: Collection[str] = (),
        clock_ms: Callable[[], int] = _wall_clock_ms,
    ) -> None:
        self._sink = sink
        self._exclude = frozenset(exclude)
        self._drop = frozenset(drop_keys)
        self._clock_ms = clock_ms
        self._keys: dict[tuple[str, str], str] = {}

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        """Send the event's numeric fields to the sink and return the event.

        Args:
            logger: The wrapped logger (unused).
            method_name: The log method's name (unused: debug events are metrics too).
            event_dict: The event; its ``metrics`` key, if any, is removed.

        Returns:
            ``event_dict``, without its ``metrics`` key.
        """
        if event_dict.pop("metrics", True) is False:
            return event_dict
        metrics: list[MetricRow] | None = None
        timestamp = 0
        step = 0
        event = event_dict.get("event")
        exclude = self._exclude
        for field, value in event_dict.items():
            cls = type(value)
            if (
                cls is not float
                and cls is not int
                and (isinstance(value, _NOT_NUMBERS) or not isinstance(value, numbers.Real))
            ):
                continue
            if field in exclude:
                continue
            number = _to_float(value)
            if number is None:
                continue
            key = self._key(event, field)
            if key in self._drop:
                continue
            if metrics is None:
                metrics = []
                timestamp = self._clock_ms()
                step = _to_step(event_dict.get("step", 0))
            metrics.append(MetricRow(key, number, timestamp, step))
        if metrics:
            self._sink(metrics)
        return event_dict

    def _key(self, event: Any, field: str) -> str:
        name = event if isinstance(event, str) else str(event)
        try:
            return self._keys[name, field]
        except KeyError:
            pass
        if len(self._keys) >= _MAX_CACHED_KEYS:
            # Only reached by code that builds event names at run time; stay bounded anyway.
            self._keys.clear()
        key = self._keys[name, field] = safe_key(f"{name}.{field}" if name else field)
        return key


def _to_float(value: Any) -> float | None:
    try:
        return float(value)
    except OverflowError:
        # An int too large for a float: its sign still says something.
        return math.inf if value > 0 else -math.inf
    except (TypeError, ValueError):
        return None


def _to_step(value: Any) -> int:
    try:
        return int(value)
    except (OverflowError, TypeError, ValueError):
        return 0
