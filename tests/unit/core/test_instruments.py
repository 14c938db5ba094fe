"""Tests of flasync.core.instruments."""

from __future__ import annotations

import logging

import structlog

from flasync.core.instruments import debug_many, logs_debug
from flasync.testing import NullLog
from flasync.tracking import MetricRow, MetricsProcessor, make_logger


def test_logs_debug_follows_a_filtering_loggers_level_and_assumes_yes_otherwise() -> None:
    """A structlog logger filtering at warning drops debug calls; one at debug, or one that cannot tell, keeps them."""
    warning = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    debug = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    assert not logs_debug(warning.bind())
    assert logs_debug(debug.bind())
    assert logs_debug(NullLog())


def test_debug_many_logs_each_event_on_a_logger_without_batches() -> None:
    """A logger with no debug_many of its own (structlog's, a test's) gets one debug call per event, in order."""
    with structlog.testing.capture_logs() as captured:
        debug_many(structlog.get_logger(), "server.update", [{"step": 1, "norm": 0.5}, {"step": 2, "norm": 0.25}])
    assert captured == [
        {"event": "server.update", "step": 1, "norm": 0.5, "log_level": "debug"},
        {"event": "server.update", "step": 2, "norm": 0.25, "log_level": "debug"},
    ]


def test_debug_many_hands_a_tracked_loggers_events_over_as_one_batch() -> None:
    """A tracked run's logger, debug lines dropped, takes the batch in one call of its metrics processor."""
    batches: list[list[MetricRow]] = []
    log = make_logger(level="warning", metrics=MetricsProcessor(batches.append, clock_ms=lambda: 1))
    debug_many(log, "server.update", [{"step": 1, "norm": 0.5}, {"step": 2, "norm": 0.25}])
    assert batches == [[MetricRow("server/update/norm", 0.5, 1, 1), MetricRow("server/update/norm", 0.25, 1, 2)]]


def test_debug_many_of_no_lines_calls_no_logger() -> None:
    """No line is no call: neither one by one nor as a batch, so a tracked logger's processor gets nothing."""
    batches: list[list[MetricRow]] = []
    tracked = make_logger(level="warning", metrics=MetricsProcessor(batches.append, clock_ms=lambda: 1))
    with structlog.testing.capture_logs() as captured:
        debug_many(structlog.get_logger(), "server.update", [])
        debug_many(tracked, "server.update", ())
    assert captured == [] and batches == []
