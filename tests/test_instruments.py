"""Tests of flasync.instruments."""

from __future__ import annotations

import logging

import structlog

from flasync.instruments import logs_debug
from flasync.testing import NullLog


def test_logs_debug_follows_a_filtering_loggers_level_and_assumes_yes_otherwise() -> None:
    """A structlog logger filtering at warning drops debug calls; one at debug, or one that cannot tell, keeps them."""
    warning = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    debug = structlog.wrap_logger(None, wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    assert not logs_debug(warning.bind())
    assert logs_debug(debug.bind())
    assert logs_debug(NullLog())
