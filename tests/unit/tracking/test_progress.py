"""The console's progress bar: evaluations on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io
import sys

import pytest
import structlog
from rich.console import Console

from flasync.cli import run as cli_run
from flasync.tracking.logs import configure_logging
from flasync.tracking.progress import ProgressBar, format_eta


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100, color_system=None), out


def _eval(version: int, of: int | None = 150, accuracy: float = 0.5, eta_s: float = 12.3) -> dict[str, object]:
    event: dict[str, object] = {"event": "server.eval", "version": version, "accuracy": accuracy, "eta_s": eta_s}
    if of is not None:
        event["of"] = of
    return event


def test_bar_shows_version_accuracy_and_eta() -> None:
    """An evaluation is drawn as version n/N, the accuracy and the time left, and taken off the console."""
    console, out = _terminal()
    bar = ProgressBar(console, redirect_stderr=False)
    for version, accuracy, eta in ((0, 0.1, float("nan")), (75, 0.8512, 12.3)):
        with pytest.raises(structlog.DropEvent):
            bar(None, "info", _eval(version, accuracy=accuracy, eta_s=eta))
    assert bar.active
    bar.close()
    text = out.getvalue()
    assert "75/150" in text and "accuracy 0.8512" in text and "ETA 12 s" in text
    assert not bar.active


def test_lines_print_above_the_bar_and_other_events_pass() -> None:
    """While the bar is shown, lines written to stdout appear (above it); other events and evaluations without a
    known number of versions pass to the console."""
    console, out = _terminal()
    with ProgressBar(console, redirect_stderr=False) as bar:
        with pytest.raises(structlog.DropEvent):
            bar(None, "info", _eval(3))
        print("a warning line")
        phase = {"event": "run.phase", "phase": "logging the artifacts"}
        assert bar(None, "info", phase) is phase
        open_ended = _eval(4, of=None)
        assert bar(None, "info", open_ended) is open_ended
    assert "a warning line" in out.getvalue()
    after = _eval(5)
    assert bar(None, "info", after) is after  # closed: evaluations are lines again


def test_eta_format() -> None:
    """The time left reads as seconds below a minute, then m:ss or h:mm:ss."""
    assert [format_eta(s) for s in (0.84, 42.0, 185.0, 3723.0, None, float("inf"))] == [
        "0.8 s",
        "42 s",
        "3:05",
        "1:02:03",
        "?",
        "?",
    ]


def test_console_without_terminal_keeps_plain_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """With standard output not a terminal the CLI makes no bar, and an evaluation is one plain line."""
    assert cli_run._progress_bar("console") is None
    stream = io.StringIO()
    configure_logging(stream=stream)
    structlog.get_logger().info("server.eval", version=5, of=150, accuracy=0.5, eta_s=1.5)
    line = stream.getvalue()
    assert "server.eval" in line and "version=5/150" in line and "eta_s=1.5" in line


def test_bar_honours_the_log_level() -> None:
    """With --log-level warning the evaluations (info) never reach the bar."""
    console, _ = _terminal()
    bar = ProgressBar(console, redirect_stderr=False)
    configure_logging(stream=io.StringIO(), level="warning", progress=bar)
    structlog.get_logger().info("server.eval", version=5, of=150, accuracy=0.5, eta_s=1.5)
    assert not bar.active
    bar.close()


@pytest.mark.slow
def test_rich_is_imported_only_for_a_bar() -> None:
    """The progress module loads rich's progress bar (and live display) only when a bar is drawn."""
    import subprocess

    code = "import flasync.tracking.logs, sys; print(any(m in sys.modules for m in ('rich.progress', 'rich.live')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
