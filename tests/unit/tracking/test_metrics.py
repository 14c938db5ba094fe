"""Tests of tracking.metrics: structlog events become MLflow metrics."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from mlflow.entities import Metric
from structlog.typing import EventDict

from flasync.tracking import DEFAULT_EXCLUDE, ConstantSeries, MetricRow, MetricsProcessor


class Sink:
    """Collects what the processor sends, one list per call."""

    def __init__(self) -> None:
        self.calls: list[list[Metric]] = []

    def __call__(self, metrics: list[Metric]) -> None:
        self.calls.append(metrics)

    def by_key(self) -> dict[str, Metric]:
        return {m.key: m for call in self.calls for m in call}


def run(event: str, **fields: Any) -> tuple[Sink, EventDict]:
    sink = Sink()
    processor = MetricsProcessor(sink, clock_ms=lambda: 1234)
    out = processor(None, "debug", {"event": event, **fields})
    return sink, out


def test_numeric_fields_become_dotted_keys_at_the_event_step() -> None:
    """Each int or float field becomes `<event>.<field>` at the event's step and clock time."""
    sink, _ = run("client.trained", step=7, train_s=0.25, samples=64)
    metrics = sink.by_key()
    assert set(metrics) == {"client/trained/train_s", "client/trained/samples"}
    assert metrics["client/trained/train_s"].value == 0.25
    assert metrics["client/trained/samples"].value == 64.0
    assert isinstance(metrics["client/trained/samples"].value, float)
    assert {(m.step, m.timestamp) for m in metrics.values()} == {(7, 1234)}


def test_one_sink_call_per_event() -> None:
    """All metrics of one event go to the sink in a single call."""
    sink, _ = run("server.aggregated", step=1, a=1, b=2.0, c=3)
    assert len(sink.calls) == 1
    assert len(sink.calls[0]) == 3


def test_event_is_returned_unchanged() -> None:
    """The processor passes the event on as it came."""
    _, out = run("client.trained", step=2, train_s=0.5, note="x")
    assert out == {"event": "client.trained", "step": 2, "train_s": 0.5, "note": "x"}


def test_bools_and_strings_are_not_metrics() -> None:
    """Booleans, strings and None are skipped, and an event without numbers sends nothing."""
    sink, _ = run("client.failed", ok=False, reason="timeout", detail=None)
    assert sink.calls == []


def test_excluded_identifiers_are_not_metrics() -> None:
    """Ids, versions and the step itself are never metrics."""
    ids = dict.fromkeys(DEFAULT_EXCLUDE, 3)
    sink, _ = run("update.received", staleness=2, **ids)
    assert list(sink.by_key()) == ["update/received/staleness"]


def test_custom_exclude_replaces_the_default() -> None:
    """A given exclude set is used instead of DEFAULT_EXCLUDE."""
    sink = Sink()
    MetricsProcessor(sink, exclude={"bytes"})(None, "info", {"event": "e", "bytes": 3, "client_id": 1})
    assert list(sink.by_key()) == ["e/client_id"]


def test_metrics_false_skips_the_event_and_drops_the_flag() -> None:
    """An event logged with metrics=False sends nothing and loses its `metrics` key."""
    sink, out = run("writer.warning", metrics=False, pending=10)
    assert sink.calls == []
    assert "metrics" not in out


def test_nan_and_infinity_pass_through() -> None:
    """Non-finite values are sent as they are."""
    sink, _ = run("diag", step=0, loss=math.nan, grad=-math.inf)
    metrics = sink.by_key()
    assert math.isnan(metrics["diag/loss"].value)
    assert metrics["diag/grad"].value == -math.inf


def test_numpy_scalars_are_numbers() -> None:
    """NumPy integer and float scalars count as numbers."""
    sink, _ = run("e", a=np.float32(0.5), b=np.int64(3), c=np.bool_(True))
    assert {k: m.value for k, m in sink.by_key().items()} == {"e/a": 0.5, "e/b": 3.0}


def test_missing_or_odd_step_means_step_zero() -> None:
    """Without a usable step the metrics are logged at step 0."""
    sink, _ = run("e", step="late", x=1)
    assert sink.by_key()["e/x"].step == 0


def test_keys_mlflow_would_refuse_are_made_valid() -> None:
    """Characters MLflow rejects in keys are replaced by underscores."""
    sink, _ = run("edge<3>:merged", bytes_in=10)
    assert list(sink.by_key()) == ["edge_3__merged/bytes_in"]


def test_dropped_keys_are_not_sent_and_other_events_keep_the_field() -> None:
    """drop_keys removes one event's field, not the same field name of other events."""
    sink = Sink()
    processor = MetricsProcessor(sink, clock_ms=lambda: 1, drop_keys={"client/encode_s"})
    processor(None, "debug", {"event": "client", "step": 1, "encode_s": 0.1, "loss": 2.0})
    processor(None, "debug", {"event": "profile.version", "step": 1, "encode_s": 0.3})
    assert set(sink.by_key()) == {"client/loss", "profile/version/encode_s"}
    sink.calls.clear()
    processor(None, "debug", {"event": "client", "step": 2, "encode_s": 0.1})
    assert sink.calls == []


def test_emit_takes_fields_without_an_event_dict() -> None:
    """emit(event, fields) sends the same rows as the processor would, as MetricRow tuples."""
    sink = Sink()
    processor = MetricsProcessor(sink, clock_ms=lambda: 5)
    processor.emit("client", {"step": 3, "loss": 0.5, "client_id": 4, "note": "x"})
    assert sink.calls == [[MetricRow("client/loss", 0.5, 5, 3)]]
    assert isinstance(sink.calls[0][0], MetricRow)


def test_a_field_is_judged_by_its_value_each_time() -> None:
    """A field first seen holding text still becomes a metric when it later holds a number."""
    sink = Sink()
    processor = MetricsProcessor(sink, clock_ms=lambda: 1)
    processor.emit("e", {"x": "n/a"})
    processor.emit("e", {"x": 2, "y": True})
    processor.emit("e", {"x": None})
    assert sink.calls == [[MetricRow("e/x", 2.0, 1, 0)]]


def test_many_event_names_and_fields_keep_the_right_keys() -> None:
    """Past the cache's bounds (events and fields named at run time), every key is still right."""
    sink = Sink()
    processor = MetricsProcessor(sink, clock_ms=lambda: 1, exclude={"skip"})
    for index in range(2500):
        processor.emit(f"event{index % 1200}", {f"f{index}": index, "skip": 1.0})
        processor.emit("wide", {f"g{index}": index})
    keys = [row.key for call in sink.calls for row in call]
    assert keys == [key for index in range(2500) for key in (f"event{index % 1200}/f{index}", f"wide/g{index}")]


def _rows(key: str, values: list[float], first_step: int = 0) -> list[MetricRow]:
    return [MetricRow(key, v, 1000 + i, first_step + i) for i, v in enumerate(values)]


def test_a_constant_series_is_held_back_and_reported_once() -> None:
    """Rows of a held key that never changes are not sent; constants() gives its value; other keys pass at once."""
    sent: list[MetricRow] = []
    held = ConstantSeries(sent.extend, {"client/upload_bytes"})
    for row in _rows("client/upload_bytes", [96.0] * 5):
        held([row, MetricRow("client/loss", 0.5, 1, row.step)])
    assert [row.key for row in sent] == ["client/loss"] * 5
    assert held.constants() == {"client/upload_bytes": 96.0}
    assert held.constants() == {}
    held(_rows("client/upload_bytes", [96.0]))  # decided: later rows pass
    assert sent[-1].key == "client/upload_bytes"


def test_a_held_series_that_changes_is_sent_whole() -> None:
    """The first different value sends the held rows at their own steps and times, then every row passes."""
    sent: list[MetricRow] = []
    held = ConstantSeries(sent.extend, {"client/samples"})
    rows = _rows("client/samples", [64.0, 64.0, 64.0, 32.0, 64.0])
    for row in rows:
        held([row])
    assert sent == rows
    assert held.constants() == {}


def test_held_rows_are_bounded() -> None:
    """A key holding max_held rows is sent as a series (its rows in order); NaN counts as a change."""
    sent: list[MetricRow] = []
    held = ConstantSeries(sent.extend, {"a", "b"}, max_held=3)
    held(_rows("a", [1.0] * 5))
    assert sent == _rows("a", [1.0] * 5)
    held(_rows("b", [math.nan, math.nan]))
    assert [row.step for row in sent if row.key == "b"] == [0, 1]
    assert held.constants() == {}


def test_emit_many_sends_each_events_rows_in_one_call_at_one_time() -> None:
    """emit_many gives the rows emit gives for each event in turn, in their order, in one sink call and one clock
    reading; events without numbers add nothing, and a batch without any sends nothing."""
    events = [
        {"step": 3, "loss": 0.5, "client_id": 4, "samples": 64},
        {"step": 4, "note": "x"},
        {"step": 5, "loss": np.float32(0.25), "samples": 32, "extra": 1},
        {"loss": 0.125},
    ]
    one_by_one, together = Sink(), Sink()
    clock = iter(range(7, 100))
    single = MetricsProcessor(one_by_one, clock_ms=lambda: 7)
    for fields in events:
        single.emit("client", fields)
    batched = MetricsProcessor(together, clock_ms=lambda: next(clock))
    batched.emit_many("client", events)
    assert together.calls == [[row for call in one_by_one.calls for row in call]]
    assert [row.key for row in together.calls[0]] == [
        "client/loss", "client/samples", "client/loss", "client/samples", "client/extra", "client/loss"
    ]  # fmt: skip
    assert [row.step for row in together.calls[0]] == [3, 3, 5, 5, 5, 0]
    assert next(clock) == 8  # one reading for the batch
    batched.emit_many("client", [{"step": 1, "note": "x"}])
    batched.emit_many("client", [])
    assert len(together.calls) == 1
