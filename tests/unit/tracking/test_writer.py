"""Tests of tracking.writer: batching, flushing, retrying and closing."""

from __future__ import annotations

import threading
import time

import pytest
import structlog

from flasync.tracking import MetricWriter
from flasync.tracking.metrics import MetricRow as Metric
from flasync.tracking.writer import _WAKE


def metrics(n: int, key: str = "k") -> list[Metric]:
    return [Metric(key, float(i), 0, i) for i in range(n)]


class Backend:
    """A log_batch callable that records batches and fails its first `failures` calls."""

    def __init__(self, failures: int = 0, delay_s: float = 0.0) -> None:
        self.failures = failures
        self.delay_s = delay_s
        self.batches: list[list[Metric]] = []
        self.calls = 0

    def __call__(self, batch: list[Metric]) -> None:
        self.calls += 1
        time.sleep(self.delay_s)
        if self.calls <= self.failures:
            raise ConnectionError("store unavailable")
        self.batches.append(batch)

    @property
    def values(self) -> list[float]:
        return [m.value for batch in self.batches for m in batch]


def test_batches_hold_at_most_max_batch_metrics() -> None:
    """2500 metrics go out in 3 log_batch calls of at most 1000, none lost."""
    backend = Backend()
    writer = MetricWriter(backend, max_batch=1000)
    writer.submit(metrics(2500))
    writer.flush(timeout=5)
    assert [len(b) for b in backend.batches] == [1000, 1000, 500]
    assert backend.values == [float(i) for i in range(2500)]
    writer.close()


def test_small_submissions_are_grouped() -> None:
    """Many one-metric submissions are sent in few calls."""
    backend = Backend()
    writer = MetricWriter(backend, max_batch=1000)
    for i in range(2500):
        writer.submit([Metric("k", float(i), 0, i)])
    writer.flush(timeout=5)
    assert len(backend.batches) <= 3
    assert backend.values == [float(i) for i in range(2500)]
    writer.close()


def test_a_burst_of_submissions_wakes_the_thread_once() -> None:
    """Metrics wait in place for their flush: 200 one-metric calls wake the writer thread once, not 200 times."""
    backend = Backend()
    writer = MetricWriter(backend, max_batch=1000, flush_interval_s=30.0)
    queue = writer._queue
    wakes = 0

    class CountingQueue:  # SimpleQueue's methods are read-only: wrap the queue the thread already waits on
        def put(self, item: object) -> None:
            nonlocal wakes
            wakes += item is _WAKE
            queue.put(item)  # type: ignore[arg-type]

        def __getattr__(self, name: str) -> object:
            return getattr(queue, name)

    writer._queue = CountingQueue()  # type: ignore[assignment]
    for i in range(200):
        writer.submit([Metric("k", float(i), 0, i)])
        time.sleep(0.001)  # the writer thread gets the GIL between calls, as it does beside a training loop
    assert wakes == 1
    assert backend.calls == 0  # nothing is due before the flush interval
    writer.flush(timeout=5)
    assert backend.values == [float(i) for i in range(200)]
    for i in range(1200):  # a full batch still goes at once
        writer.submit([Metric("k", float(i), 0, i)])
    deadline = time.monotonic() + 5
    while len(backend.batches) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [len(batch) for batch in backend.batches] == [200, 1000]
    writer.close()


def test_flush_waits_until_sent() -> None:
    """flush returns only once every earlier metric was accepted by log_batch."""
    backend = Backend(delay_s=0.2)
    writer = MetricWriter(backend, flush_interval_s=10)
    writer.submit(metrics(10))
    writer.flush(timeout=5)
    assert writer.sent == 10
    assert writer.pending == 0
    writer.close()


def test_send_soon_sends_without_waiting_for_the_interval() -> None:
    """send_soon returns while the batch is still being written, long before flush_interval_s."""
    called, release = threading.Event(), threading.Event()
    batches: list[list[Metric]] = []

    def backend(batch: list[Metric]) -> None:
        called.set()
        assert release.wait(5)
        batches.append(batch)

    writer = MetricWriter(backend, flush_interval_s=60)
    writer.submit(metrics(10))
    writer.send_soon()  # had it waited for the send, which waits for `release`, this would not return
    assert called.wait(5)
    release.set()
    writer.flush(timeout=5)
    assert [m.value for batch in batches for m in batch] == [float(i) for i in range(10)]
    writer.close()
    writer.send_soon()  # after close: nothing, and no error


def test_metrics_are_sent_without_flush_after_the_interval() -> None:
    """A partial batch is sent once flush_interval_s has passed."""
    backend = Backend()
    writer = MetricWriter(backend, flush_interval_s=0.05)
    writer.submit(metrics(3))
    deadline = time.monotonic() + 5
    while writer.sent < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.sent == 3
    writer.close()


def test_submit_never_calls_log_batch_on_the_caller_thread() -> None:
    """log_batch only ever runs on the writer's own thread."""
    threads: set[int] = set()
    writer = MetricWriter(lambda batch: threads.add(threading.get_ident()), max_batch=10)
    writer.submit(metrics(100))
    writer.flush(timeout=5)
    writer.close()
    assert threads
    assert threading.get_ident() not in threads


def test_failures_then_success_lose_nothing() -> None:
    """A log_batch that fails twice then works still receives every metric, in order."""
    backend = Backend(failures=2)
    writer = MetricWriter(backend)
    writer.submit(metrics(1500))
    writer.flush(timeout=5)
    assert backend.values == [float(i) for i in range(1500)]
    assert writer.errors == 2
    assert writer.sent == 1500
    writer.close()


def test_one_warning_per_failure_streak() -> None:
    """Repeated failures log a single warning until log_batch works again."""
    backend = Backend(failures=2)
    with structlog.testing.capture_logs() as logs:
        writer = MetricWriter(backend)
        writer.submit(metrics(5))
        writer.flush(timeout=5)
        writer.close()
    events = [entry["event"] for entry in logs]
    assert events.count("metric_writer.log_batch_failed") == 1
    assert "metric_writer.recovered" in events


def test_flush_times_out_on_a_dead_backend() -> None:
    """flush raises TimeoutError when the metrics cannot be sent in time."""
    writer = MetricWriter(Backend(failures=10**9))
    writer.submit(metrics(5))
    with pytest.raises(TimeoutError):
        writer.flush(timeout=0.2)
    writer.close(timeout=0)


def test_close_with_a_dead_backend_returns_within_its_timeout() -> None:
    """close gives up after its timeout and reports how many metrics were not sent."""
    writer = MetricWriter(Backend(failures=10**9))
    writer.submit(metrics(42))
    began = time.monotonic()
    unsent = writer.close(timeout=0.3)
    assert time.monotonic() - began < 2.0
    assert unsent == 42


def test_close_is_idempotent_and_later_submits_are_dropped() -> None:
    """A second close is harmless; metrics submitted after close are counted as dropped."""
    backend = Backend()
    writer = MetricWriter(backend)
    writer.submit(metrics(5))
    assert writer.close() == 0
    assert writer.close() == 0
    writer.submit(metrics(3))
    writer.flush()
    assert writer.statistics().dropped == 3
    assert backend.values == [float(i) for i in range(5)]


@pytest.mark.slow
def test_backlog_is_bounded() -> None:
    """While the backend fails, the oldest metrics beyond max_backlog are dropped."""
    writer = MetricWriter(Backend(failures=10**9), max_backlog=100)
    writer.submit(metrics(250))
    deadline = time.monotonic() + 5
    while writer.dropped < 150 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.dropped == 150
    assert writer.close(timeout=0) == 100


@pytest.mark.slow
def test_a_backlog_overflow_and_what_close_leaves_unsent_are_spilled_not_dropped() -> None:
    """With somewhere to spill, the backlog's overflow and the rows still unsent when close gives up go there, in
    order, counted as spilled: every row is sent or spilled, none dropped."""
    spilled: list[Metric] = []

    def spill(rows: list[Metric]) -> bool:
        spilled.extend(rows)
        return True

    writer = MetricWriter(Backend(failures=10**9), max_backlog=100, spill=spill)
    writer.submit(metrics(250))
    deadline = time.monotonic() + 5
    while writer.spilled < 150 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.spilled == 150 and writer.dropped == 0
    assert writer.close(timeout=0) == 0  # the last 100 were unsent: spilled at close
    stats = writer.statistics()
    assert stats.spilled == 250 and stats.dropped == 0 and stats.pending == 0
    assert [m.value for m in spilled] == [float(i) for i in range(250)]


@pytest.mark.slow
def test_rows_a_spill_refuses_are_dropped_and_counted() -> None:
    """A spill that cannot keep rows (or raises) leaves them dropped and counted, the thread alive."""
    calls: list[int] = []

    def spill(rows: list[Metric]) -> bool:
        calls.append(len(rows))
        if len(calls) == 1:
            raise OSError("disk full")
        return False

    writer = MetricWriter(Backend(failures=10**9), max_backlog=10, spill=spill)
    writer.submit(metrics(30))
    deadline = time.monotonic() + 5
    while writer.dropped < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.submit(metrics(5))
    while writer.dropped < 25 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.dropped == 25 and writer.spilled == 0 and len(calls) >= 2
    writer.close(timeout=0)
