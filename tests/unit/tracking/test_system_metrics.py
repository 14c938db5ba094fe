"""System metrics: rows a failing sink refused are handed again, and the sampler goes on while the store fails."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import pytest

from flasync.tracking import _runs
from flasync.tracking._runs import MonitorSink, SystemSampler
from flasync.tracking.metrics import MetricRow


class _Store:
    """A sink that fails while ``down`` and keeps what it was handed otherwise."""

    def __init__(self) -> None:
        self.down = False
        self.rows: list[MetricRow] = []

    def __call__(self, rows: list[MetricRow]) -> None:
        if self.down:
            raise ConnectionError("store unreachable")
        self.rows.extend(rows)


def test_rows_refused_while_the_store_fails_are_written_when_it_is_back() -> None:
    """Samples taken while the sink raises are held and reach it, in order, with the first sample after."""
    store = _Store()
    sink = MonitorSink(store)
    store.down = True
    sink.record_metrics({"system/cpu_utilization_percentage": 10.0}, step=0)
    sink.record_metrics({"system/cpu_utilization_percentage": 20.0}, step=1)
    assert store.rows == [] and len(sink.data) == 2
    store.down = False
    sink.record_metrics({"system/cpu_utilization_percentage": 30.0}, step=2)
    assert [(row.value, row.step) for row in store.rows] == [(10.0, 0), (20.0, 1), (30.0, 2)]
    assert sink.data == [] and sink.lost == 0


def test_rows_past_the_bound_are_dropped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store down for long keeps the newest rows up to the bound; the older ones are counted as lost."""
    monkeypatch.setattr(_runs, "_HELD_SYSTEM_ROWS", 3)
    store = _Store()
    store.down = True
    sink = MonitorSink(store)
    for step in range(5):
        sink.record_metrics({"system/a": float(step)}, step=step)
    assert [row.step for row in sink.data] == [2, 3, 4] and sink.lost == 2


class _Monitor:
    """MLflow's monitor's sampling surface: two samples per publication; the test stops it after three."""

    samples_before_logging = 2

    def __init__(self, sink: MonitorSink) -> None:
        self.mlflow_logger = sink
        self.samples = 0
        self.published = threading.Event()
        self._step = 0

    def collect_metrics(self) -> None:
        self.samples += 1

    def aggregate_metrics(self) -> Mapping[str, float]:
        return {"system/samples": float(self.samples)}

    def publish_metrics(self, metrics: Mapping[str, float]) -> None:
        self.mlflow_logger.record_metrics(metrics, self._step)
        self._step += 1
        if self._step >= 3:
            self.published.set()


def test_the_sampler_goes_on_while_the_store_fails_and_hands_everything_at_the_end() -> None:
    """With the store failing from the start, the sampler keeps sampling (it never asks the store for the run) and
    the rows reach the sink once it is back, by the sampler's end at the latest."""
    store = _Store()
    store.down = True
    sink = MonitorSink(store)
    monitor = _Monitor(sink)
    sampler = SystemSampler(monitor, interval_s=0.001)
    sampler.start()
    assert monitor.published.wait(timeout=30)
    store.down = False
    sampler.finish()
    assert [row.step for row in store.rows][:3] == [0, 1, 2]
    assert sink.lost == 0 and sink.data == []


def test_rows_still_refused_when_the_sampler_stops_are_counted_lost() -> None:
    """A store still failing at the end: the rows held are counted in ``lost``, none left held."""
    store = _Store()
    store.down = True
    sink = MonitorSink(store)
    monitor = _Monitor(sink)
    sampler = SystemSampler(monitor, interval_s=0.001)
    sampler.start()
    assert monitor.published.wait(timeout=30)
    sampler.finish()
    assert store.rows == [] and sink.lost >= 3 and sink.data == []
