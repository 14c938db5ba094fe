"""Creating a run, setting its tags, MLflow's system monitor: what both a tracker and its writer process do.

MLflow itself is imported by the functions, when they run.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from flasync.tracking._keys import safe_key
from flasync.tracking.metrics import MetricRow
from flasync.tracking.store import ensure_experiment

if TYPE_CHECKING:
    import mlflow

    from flasync.tracking.sqlite_metrics import SqliteMetrics

__all__ = [
    "RUNS_VIEW_KEY",
    "RUNS_VIEW_TAG",
    "SYSTEM_METRICS_INTERVAL_S",
    "SYSTEM_METRICS_MIN_INTERVAL_S",
    "MonitorSink",
    "SystemSampler",
    "open_run",
    "send_tags",
    "start_monitor",
    "stop_monitor",
]

_MAX_PARAMS_PER_CALL = 100  # mlflow.utils.validation.MAX_PARAMS_TAGS_PER_BATCH
_MAX_TAG_VALUE = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
RUNS_VIEW_KEY = "flasync"
"""Name of the runs-table view a tracker saves on its experiment (see ``runs_view``)."""
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"

SYSTEM_METRICS_INTERVAL_S = 2.0
"""Seconds between two samples of MLflow's system monitor, by default."""
SYSTEM_METRICS_MIN_INTERVAL_S = 0.1
"""The shortest interval a tracker samples at: each sample is a row of every ``system/`` metric."""
_MONITOR_STOP_TIMEOUT_S = 5.0

_T = TypeVar("_T")


def open_run(
    client: mlflow.MlflowClient,
    *,
    experiment: str,
    artifact_location: str | None,
    runs_view: str | None,
    run_name: str | None,
    tags: Mapping[str, str],
    params: Mapping[str, str],
    start_time: int,
    source: str | None = None,
    direct: SqliteMetrics | None = None,
) -> tuple[str, str]:
    """Create a run as :meth:`MlflowTracker.start` does, in one go (the writer process calls this); return its
    ``(run_id, experiment_id)``.

    The experiment is created when missing (``artifact_location`` for a new one) and given the runs view (the
    ``mlflow.sharedViewState`` tag's JSON, if any); the run gets MLflow's context tags for the program ``source``
    (its path, as ``sys.argv[0]`` of the process that runs it), then ``tags``, and ``params`` in calls of 100, or in
    one transaction of ``direct`` (a SQLite store's writer) where it takes them.

    Raises:
        ExperimentDeletedError: The experiment is deleted.
        mlflow.exceptions.MlflowException: The store refused a call (a run already created is marked ``FAILED``).
    """
    from mlflow.entities import Param

    experiment_id = ensure_experiment(client, experiment, artifact_location)
    if runs_view is not None:
        client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, runs_view)
    context = {safe_key(k): str(v)[:_MAX_TAG_VALUE] for k, v in _context_tags(source).items()}
    created = client.create_run(experiment_id, run_name=run_name, tags={**context, **tags}, start_time=start_time)
    run_id: str = created.info.run_id
    try:
        if direct is None or not direct.write_params(run_id, params):
            for chunk in _chunks([Param(k, v) for k, v in params.items()], _MAX_PARAMS_PER_CALL):
                client.log_batch(run_id, params=chunk, synchronous=True)
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(run_id, "FAILED")
        raise
    return run_id, experiment_id


def send_tags(
    client: mlflow.MlflowClient, run_id: str, tags: Mapping[str, str], direct: SqliteMetrics | None = None
) -> None:
    """Set ``tags`` on the run, in ``log_batch`` calls of at most 100, or in one transaction of ``direct`` (a SQLite
    store's writer) where it takes them."""
    from mlflow.entities import RunTag

    if direct is not None and direct.write_tags(run_id, tags):
        return

    entries = [RunTag(k, v) for k, v in tags.items()]
    for chunk in _chunks(entries, _MAX_PARAMS_PER_CALL):
        client.log_batch(run_id, tags=chunk, synchronous=True)


def _context_tags(source: str | None = None) -> dict[str, str]:
    """MLflow's standard tags for a run started here: user, source name and type, and the git commit of the source
    when it lives in a git checkout (what ``mlflow.start_run`` would set; empty if MLflow cannot say).

    Args:
        source: The program the run belongs to, when it is not this process's (``sys.argv[0]``, which MLflow's
            context providers read, is set to it meanwhile: the writer process describes its parent).
    """
    saved = list(sys.argv)
    try:
        if source is not None:
            sys.argv[:1] = [source]
        from mlflow.tracking.context.registry import resolve_tags

        return {str(k): str(v) for k, v in resolve_tags({}).items()}
    except Exception:  # a context provider failing must not stop a run from being tracked
        return {}
    finally:
        sys.argv[:] = saved


def _chunks(items: Sequence[_T], size: int) -> Iterator[list[_T]]:
    for begin in range(0, len(items), size):
        yield list(items[begin : begin + size])


_HELD_SYSTEM_ROWS = 10_000
"""System metric rows a sink that fails holds for its next write (older ones are dropped, and counted, past it)."""


class MonitorSink:
    """Takes the place of the ``BatchMetricsLogger`` of MLflow's ``SystemMetricsMonitor``.

    The monitor calls ``record_metrics({key: value}, step)`` and ``flush()``, and reads three counters in debug
    messages; the samples are handed to a sink (the tracker's metric writer, which spools while the store fails, or
    a writer process's ``log_batch``) instead of being sent with a blocking ``log_batch`` of the monitor's own. Rows a
    sink refuses (it raised) are held and handed again, before the next sample's, up to :data:`_HELD_SYSTEM_ROWS`;
    :attr:`lost` counts those dropped past that bound and those still held when the monitor stops.
    """

    def __init__(self, sink: Callable[[list[MetricRow]], None]) -> None:
        self._sink = sink
        self.data: list[MetricRow] = []
        """Rows the sink refused, oldest first, handed again with the next sample."""
        self.lost = 0
        self.total_training_time = 0.0
        self.total_log_batch_time = 0.0

    def record_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Hand one sample of every system metric to the sink (after any it refused before)."""
        now = int(time.time() * 1000)
        self.data.extend(MetricRow(safe_key(k), float(v), now, int(step or 0)) for k, v in metrics.items())
        self.flush()
        if len(self.data) > _HELD_SYSTEM_ROWS:
            self.lost += len(self.data) - _HELD_SYSTEM_ROWS
            del self.data[: len(self.data) - _HELD_SYSTEM_ROWS]

    def flush(self) -> None:
        """Hand the rows held to the sink; keep them if it refuses them (it raised)."""
        if not self.data:
            return
        try:
            self._sink(self.data)
        except Exception:  # a failing store: the rows wait for the next sample
            return
        self.data = []


class SystemSampler:
    """Sample MLflow's system monitors on a thread: every ``interval_s``, publish each ``samples_before_logging``
    samples' aggregate to the monitor's sink, and the last ones when stopped.

    It replaces ``SystemMetricsMonitor.monitor``, MLflow's loop, which asks the store for the run's status after
    every sample and ends for good when that call fails: a store down for a moment would stop the run's system
    metrics until its end. This loop never reads the store; what it samples goes to the sink (:class:`MonitorSink`).

    Args:
        monitor: MLflow's ``SystemMetricsMonitor``, its ``mlflow_logger`` a :class:`MonitorSink`.
        interval_s: Seconds between two samples.
    """

    def __init__(self, monitor: Any, interval_s: float) -> None:
        self._monitor = monitor
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def sink(self) -> MonitorSink:
        """Where the samples go."""
        sink: MonitorSink = self._monitor.mlflow_logger
        return sink

    def start(self) -> None:
        """Start sampling on a daemon thread."""
        self._thread = threading.Thread(target=self._loop, name="tracking-system-metrics", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Stop sampling, publish the samples taken since the last publication, hand the held rows once more; count
        those still held as lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        sink = self.sink
        sink.flush()
        sink.lost += len(sink.data)
        sink.data = []

    def _loop(self) -> None:
        monitor = self._monitor
        while not self._stop.is_set():
            taken = 0
            for _ in range(max(int(monitor.samples_before_logging), 1)):
                monitor.collect_metrics()
                taken += 1
                if self._stop.wait(self._interval_s):
                    break
            if taken:
                monitor.publish_metrics(monitor.aggregate_metrics())


def start_monitor(
    run_id: str,
    tracking_uri: str,
    sink: Callable[[list[MetricRow]], None],
    interval_s: float = SYSTEM_METRICS_INTERVAL_S,
) -> SystemSampler:
    """Start MLflow's system monitors for the run, sampling every ``interval_s`` seconds on :class:`SystemSampler`'s
    loop, their samples handed to ``sink`` through a :class:`MonitorSink`; return the sampler (stop it with
    :func:`stop_monitor`)."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # MLflow leaves this class unannotated.
    monitor: Any = SystemMetricsMonitor(  # type: ignore[no-untyped-call]
        run_id, sampling_interval=interval_s, tracking_uri=tracking_uri
    )
    monitor.mlflow_logger = MonitorSink(sink)
    sampler = SystemSampler(monitor, interval_s)
    sampler.start()
    return sampler


def stop_monitor(monitor: Any) -> bool:
    """Stop a system monitor, waiting a bounded time (its last hand-over to the sink may wait on the store); False
    when it did not stop in time."""
    stopper = threading.Thread(target=monitor.finish, name="tracking-monitor-stop", daemon=True)
    stopper.start()
    stopper.join(_MONITOR_STOP_TIMEOUT_S)
    return not stopper.is_alive()
