"""A progress bar for the console: the run's evaluations drawn as one line that updates in place.

:class:`ProgressBar` is a structlog processor for the console chain (see
:func:`flasync.tracking.logs.configure_logging`,
which adds it when standard output is a terminal): it takes the ``server.eval`` events (``version`` of ``of``,
``accuracy``, ``eta_s``) off the console and shows them as a `rich <https://rich.readthedocs.io>`_ progress bar,
``version n/N``, the latest accuracy and the estimated time left. While the bar is shown, every other line written
to standard output or standard error (warnings, phases, debug events) is printed above it. Rich's progress bar is
imported when the first evaluation arrives, so a command that never trains, or whose output is not a terminal, never
loads it.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import structlog
from structlog.typing import EventDict, WrappedLogger

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

__all__ = ["ProgressBar", "format_eta"]

EVENT = "server.eval"
"""The event the bar shows (the server's evaluation of a model version)."""


def format_eta(seconds: float | None) -> str:
    """Return ``seconds`` left as the bar shows them: ``0.8 s``, ``42 s``, ``3:05``, ``1:02:03``; ``?`` unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    if seconds < 59.5:
        return f"{round(seconds)} s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class ProgressBar:
    """Show ``server.eval`` events as a progress bar instead of console lines; a structlog processor.

    Place it before :class:`~tracking.logs.ConsoleFields` (it reads the raw ``version`` and ``of``). Events it
    shows are dropped from the console (``structlog.DropEvent``); an evaluation without ``of`` (no known number of
    versions) passes as a line. Call :meth:`close` when the run ends, however it ends: the bar is left as last
    drawn, and output goes straight to the terminal again.

    Args:
        console: The rich console to draw on; standard output's when None (made at the first evaluation).
        redirect_stderr: Also print standard error's lines above the bar (when it is the same terminal).
    """

    def __init__(self, console: Console | None = None, *, redirect_stderr: bool = True) -> None:
        self._console = console
        self._redirect_stderr = redirect_stderr
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._closed = False

    @property
    def active(self) -> bool:
        """Tell whether the bar is being shown."""
        return self._progress is not None

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        """Draw an evaluation on the bar and drop it; pass every other event.

        Raises:
            structlog.DropEvent: The event was drawn on the bar.
        """
        if event_dict.get("event") != EVENT or self._closed or "of" not in event_dict:
            return event_dict
        try:
            version, total = int(event_dict["version"]), int(event_dict["of"])
        except (KeyError, TypeError, ValueError):
            return event_dict
        accuracy = event_dict.get("accuracy")
        shown = f"{accuracy:.4f}" if isinstance(accuracy, float) and math.isfinite(accuracy) else "-"
        self._update(version, total, shown, format_eta(event_dict.get("eta_s")))
        raise structlog.DropEvent

    def _update(self, version: int, total: int, accuracy: str, eta: str) -> None:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            console = self._console or Console(file=sys.stdout)
            self._progress = Progress(
                TextColumn("version"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("accuracy {task.fields[accuracy]}"),
                TextColumn("ETA {task.fields[eta]}"),
                console=console,
                auto_refresh=False,  # redrawn at each evaluation and each line printed above it: no thread
                redirect_stdout=True,
                redirect_stderr=self._redirect_stderr,
            )
            self._progress.start()
            self._task = self._progress.add_task("run", total=total, accuracy=accuracy, eta=eta)
        assert self._task is not None
        self._progress.update(self._task, completed=version, total=total, accuracy=accuracy, eta=eta)
        self._progress.refresh()

    def close(self) -> None:
        """Stop drawing: the bar stays as last drawn and later output goes straight to the terminal; idempotent."""
        self._closed = True
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.stop()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
