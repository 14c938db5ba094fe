"""Send metrics to MLflow in batches from a background thread."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from queue import Empty, SimpleQueue
from typing import Any, NamedTuple

from flasync.tracking.logs import LibraryLogger
from flasync.tracking.metrics import MetricRow
from flasync.tracking.store import redact_uri

__all__ = ["MetricWriter", "WriterStatistics"]

_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0


class WriterStatistics(NamedTuple):
    """Counters of a :class:`MetricWriter`, all in metrics except ``batches`` and ``errors``."""

    submitted: int
    """Metrics handed to :meth:`MetricWriter.submit` (dropped ones included)."""
    sent: int
    """Metrics that ``log_batch`` accepted."""
    batches: int
    """Successful ``log_batch`` calls."""
    errors: int
    """Failed ``log_batch`` calls."""
    dropped: int
    """Metrics given up on: backlog overflow with nowhere to spill, or submitted after :meth:`MetricWriter.close`."""
    pending: int
    """Metrics submitted but neither sent, spilled nor dropped yet."""
    spilled: int = 0
    """Metrics handed to ``spill``: those the backlog could not hold, and those unsent when the writer closed."""


class _Flush:
    __slots__ = ("done", "target")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.target = 0


class _Wake:
    """Metrics are waiting in the writer's incoming list."""


_WAKE = _Wake()


class _Stop:
    __slots__ = ("timeout",)

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout


@dataclass(slots=True)
class _LoopState:
    """What the writer thread's loop keeps between passes."""

    buffer: deque[MetricRow] = field(default_factory=deque)
    waiters: list[_Flush] = field(default_factory=list)
    received: int = 0  # metrics taken off the queue
    oldest_at: float = 0.0  # monotonic time the oldest buffered metric arrived
    retry_at: float = 0.0  # no send before this (backoff)
    backoff: float = 0.0  # 0 while the backend works
    streak: int = 0  # failed calls in the current failure streak
    overflowing: bool = False
    stop_at: float | None = None


class MetricWriter:
    """Batch metrics and send them with ``log_batch`` from a daemon thread.

    :meth:`submit` only puts a list on a queue, so it never blocks and never calls MLflow on the
    caller's thread. The thread groups queued metrics into calls of at most ``max_batch`` metrics:
    full batches go at once, the rest at the latest ``flush_interval_s`` after it arrived.

    A failing ``log_batch`` loses nothing: the metrics stay in a backlog and the call is retried
    with backoff (0.1 s doubling to 5 s); one warning is logged per failure streak. The backlog is
    bounded by ``max_backlog``; beyond it the oldest metrics go to ``spill`` (the run's journal, from which they
    reach the run later), or, with nowhere to spill, are dropped and counted. What is still unsent when
    :meth:`close` gives up goes to ``spill`` too. No exception escapes the thread.

    Args:
        log_batch: Sends one batch, e.g. ``functools.partial(client.log_batch, run_id)``
            applied as ``log_batch(metrics)``; raises on failure.
        max_batch: Most metrics per ``log_batch`` call (MLflow accepts 1000).
        flush_interval_s: Longest time a metric waits for its batch to fill, in seconds.
        max_backlog: Most metrics kept while the backend fails.
        close_timeout_s: How long :meth:`close` keeps retrying a failing backend, in seconds.
        logger: Where warnings go; a :class:`~flasync.tracking.logs.LibraryLogger` named
            ``flasync.tracking.writer`` when None (no debug lines unless structlog is configured).
        spill: Keeps metrics the writer cannot send in time elsewhere (called on its thread); returns False when
            it could not (they are then dropped and counted). None: nowhere.

    Raises:
        ValueError: A size or interval is not positive.
    """

    def __init__(
        self,
        log_batch: Callable[[list[MetricRow]], None],
        *,
        max_batch: int = 1000,
        flush_interval_s: float = 0.5,
        max_backlog: int = 200_000,
        close_timeout_s: float = 10.0,
        logger: Any = None,
        spill: Callable[[list[MetricRow]], bool] | None = None,
    ) -> None:
        if max_batch < 1 or max_backlog < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_backlog ({max_backlog}) must be >= 1")
        if flush_interval_s <= 0 or close_timeout_s < 0:
            raise ValueError(
                f"flush_interval_s ({flush_interval_s}) must be > 0 and close_timeout_s ({close_timeout_s}) >= 0"
            )
        self._log_batch = log_batch
        self._max_batch = max_batch
        self._interval = flush_interval_s
        self._max_backlog = max_backlog
        self._close_timeout = close_timeout_s
        self._log = logger if logger is not None else LibraryLogger("flasync.tracking.writer")
        self._queue: SimpleQueue[_Wake | _Flush | _Stop] = SimpleQueue()
        self._lock = threading.Lock()
        # Submitted metrics wait here; the thread is woken only when this list starts or fills a batch, not per call
        # (a wake-up per logged event makes the threads of a busy process fight for the GIL).
        self._incoming: list[MetricRow] = []
        self._incoming_since = 0.0  # monotonic time the oldest metric in _incoming arrived
        self._closed = False
        self._submitted = 0
        self._sent = 0
        self._batches = 0
        self._errors = 0
        self._dropped = 0
        self._late = 0  # dropped because submitted after close (counted by the caller thread)
        self._spill = spill
        self._spilled = 0
        self._thread = threading.Thread(target=self._run, name="tracking-metric-writer", daemon=True)
        self._thread.start()

    @property
    def sent(self) -> int:
        """Metrics that ``log_batch`` accepted."""
        return self._sent

    @property
    def batches(self) -> int:
        """Successful ``log_batch`` calls."""
        return self._batches

    @property
    def errors(self) -> int:
        """Failed ``log_batch`` calls."""
        return self._errors

    @property
    def dropped(self) -> int:
        """Metrics given up on (backlog overflow, or submitted after close)."""
        return self._dropped + self._late

    @property
    def pending(self) -> int:
        """Metrics submitted but neither sent, spilled nor dropped yet."""
        return self._submitted - self._sent - self._dropped - self._late - self._spilled

    @property
    def spilled(self) -> int:
        """Metrics handed to ``spill`` (the backlog's overflow, and what was unsent at close)."""
        return self._spilled

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def statistics(self) -> WriterStatistics:
        """Return a snapshot of the counters."""
        return WriterStatistics(
            submitted=self._submitted,
            sent=self._sent,
            batches=self._batches,
            errors=self._errors,
            dropped=self.dropped,
            pending=self.pending,
            spilled=self._spilled,
        )

    def submit(self, metrics: list[MetricRow]) -> None:
        """Queue metrics for sending; never blocks on I/O.

        The list is handed over: do not change it afterwards. After :meth:`close` the metrics are
        dropped and counted in :attr:`dropped`.

        Args:
            metrics: The metrics, in any number (they are re-batched).
        """
        if not metrics:
            return
        with self._lock:
            self._submitted += len(metrics)
            if self._closed:
                self._late += len(metrics)
                return
            incoming = self._incoming
            if not incoming:
                self._incoming_since = time.monotonic()
            # Woken when the list starts (to time its flush) or fills a batch. The thread leaves the list alone until
            # it sends, so a burst of calls wakes it once, not once per call (each wake-up takes the GIL from
            # training).
            wake = not incoming or len(incoming) // self._max_batch < (len(incoming) + len(metrics)) // self._max_batch
            incoming.extend(metrics)
        if wake:
            self._queue.put(_WAKE)

    def send_soon(self) -> None:
        """Have the thread send every metric submitted so far now, without waiting for it (nothing after
        :meth:`close`): e.g. when a run's training ends, so the store writes them while the caller does other work."""
        with self._lock:
            if self._closed:
                return
            self._queue.put(_Flush())

    def flush(self, timeout: float | None = None) -> None:
        """Block until every metric submitted before this call was sent (or dropped).

        Returns at once after :meth:`close`.

        Args:
            timeout: Longest wait in seconds; None waits as long as it takes.

        Raises:
            TimeoutError: The metrics were not all sent within ``timeout`` (they stay queued).
        """
        request = _Flush()
        with self._lock:
            if self._closed:
                return
            self._queue.put(request)
        if not request.done.wait(timeout):
            raise TimeoutError(f"{self.pending} metrics still unsent after {timeout} s")

    def close(self, timeout: float | None = None) -> int:
        """Send what is queued, then stop the thread; idempotent.

        With a failing backend it keeps retrying for at most ``timeout`` seconds, then gives up
        and logs how many metrics were lost.

        Args:
            timeout: Longest time to keep retrying, in seconds; ``close_timeout_s`` when None.

        Returns:
            The number of metrics that were not sent.
        """
        limit = self._close_timeout if timeout is None else max(0.0, timeout)
        with self._lock:
            first = not self._closed
            if first:
                self._closed = True
                self._queue.put(_Stop(limit))
        if first:
            # A log_batch call stuck in I/O is not interruptible; stop waiting for it after a grace.
            self._thread.join(limit + 1.0)
        unsent = self.pending + self._late
        if first and unsent:
            self._log.warning(
                "metric_writer.unsent",
                unsent=unsent,
                sent=self._sent,
                errors=self._errors,
                metrics=False,
            )
        return unsent

    def _run(self) -> None:
        loop = _LoopState()
        try:
            while True:
                items = self._take(self._wait(loop))
                self._take_arrived(loop, control=any(not isinstance(item, _Wake) for item in items))
                for item in items:
                    if isinstance(item, _Wake):
                        continue
                    if isinstance(item, _Flush):
                        item.target = loop.received
                        loop.waiters.append(item)
                    elif loop.stop_at is None:
                        loop.stop_at = time.monotonic() + item.timeout
                self._trim_backlog(loop)
                if loop.buffer and time.monotonic() >= loop.retry_at:
                    self._send_buffer(loop)
                done = self._sent + self._dropped + self._spilled
                for waiter in [w for w in loop.waiters if w.target <= done]:
                    waiter.done.set()
                    loop.waiters.remove(waiter)
                if loop.stop_at is not None and (not loop.buffer or time.monotonic() >= loop.stop_at):
                    if loop.buffer and self._spill_rows(list(loop.buffer)):  # unsent in time: to the journal
                        loop.buffer.clear()
                    return
        except BaseException as exc:  # pragma: no cover - a bug here must not kill the process quietly
            self._log.error("metric_writer.crashed", error=redact_uri(repr(exc)), metrics=False)
        finally:
            with self._lock:
                self._closed = True
            for waiter in loop.waiters:
                waiter.done.set()
            # Release flushers that queued a request after the loop ended.
            for item in self._drain():
                if isinstance(item, _Flush):
                    item.done.set()

    def _wait(self, loop: _LoopState) -> float | None:
        """Return how long the loop may wait for the queue: until a batch is due, a backoff ends or a stop's limit."""
        now = time.monotonic()
        with self._lock:
            arrived_at = self._incoming_since if self._incoming else None
        first = loop.oldest_at if loop.buffer else arrived_at
        wait: float | None = None
        if first is not None:
            due = now if (loop.waiters or loop.stop_at is not None) else first + self._interval
            wait = max(0.0, max(due, loop.retry_at) - now)
        if loop.stop_at is not None:
            left = max(0.0, loop.stop_at - now)
            wait = left if wait is None else min(wait, left)
        return wait

    def _take_arrived(self, loop: _LoopState, *, control: bool) -> None:
        """Move the submitted metrics into the buffer when they are to be sent."""
        now = time.monotonic()
        with self._lock:
            incoming = self._incoming
            # Take the submitted metrics only to send them (or for a flush, whose target counts everything
            # submitted before it): while they stay in the list, further submits do not wake this thread.
            take = bool(incoming) and (
                control
                or bool(loop.waiters)
                or loop.stop_at is not None
                or len(loop.buffer) + len(incoming) >= self._max_batch
                or (loop.oldest_at if loop.buffer else self._incoming_since) + self._interval <= now
            )
            arrived: list[MetricRow] = []
            if take:
                arrived, self._incoming = incoming, []
            arrived_at = self._incoming_since
        if arrived:
            if not loop.buffer:
                loop.oldest_at = arrived_at
            loop.buffer.extend(arrived)
            loop.received += len(arrived)

    def _trim_backlog(self, loop: _LoopState) -> None:
        """Drop the oldest metrics past ``max_backlog`` (warning once per overflow)."""
        buffer = loop.buffer
        if len(buffer) > self._max_backlog:
            excess = len(buffer) - self._max_backlog
            rows = [buffer.popleft() for _ in range(excess)]
            spilled = self._spill_rows(rows)
            if not spilled:
                self._dropped += excess
            if not loop.overflowing:
                loop.overflowing = True
                self._log.warning(
                    "metric_writer.backlog_spilled" if spilled else "metric_writer.backlog_full",
                    message=f"the store takes metrics more slowly than the run makes them: the oldest {excess} of "
                    + (
                        "the backlog go to the run's journal, to reach the run when it ends"
                        if spilled
                        else "the backlog are dropped (counted)"
                    ),
                    **({"spilled": excess} if spilled else {"dropped": excess}),
                    max_backlog=self._max_backlog,
                    metrics=False,
                )
        elif loop.overflowing and len(buffer) < self._max_backlog // 2:
            loop.overflowing = False

    def _spill_rows(self, rows: list[MetricRow]) -> bool:
        """Hand ``rows`` to ``spill``; True (and counted) when it kept them."""
        if self._spill is None or not rows:
            return False
        try:
            kept = self._spill(rows)
        except Exception as exc:  # a spill that fails loses the rows, never the thread
            self._log.warning("metric_writer.spill_failed", error=redact_uri(repr(exc))[:300], metrics=False)
            kept = False
        if kept:
            self._spilled += len(rows)
        return kept

    def _send_buffer(self, loop: _LoopState) -> None:
        """Send what is buffered; after a failure, back off (doubling, capped) and warn at a streak's first."""
        now = time.monotonic()
        urgent = bool(loop.waiters) or loop.stop_at is not None or now >= loop.oldest_at + self._interval
        error = self._send(loop.buffer, urgent=urgent)
        if error is None:
            if loop.streak:
                self._log.info("metric_writer.recovered", failed_calls=loop.streak, metrics=False)
            loop.streak, loop.backoff = 0, 0.0
            return
        loop.streak += 1
        loop.backoff = _FIRST_BACKOFF_S if loop.backoff == 0.0 else min(2 * loop.backoff, _MAX_BACKOFF_S)
        loop.retry_at = time.monotonic() + loop.backoff
        if loop.streak == 1:
            self._log.warning(
                "metric_writer.log_batch_failed",
                error=redact_uri(repr(error)),
                pending=len(loop.buffer),
                retry_in_s=loop.backoff,
                metrics=False,
            )

    def _take(self, wait: float | None) -> list[_Wake | _Flush | _Stop]:
        """Block for one queue item (at most ``wait`` seconds), then take all that are ready."""
        try:
            first = self._queue.get(timeout=wait) if wait is None or wait > 0 else self._queue.get_nowait()
        except Empty:
            return []
        return [first, *self._drain()]

    def _drain(self) -> list[_Wake | _Flush | _Stop]:
        items: list[_Wake | _Flush | _Stop] = []
        try:
            while True:
                items.append(self._queue.get_nowait())
        except Empty:
            return items

    def _send(self, buffer: deque[MetricRow], *, urgent: bool) -> BaseException | None:
        """Send full batches, and the remainder if ``urgent``; return the error that stopped it."""
        while buffer and (urgent or len(buffer) >= self._max_batch):
            size = min(self._max_batch, len(buffer))
            batch = list(islice(buffer, size))
            try:
                self._log_batch(batch)
            except Exception as exc:
                self._errors += 1
                return exc
            for _ in range(size):
                buffer.popleft()
            self._sent += size
            self._batches += 1
        return None
