"""Tests of tracking.logs: the CLI's global configuration and library loggers built from it."""

from __future__ import annotations

import io
import json

import pytest
import structlog
from structlog.typing import EventDict, WrappedLogger

from tracking import LevelFilter, configure_logging, make_logger


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
