"""Tests of tracking.logs: the CLI's global configuration and library loggers built from it."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import pytest
import structlog
from structlog.typing import EventDict, FilteringBoundLogger, WrappedLogger

from flasync.tracking import LevelFilter, MetricRow, MetricsProcessor, configure_logging, make_logger
from flasync.tracking.logs import LibraryLogger


class Recorder:
    """A processor that records the events it sees."""

    def __init__(self) -> None:
        self.events: list[EventDict] = []

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        self.events.append(dict(event_dict))
        return event_dict


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_debug_events_reach_processors_before_but_not_the_renderer() -> None:
    """At level info, a debug event is seen by processors_before and never rendered."""
    stream = io.StringIO()
    configure_logging(fmt="json", stream=stream)
    recorder = Recorder()
    log = make_logger(level="info", processors_before=[recorder])
    log.debug("client.trained", train_s=0.5)
    log.info("server.started")
    assert [e["event"] for e in recorder.events] == ["client.trained", "server.started"]
    assert recorder.events[0]["level"] == "debug"
    assert [json.loads(line)["event"] for line in lines(stream)] == ["server.started"]


def test_make_logger_without_processors_filters_by_level() -> None:
    """A logger with no processors_before renders only events at or above its level."""
    stream = io.StringIO()
    configure_logging(fmt="json", stream=stream)
    log = make_logger(level="warning")
    log.info("quiet")
    log.warning("loud")
    assert [json.loads(line)["event"] for line in lines(stream)] == ["loud"]


def test_the_metrics_flag_is_never_rendered_without_metrics() -> None:
    """An untracked run's logger (no metrics processor) drops the metrics=False flag before rendering."""
    stream = io.StringIO()
    configure_logging(fmt="json", stream=stream)
    for log in (make_logger(level="info"), make_logger(level="info", processors_before=[Recorder()])):
        log.info("run.started", clients=100, metrics=False)
    records = [json.loads(line) for line in lines(stream)]
    assert len(records) == 2 and all("metrics" not in r and r["clients"] == 100 for r in records)


def test_make_logger_level_overrides_the_configured_level() -> None:
    """make_logger's level replaces the level given to configure_logging."""
    stream = io.StringIO()
    configure_logging(fmt="json", level="error", stream=stream)
    make_logger(level="debug", processors_before=[Recorder()]).debug("shown")
    assert [json.loads(line)["event"] for line in lines(stream)] == ["shown"]


def test_make_logger_leaves_the_global_configuration_alone() -> None:
    """Building a logger does not change structlog's global configuration."""
    configure_logging(fmt="json", stream=io.StringIO())
    before = structlog.get_config()
    make_logger(level="debug", processors_before=[Recorder()])
    assert structlog.get_config() == before


def test_context_variables_reach_processors_before() -> None:
    """Values bound with bind_contextvars are merged before processors_before run."""
    recorder = Recorder()
    log = make_logger(processors_before=[recorder])
    with structlog.contextvars.bound_contextvars(step=4):
        log.debug("e")
    assert recorder.events[0]["step"] == 4


def test_json_output_is_one_object_per_line() -> None:
    """configure_logging(fmt="json") writes one JSON object per line with level and timestamp."""
    stream = io.StringIO()
    configure_logging(fmt="json", stream=stream)
    log = structlog.get_logger()
    log.info("first", n=1)
    log.warning("second", text="two\nlines")
    records = [json.loads(line) for line in lines(stream)]
    assert [r["event"] for r in records] == ["first", "second"]
    assert [r["level"] for r in records] == ["info", "warning"]
    assert all("T" in r["timestamp"] for r in records)


def test_configured_level_filters_plain_loggers() -> None:
    """structlog.get_logger() loggers are filtered at the configured level."""
    stream = io.StringIO()
    configure_logging(fmt="json", level="warning", stream=stream)
    structlog.get_logger().info("hidden")
    assert lines(stream) == []


def test_console_output_has_no_colours_off_a_terminal() -> None:
    """The console renderer writes no ANSI escapes to a stream that is not a terminal."""
    stream = io.StringIO()
    configure_logging(fmt="console", stream=stream)
    structlog.get_logger().info("hello", n=1)
    text = stream.getvalue()
    assert "hello" in text
    assert "\x1b[" not in text


def test_level_filter_drops_only_lower_levels() -> None:
    """LevelFilter raises DropEvent below its level and passes the rest."""
    level_filter = LevelFilter("info")
    with pytest.raises(structlog.DropEvent):
        level_filter(None, "debug", {})
    assert level_filter(None, "info", {"a": 1}) == {"a": 1}
    assert level_filter(None, "exception", {}) == {}


def test_unknown_level_is_refused() -> None:
    """An unknown level name raises ValueError naming it."""
    with pytest.raises(ValueError, match="verbose"):
        make_logger(level="verbose")


class Rows:
    """A metrics sink that keeps every row."""

    def __init__(self) -> None:
        self.rows: list[MetricRow] = []
        self.calls = 0

    def __call__(self, rows: list[MetricRow]) -> None:
        self.rows.extend(rows)
        self.calls += 1

    def values(self) -> dict[str, tuple[float, int]]:
        return {row.key: (row.value, row.step) for row in self.rows}


def metrics_logger(level: str, stream: io.StringIO, **kwargs: Any) -> tuple[FilteringBoundLogger, Rows]:
    configure_logging(fmt="json", stream=stream)
    rows = Rows()
    return make_logger(level=level, metrics=MetricsProcessor(rows, clock_ms=lambda: 7), **kwargs), rows


def test_metrics_logger_takes_metrics_of_dropped_and_rendered_events() -> None:
    """With metrics=, a debug event below the level gives its metrics and is not rendered; an info event gives both."""
    stream = io.StringIO()
    log, rows = metrics_logger("info", stream)
    log.debug("client", step=2, loss=0.5, client_id=9)
    log.info("server.version", step=3, accuracy=0.9)
    assert rows.values() == {"client/loss": (0.5, 2), "server/version/accuracy": (0.9, 3)}
    records = [json.loads(line) for line in lines(stream)]
    assert [r["event"] for r in records] == ["server.version"]
    assert records[0]["accuracy"] == 0.9 and records[0]["level"] == "info"


def test_metrics_logger_honours_metrics_false_and_never_renders_the_flag() -> None:
    """metrics=False keeps an event out of the metrics; the flag itself is never rendered."""
    stream = io.StringIO()
    log, rows = metrics_logger("info", stream)
    log.info("run.started", clients=100, metrics=False)
    log.warning("run.slow", lag_s=2.0)
    assert rows.values() == {"run/slow/lag_s": (2.0, 0)}
    records = [json.loads(line) for line in lines(stream)]
    assert [r["event"] for r in records] == ["run.started", "run.slow"]
    assert records[0]["clients"] == 100
    assert all("metrics" not in r for r in records)


def test_metrics_logger_reads_the_bound_context_but_not_context_variables() -> None:
    """Fields bound with bind() are metrics (the call's keywords win); context variables are not."""
    log, rows = metrics_logger("info", io.StringIO())
    with structlog.contextvars.bound_contextvars(temperature=3.0):
        log.bind(lr=0.1, loss=9.0).debug("e", step=1, loss=2.0)
    assert rows.values() == {"e/lr": (0.1, 1), "e/loss": (2.0, 1)}


def test_metrics_logger_async_and_exception_methods_give_metrics() -> None:
    """The async variants and exception() go through the same call path."""
    stream = io.StringIO()
    log, rows = metrics_logger("warning", stream)

    async def main() -> None:
        await log.adebug("a", x=1.0)

    asyncio.run(main())
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", attempts=3)
    assert rows.values() == {"a/x": (1.0, 0), "failed/attempts": (3.0, 0)}
    assert [json.loads(line)["event"] for line in lines(stream)] == ["failed"]


def test_metrics_logger_with_processors_before_still_shows_them_every_event() -> None:
    """processors_before keep seeing debug events when metrics= is given too."""
    stream = io.StringIO()
    recorder = Recorder()
    log, rows = metrics_logger("info", stream, processors_before=[recorder])
    log.debug("quiet", x=1.0)
    assert [e["event"] for e in recorder.events] == ["quiet"]
    assert "metrics" not in recorder.events[0]
    assert rows.values() == {"quiet/x": (1.0, 0)}
    assert lines(stream) == []


def test_console_lines_are_short() -> None:
    """The console drops the metric step and the run id (shown once, at run.started), rounds floats to 4 digits,
    leaves NaN out and shows progress as n/N without wall_s; the event itself is not otherwise changed."""
    from flasync.tracking.logs import ConsoleFields

    shorten = ConsoleFields()
    event = {"event": "server.eval", "step": 5, "run_id": "abc", "version": 5, "of": 150, "accuracy": 0.123456789}
    assert shorten(None, "info", dict(event, eta_s=float("nan"))) == {
        "event": "server.eval",
        "version": "5/150",
        "accuracy": 0.1235,
    }
    assert shorten(None, "info", {"event": "run.started", "run_id": "abc", "params": 4810}) == {
        "event": "run.started",
        "run_id": "abc",
        "params": 4810,
    }
    # A progress line leaves the seconds since the start to its timestamp; other lines keep their wall_s.
    progress = shorten(None, "info", dict(event, wall_s=1.25, eta_s=2.5))
    assert progress == {"event": "server.eval", "version": "5/150", "accuracy": 0.1235, "eta_s": 2.5}
    assert shorten(None, "info", {"event": "run.finished", "wall_s": 1.25}) == {"event": "run.finished", "wall_s": 1.25}


def test_debug_many_batches_dropped_debug_events_as_their_metrics() -> None:
    """debug_many gives the rows of one debug call per event; where debug lines are dropped they reach the
    processor as one batch (one sink call) with the bound context, and nothing is rendered."""
    stream = io.StringIO()
    log, rows = metrics_logger("info", stream)
    bound = log.bind(tier=2)
    bound.debug_many("client", [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25, "note": "x"}])  # type: ignore[attr-defined]
    assert rows.rows == [
        MetricRow("client/tier", 2.0, 7, 1),
        MetricRow("client/loss", 0.5, 7, 1),
        MetricRow("client/tier", 2.0, 7, 2),
        MetricRow("client/loss", 0.25, 7, 2),
    ]
    assert rows.calls == 1
    assert lines(stream) == []


def test_debug_many_renders_each_event_where_debug_lines_are_shown() -> None:
    """At level debug (or with processors_before, which see every event) each event is logged on its own."""
    stream = io.StringIO()
    log, rows = metrics_logger("debug", stream)
    log.debug_many("client", [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}])  # type: ignore[attr-defined]
    records = [json.loads(line) for line in lines(stream)]
    assert [(r["event"], r["step"], r["loss"]) for r in records] == [("client", 1, 0.5), ("client", 2, 0.25)]
    assert rows.values() == {"client/loss": (0.25, 2)} and rows.calls == 2
    recorder = Recorder()
    log, rows = metrics_logger("info", io.StringIO(), processors_before=[recorder])
    log.debug_many("client", [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}])  # type: ignore[attr-defined]
    assert [e["step"] for e in recorder.events] == [1, 2]
    assert rows.calls == 2


def test_mlflow_database_error_tracebacks_are_shown_only_at_debug() -> None:
    """MLflow's SQL store logs a database error with its traceback before raising it (flasync says it in one line):
    that logger is quiet except at debug."""
    import logging

    configure_logging(level="info")
    assert not logging.getLogger("mlflow.store.db.utils").isEnabledFor(logging.ERROR)
    configure_logging(level="debug")
    assert logging.getLogger("mlflow.store.db.utils").isEnabledFor(logging.ERROR)


def test_a_library_logger_drops_debug_lines_while_structlog_is_not_configured(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without any structlog configuration a library logger prints info but no debug line; configured, the
    configuration's level decides."""
    structlog.reset_defaults()  # the state of a process that never configured structlog
    log = LibraryLogger("flasync.test")
    log.debug("library.detail", a=1)
    log.info("library.news", b=2)
    out = capsys.readouterr().out
    assert "library.news" in out and "library.detail" not in out
    stream = io.StringIO()
    configure_logging(level="debug", stream=stream)
    log.debug("library.detail", a=1)
    assert "library.detail" in stream.getvalue()
