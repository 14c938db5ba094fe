"""Turn the numeric fields of structlog events into MLflow metrics."""

from __future__ import annotations

import math
import numbers
import threading
import time
from array import array
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, NamedTuple

from structlog.typing import EventDict, WrappedLogger

from flasync.tracking._keys import safe_key

__all__ = ["DEFAULT_EXCLUDE", "FINISHED_TAG_PREFIX", "ConstantSeries", "MetricRow", "MetricsProcessor", "metric_key"]


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


FINISHED_TAG_PREFIX = "finished."
"""The prefix of the tags that hold a run's final figures (``finished.accuracy``, ``finished.versions``...): one
value each, which the MLflow UI would otherwise draw as a one-point chart each."""

DEFAULT_EXCLUDE: frozenset[str] = frozenset(
    {"step", "client_id", "edge_id", "task_id", "base_version", "seq", "pid", "thread"}
)
"""Numeric fields that identify an event rather than measure something; never metrics."""

_MAX_CACHED_EVENTS = 1_000
_MAX_CACHED_FIELDS = 1_000
# Types that are never numbers, checked first so that strings skip the slower ABC check.
_NOT_NUMBERS = (str, bool, type(None), bytes, dict, list, tuple)
_new_tuple = tuple.__new__  # builds a MetricRow in C, at half the cost of calling the NamedTuple class


def _wall_clock_ms() -> int:
    return int(time.time() * 1000)


class MetricsProcessor:
    """Emit one metric row per numeric field of each event; a structlog processor.

    An event ``log.debug("client.trained", step=7, train_s=0.8, samples=64, client_id=3)``
    becomes the metrics ``client/trained/train_s = 0.8`` and ``client/trained/samples = 64.0``,
    both at step 7, handed to ``sink`` in one call: the dots of an event name become ``/``, which MLflow's UI
    groups charts by (one section per first part: ``server``, ``client``, ``profile``, ...). Numbers are ``int``
    and ``float`` values and other real-number scalars (NumPy's), never ``bool``; NaN and infinities pass through
    (MLflow stores them). Fields in ``exclude`` are skipped, so keys are bounded by the event names and
    fields in the code, never by client ids. An event logged with ``metrics=False`` is skipped
    (the key is removed either way). The event is returned unchanged otherwise.

    Put it in ``make_logger(processors_before=[...])`` so that it also sees debug events, or give it
    to ``make_logger(metrics=...)``, which calls :meth:`emit` at the log call and skips the chain
    for events below the level (the cheaper way: a dropped event then costs this method alone).

    Args:
        sink: Receives the metrics of one event; must not block (e.g.
            :meth:`~tracking.mlflow_run.MlflowTracker.log_metrics`).
        exclude: Field names that are never metrics.
        drop_keys: Whole metric keys (``event/field``, as sent) that are not sent.
        clock_ms: Wall-clock time in milliseconds since the epoch, stamped on every metric.
    """

    __slots__ = ("_clock_ms", "_drop", "_exclude", "_plans", "_sink")

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
        # Per event name, each field's metric key, or None for a field that is never sent (excluded or dropped):
        # after an event's first call, each of its fields costs one dict lookup and a type check.
        self._plans: dict[str, dict[str, str | None]] = {}

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        """Send the event's numeric fields to the sink and return the event.

        Args:
            logger: The wrapped logger (unused).
            method_name: The log method's name (unused: debug events are metrics too).
            event_dict: The event; its ``metrics`` key, if any, is removed.

        Returns:
            ``event_dict``, without its ``metrics`` key.
        """
        if event_dict.pop("metrics", True) is not False:
            self.emit(event_dict.get("event"), event_dict)
        return event_dict

    def emit(self, event: Any, fields: Mapping[str, Any]) -> None:
        """Send the numeric fields of one event to the sink (nothing when it has none).

        Args:
            event: The event's name, the first part of each key.
            fields: The event's fields; ``step`` is the metrics' step (0 when missing).
        """
        self.emit_many(event, (fields,))

    def emit_many(self, event: Any, many: Iterable[Mapping[str, Any]]) -> None:
        """Send the numeric fields of several events of one name to the sink in one call, stamped with one time.

        The rows are those :meth:`emit` sends for each event in turn, in that order: a batch of updates costs one
        sink call, one clock reading and one look-up of the event's plan rather than one of each per update.

        Args:
            event: The events' name, the first part of each key.
            many: Each event's fields; ``step`` is its metrics' step (0 when missing).
        """
        name = event if type(event) is str else str(event)
        plan = self._plans.get(name)
        if plan is None or len(plan) >= _MAX_CACHED_FIELDS:
            # Only code that builds event names or fields at run time gets here often; stay bounded anyway.
            if len(self._plans) >= _MAX_CACHED_EVENTS:
                self._plans.clear()
            plan = self._plans[name] = {}
        rows: list[MetricRow] = []
        append = rows.append
        timestamp: int | None = None
        for fields in many:
            step: int | None = None
            for field, value in fields.items():
                try:
                    key = plan[field]
                except KeyError:
                    key = plan[field] = self._key(name, field)
                if key is None:
                    continue
                cls = type(value)
                number: float | None
                if cls is float:
                    number = value
                elif cls is int or (not isinstance(value, _NOT_NUMBERS) and isinstance(value, numbers.Real)):
                    number = _to_float(value)
                    if number is None:
                        continue
                else:
                    continue
                if step is None:
                    if timestamp is None:
                        timestamp = self._clock_ms()
                    step = _to_step(fields.get("step", 0))
                append(_new_tuple(MetricRow, (key, number, timestamp, step)))
        if rows:
            self._sink(rows)

    def _key(self, name: str, field: str) -> str | None:
        if field in self._exclude:
            return None
        key = safe_key(metric_key(name, field))
        return None if key in self._drop else key


class _Held:
    """The rows of one metric key held back while its value has not changed: the value, steps and times."""

    __slots__ = ("key", "steps", "timestamps", "value")

    def __init__(self, row: MetricRow) -> None:
        self.key, self.value = row[0], row[1]
        self.steps = array("q", (row[3],))
        self.timestamps = array("q", (row[2],))

    def rows(self) -> list[MetricRow]:
        key, value = self.key, self.value
        return [_new_tuple(MetricRow, (key, value, t, s)) for t, s in zip(self.timestamps, self.steps, strict=True)]


class ConstantSeries:
    """Hold back the rows of chosen metric keys while their value has not changed; a metric sink in front of another.

    A per-update figure that stays the same all run long (the upload bytes of a dense codec, the samples of equal
    partitions, the staleness of synchronous rounds) draws a flat line of thousands of points, and every row costs
    the store's writer CPU (some 0.1 ms in MLflow's SQLite store). Rows of ``keys`` are held while each value equals
    the key's first; the first different value sends the held rows (at their own steps and times) and the key's rows
    pass from then on, so a series that varies is stored whole. :meth:`constants` returns the keys whose value never
    changed, with that value, for the caller to record once (e.g. as a tag); their rows are not sent. A key that holds
    ``max_held`` rows is sent as a series too (memory stays bounded: 16 bytes a held row). NaN counts as a change.
    Safe to call from several threads.

    Args:
        sink: Where rows go, e.g. :meth:`~tracking.mlflow_run.MlflowTracker.log_metrics`.
        keys: The metric keys to hold while constant (other rows pass at once).
        max_held: Most rows held per key.
    """

    __slots__ = ("_held", "_keys", "_lock", "_max_held", "_sink", "_varied")

    def __init__(
        self, sink: Callable[[list[MetricRow]], None], keys: Collection[str], *, max_held: int = 100_000
    ) -> None:
        self._sink = sink
        self._keys = frozenset(keys)
        self._max_held = max_held
        self._held: dict[str, _Held] = {}
        self._varied: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, metrics: list[MetricRow]) -> None:
        """Send ``metrics``, holding back those of constant keys (see the class docstring)."""
        keys = self._keys
        for row in metrics:  # a plain loop: a fifth of any()'s cost over a generator, on every event
            if row[0] in keys:
                break
        else:
            self._sink(metrics)
            return
        passed: list[MetricRow] = []
        with self._lock:
            held_by_key, varied = self._held, self._varied
            for row in metrics:
                key = row[0]
                if key not in keys or key in varied:
                    passed.append(row)
                    continue
                held = held_by_key.get(key)
                if held is None:
                    held_by_key[key] = _Held(row)
                elif row[1] == held.value and len(held.steps) < self._max_held:
                    held.steps.append(row[3])
                    held.timestamps.append(row[2])
                else:
                    varied.add(key)
                    del held_by_key[key]
                    passed.extend(held.rows())
                    passed.append(row)
        if passed:
            self._sink(passed)

    def constants(self) -> dict[str, float]:
        """Return each held key whose value never changed, with its value; their rows are dropped, and later rows of
        these keys pass."""
        with self._lock:
            found = {key: held.value for key, held in self._held.items()}
            self._held.clear()
            self._varied.update(found)
        return found


def metric_key(event: str, field: str) -> str:
    """Return the MLflow key of a numeric field of a logged event: ``("server.eval", "accuracy")`` ->
    ``server/eval/accuracy`` (every dot becomes a ``/``, the separator MLflow's UI groups by)."""
    return (f"{event}.{field}" if event else field).replace(".", "/")


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
