"""The metric side of a tracked run: the queue and its writer thread, the writer process, MLflow's system monitor."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

from flasync.tracking._child import ChildLogBatch, IdleChild
from flasync.tracking._runs import _MONITOR_STOP_TIMEOUT_S, SYSTEM_METRICS_MIN_INTERVAL_S, start_monitor, stop_monitor
from flasync.tracking.failover import Failover, RunIdentity
from flasync.tracking.metrics import MetricRow
from flasync.tracking.sqlite_metrics import schema_mismatch
from flasync.tracking.store import http_env, is_remote, redact_uri
from flasync.tracking.writer import MetricWriter

__all__ = ["CHILD_START_TIMEOUT_S", "RunWriters"]

CHILD_START_TIMEOUT_S = 60.0

_SCHEMA_MISMATCH = "sqlite_schema_mismatch"
"""What a writer process's :attr:`~flasync.tracking._child.ChildLogBatch.told` holds once its store's schema
mismatch was warned of."""


class RunWriters:
    """Queue a run's metrics and send them (from the writer process, or this one), and own that process.

    The writer process also does the run's other jobs (artifacts, tags, the model, the run's end) through
    :meth:`child_job`; the run's lifecycle (:class:`flasync.tracking._lifecycle.RunLifecycle`) says when the run
    exists, and :class:`~flasync.tracking.failover.Failover` routes each batch to the store or the spool.

    Args:
        run: The run the metrics belong to.
        failover: Routes batches to the store or the spool.
        log: Where warnings go.
        http: Bounds one block of calls to a server.
        idle_writers: Where an idle writer process is taken from and left for the next tracker.
        preload: What the writer process imports or calls ahead (see ``MlflowTracker``'s ``preload``).
        writer_process: Send metrics from a writer process.
        system_metrics: Also run MLflow's system monitor for the run.
        system_metrics_interval_s: Seconds between two samples of the system monitor.
        max_batch: Most metrics per ``log_batch`` call.
        flush_interval_s: Longest time a metric waits before it is written, in seconds.
        flush_timeout_s: Longest wait of :meth:`flush` and :meth:`close_writer`, in seconds.
        http_timeout_s: Connect/read timeout of one request to an HTTP(S) server, in seconds.
        http_retries: Retries of one request to an HTTP(S) server.

    Raises:
        ValueError: ``system_metrics_interval_s`` is not a finite number of at least
            :data:`~flasync.tracking._runs.SYSTEM_METRICS_MIN_INTERVAL_S`.
    """

    def __init__(
        self,
        run: RunIdentity,
        failover: Failover,
        *,
        log: Any,
        http: Callable[[], contextlib.AbstractContextManager[None]],
        idle_writers: IdleChild,
        preload: Sequence[str],
        writer_process: bool,
        system_metrics: bool,
        system_metrics_interval_s: float,
        max_batch: int,
        flush_interval_s: float,
        flush_timeout_s: float,
        http_timeout_s: int,
        http_retries: int,
    ) -> None:
        """Hold the settings; nothing starts before :meth:`prepare` or :meth:`start_writers`."""
        least = SYSTEM_METRICS_MIN_INTERVAL_S
        if not system_metrics_interval_s >= least or not math.isfinite(system_metrics_interval_s):
            raise ValueError(
                f"system_metrics_interval_s must be a finite number >= {least}, got {system_metrics_interval_s}"
            )
        self._run = run
        self.tracking_uri = run.tracking_uri
        self._failover = failover
        self._log = log
        self._http = http
        self._idle_writers = idle_writers
        self.preload = tuple(preload)
        self.reused = False
        self._writer_process = writer_process
        self._system_metrics = system_metrics
        self.system_metrics_interval = float(system_metrics_interval_s)
        self._max_batch = max_batch
        self._flush_interval = flush_interval_s
        self.flush_timeout = flush_timeout_s
        self._http_timeout = http_timeout_s
        self._http_retries = http_retries
        self.writer: MetricWriter | None = None
        self.child: ChildLogBatch | None = None
        self.child_run: int | None = None
        """The writer process's run number for this tracker's run (see :attr:`ChildLogBatch.run`)."""
        self.held_steps: dict[str, Container[int]] = {}
        """Metric key -> the steps the store held when this run was resumed (empty for a new run)."""
        self.monitor: Any = None
        self.monitor_in_child = False
        """MLflow's system monitor runs in the writer process (its samples are system-wide, not this process's)."""
        self._opened = threading.Event()
        """Set while no run is being opened (the metric writer sends only then)."""
        self._opened.set()
        self._no_run = False
        """Opening the run failed: queued metrics have nowhere to go."""
        self._journaled = 0
        """Rows the journal took while the run was being opened and the writer has not handed on yet."""
        self._released: str | None = None
        """The run whose writer process :meth:`release` handed back (the next record takes one again)."""
        self._lost_before = 0
        """Metric rows the metric writers :meth:`release` closed lost (counted by :meth:`close_writer`)."""
        self._schema_told = False

    def prepare(self, started: bool) -> None:
        """Start the writer process now (or take an idle one), if this tracker uses one; idempotent.

        The process imports MLflow (over a second) while the caller goes on, e.g. loads its data; ``start``
        hands it the run once the run exists (and starts it itself if this was not called). The process an earlier
        tracker of this process left idle on the same store is taken instead, MLflow loaded and ``preload`` done
        (see :data:`flasync.tracking._child.IDLE`); only stopping a kept one for another store waits (tens of ms).
        ``finish`` leaves it idle for the next tracker once the run has ended, or stops it, also when
        ``start`` never came.

        Args:
            started: Whether the run started already (then nothing is started).
        """
        if not self._writer_process or self.child is not None or started:
            return
        extra = self._child_env()
        child = self._idle_writers.take(self.tracking_uri, extra)
        if child is not None:
            try:
                child.preload(self.preload)
                self.reused = True
            except (ConnectionError, ValueError):
                child.close()
                child = None
        self.child = child or self.new_child()

    @property
    def has_child(self) -> bool:
        """Whether the run's records go through a writer process (also one :meth:`release` handed back, which the
        next record takes again)."""
        return self.child is not None or self._released is not None

    def release(self, run_id: str) -> bool:
        """Write the queued metrics, then have the writer process leave run ``run_id`` open (its status as it is) and
        keep it idle for other runs of this process (a sweep's parent run while its children run); the run's next
        record takes a writer process again, that one or another. False when there was none to hand back."""
        if self.child is None or self._failover.offline:
            return False
        self._lost_before = self.close_writer()
        self.writer = None
        answer = self.child_reply({"op": "release"})
        if answer is None or self.child is None:
            return False
        self.release_child(True)
        self._released = run_id
        return True

    def take_back(self) -> None:
        """Take a writer process again for the run :meth:`release` left (an idle one of this process, or a new one),
        and start its metric writer; nothing when none was released."""
        if self._released is None:
            return
        with self._failover.lock:
            run_id, self._released = self._released, None
            if run_id is not None:
                self.prepare(False)
                self.start_writers(run_id)

    def new_child(self) -> ChildLogBatch:
        """Start a writer process, told what to preload."""
        return ChildLogBatch(self.tracking_uri, extra_env=self._child_env(), preload=self.preload)

    def _child_env(self) -> dict[str, str]:
        """Return the writer process's own environment variables: bounds on a server's HTTP timeout and retries."""
        if not is_remote(self.tracking_uri):
            return {}
        bounds = http_env(self._http_timeout, self._http_retries)
        return {k: v for k, v in bounds.items() if k not in os.environ}

    def begin_open(self) -> None:
        """Queue metrics from now on; the writer's thread sends them once :meth:`end_open` says the run is open."""
        self._opened.clear()
        self.writer = self.metric_writer()

    def end_open(self, *, failed: bool) -> None:
        """Let queued metrics go to the run now open; when opening it ``failed``, drop them (they have no run)."""
        if failed:
            writer, self.writer = self.writer, None
            self._no_run = True
            self._opened.set()
            if writer is not None:
                writer.close(0)
        self._opened.set()

    def child_job(self, request: Mapping[str, Any]) -> bool:
        """Have the writer process do ``request``; False when there is none, the store is failing, or it failed
        (then the caller does the work itself, through the spool if need be)."""
        return self.child_reply(request) is not None

    def child_reply(self, request: Mapping[str, Any]) -> str | None:
        """Have the writer process do ``request`` and return what its answer says (None as :meth:`child_job`'s
        False)."""
        with self._failover.lock:
            if self._failover.offline:
                return None
            self.take_back()
            child = self.ready_child()
            if child is None:
                return None
            try:
                return child.job(request, CHILD_START_TIMEOUT_S, run=self.child_run)
            except ConnectionError as exc:
                self._log.warning("tracking.writer_process_lost", error=redact_uri(str(exc)), metrics=False)
                self.child = None
                return None
            except RuntimeError as exc:
                self._log.info(
                    "tracking.writer_process_job_failed",
                    op=request.get("op"),
                    error=redact_uri(str(exc))[:300],
                    metrics=False,
                )
                return None

    def _writer_process_failed(self, error: BaseException) -> None:
        """Warn that the writer process could not start or connect, and write from this process from now on."""
        self._log.warning("tracking.writer_process_failed", error=redact_uri(str(error)), metrics=False)
        self.stop_child()

    def ready_child(self) -> ChildLogBatch | None:
        """Return the writer process once it is connected (waiting a bounded time); None when there is none."""
        child = self.child
        if child is None or child.ready:
            return child
        try:
            child.wait_ready(CHILD_START_TIMEOUT_S)
        except (ConnectionError, RuntimeError) as exc:
            self._writer_process_failed(exc)
            return None
        return child

    def stop_child(self) -> None:
        """Stop the writer process, if any."""
        if self.child is not None:
            self.child.close()
            self.child = None

    def release_child(self, reusable: bool) -> None:
        """Leave the writer process idle for the next tracker of this process (see :data:`flasync.tracking._child.IDLE`)
        when ``reusable`` and it serves no run (it ended this one, or never had it); else stop it."""
        child, self.child = self.child, None
        if child is None:
            return
        if reusable and child.idle:
            self._idle_writers.keep(child)
        else:
            child.close()

    def start_writers(self, run_id: str) -> None:
        """Hand the metric child process (if any) its run, then start the metric writer and the system monitor."""
        child = self.child
        if child is not None:
            # Not waited for: the child connects while training starts, and metrics queue until it is ready.
            try:
                if not child.bound:
                    child.bind(run_id)
                    self.child_run = child.run
            except ConnectionError as exc:
                self._writer_process_failed(exc)
            if self.child is not None:
                self.tell_schema_mismatch()
        if self.writer is None:
            self.writer = self.metric_writer()
        interval_s = self.system_metrics_interval
        if self._system_metrics and self.child_job({"op": "monitor", "interval_s": interval_s}):
            self.monitor_in_child = True
        elif self._system_metrics:
            # Its samples go through this tracker's writer (batched, and spooled while the store fails).
            self.monitor = start_monitor(run_id, self.tracking_uri, self.log_metrics, interval_s)

    def tell_schema_mismatch(self) -> None:
        """Warn once (``tracking.sqlite_schema_mismatch``) when the SQLite store's schema is not the one the direct
        writes into its tables were written for: those writes then go through MLflow's ``log_batch`` (the writer
        process decides so itself, with the same check, :meth:`flasync.tracking.sqlite_metrics.SqliteMetrics.open`).
        Once for a tracker, and once for all the runs one writer process serves (a sweep's child runs)."""
        child = self.child
        if self._schema_told or (child is not None and _SCHEMA_MISMATCH in child.told):
            return
        mismatch = schema_mismatch(self.tracking_uri)
        if mismatch is None:
            return
        self._schema_told = True
        if child is not None:
            child.told.add(_SCHEMA_MISMATCH)
        self._log.warning(
            "tracking.sqlite_schema_mismatch",
            message=f"the MLflow store's schema is at revision {mismatch.store}, not the one flasync's direct SQLite "
            "writes were written for: metrics, params and tags go through MLflow's log_batch",
            store_revision=mismatch.store,
            expected_revisions=",".join(mismatch.expected),
            mlflow_head=mismatch.head,
            metrics=False,
        )

    def metric_writer(self) -> MetricWriter:
        """Return a new metric writer whose thread sends batches with :meth:`_log_metric_batch`."""
        return MetricWriter(
            self._log_metric_batch,
            max_batch=self._max_batch,
            flush_interval_s=self._flush_interval,
            close_timeout_s=self.flush_timeout,
            logger=self._log,
            spill=self._failover.spill,
        )

    def _log_metric_batch(self, metrics: list[MetricRow]) -> None:
        """Write one batch (called by the metric writer's thread) once the run is open: direct, or to the spool;
        never raises. The rows the journal took while the run was being opened come first (the queue keeps their
        order): when the journal became the spool they are in it already, and are not written there again."""
        self._opened.wait()
        if self._no_run:
            return
        if self._journaled:
            first = min(self._journaled, len(metrics))
            self._journaled -= first
            journal = self._failover.journal
            if journal is not None and journal.adopted:
                metrics = metrics[first:]
                if not metrics:
                    return
        self._failover.send_metrics(metrics, self._send_metrics)

    def _send_metrics(self, metrics: list[MetricRow]) -> None:
        child = self.ready_child()
        if child is not None:
            try:
                child(metrics, run=self.child_run)
                return
            except ConnectionError as exc:
                # The child died: write from this process from now on rather than lose metrics.
                self._log.warning("tracking.writer_process_lost", error=redact_uri(str(exc)), metrics=False)
                self.child = None
        run_id, client = self._run.run_id, self._run.connect(self._log)
        from mlflow.entities import Metric

        assert run_id is not None
        entities = [Metric(m.key, m.value, m.timestamp, m.step) for m in metrics]
        with self._http():
            client.log_batch(run_id, metrics=entities, synchronous=True)

    def log_metrics(self, metrics: list[MetricRow]) -> None:
        """Queue metrics for the run; never blocks (dropped before start and after finish; in a resumed run, those
        at a step the store already holds for their key)."""
        self.take_back()
        if self.writer is None:
            return
        held = self.held_steps
        if held:
            metrics = [row for row in metrics if row.step not in held.get(row.key, ())]
        journal = self._failover.journal
        if journal is not None and not self._opened.is_set() and journal.metrics(metrics):
            self._journaled += len(metrics)  # before the run opens, the journal is what a killed process leaves
        self.writer.submit(metrics)

    @property
    def opening(self) -> bool:
        """Whether the run is being opened (metrics queue, and go to the journal too)."""
        return not self._opened.is_set()

    def send_soon(self) -> None:
        """Start writing the queued metrics now, without waiting for them."""
        writer = self.writer
        if writer is not None:
            writer.send_soon()

    def flush(self) -> bool:
        """Block until queued metrics were written (or spooled), or ``flush_timeout_s`` passed (then warn)."""
        if self.writer is None:
            return True
        try:
            self.writer.flush(self.flush_timeout)
        except TimeoutError:
            self._log.warning(
                "tracker.flush_timeout",
                pending=self.writer.pending,
                timeout_s=self.flush_timeout,
                metrics=False,
            )
            return False
        return True

    def stop_monitor(self) -> None:
        """Stop this process's system monitor, if any, waiting a bounded time; warn of the system metric rows it
        lost (``tracking.system_metrics_lost``: its sink is this tracker's writer, which spools, so only rows the
        writer refused)."""
        monitor = self.monitor
        if monitor is None:
            return
        if not stop_monitor(monitor):
            self._log.warning("tracking.system_monitor_stuck", timeout_s=_MONITOR_STOP_TIMEOUT_S, metrics=False)
        elif monitor.sink.lost:
            self._log.warning("tracking.system_metrics_lost", rows=monitor.sink.lost, metrics=False)
        self.monitor = None

    def close_writer(self) -> int:
        """Write what is queued (waiting at most ``flush_timeout_s``) and stop the metric writer's thread; return how
        many metric rows were lost (neither written nor kept in the journal)."""
        if self.writer is None:
            return self._lost_before
        self.writer.close(self.flush_timeout)
        return self._lost_before + self.writer.dropped + self.writer.pending
