"""``flasync.console()``: the command line's lines for a program that embeds flasync."""

from __future__ import annotations

import json

import pytest
import structlog

import flasync


def test_console_prints_the_lines_the_command_line_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """An info line in the console format (event padded, fields after it), and nothing below the level asked for."""
    flasync.console()
    structlog.get_logger("flasync").info("run.phase", phase="loading the data")
    structlog.get_logger("flasync").debug("hidden.detail", value=1)
    err = capsys.readouterr().err
    assert "[info] run.phase" in err and "phase='loading the data'" in err and "hidden.detail" not in err


def test_console_json_writes_one_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    """fmt='json' writes each event as one JSON object; warnings only with level='warning'."""
    flasync.console("warning", fmt="json")
    structlog.get_logger("flasync").info("run.phase", phase="skipped")
    structlog.get_logger("flasync").warning("tracking.spooling", path="/tmp/x")
    lines = capsys.readouterr().err.strip().splitlines()
    assert [json.loads(line)["event"] for line in lines] == ["tracking.spooling"]


def test_console_refuses_an_unknown_format_or_level() -> None:
    """A format or level it does not know is a ValueError naming it."""
    with pytest.raises(ValueError, match="'xml'"):
        flasync.console(fmt="xml")
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        flasync.console("loud")
