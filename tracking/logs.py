"""Configure structlog once for the CLI, and build loggers without touching global state.

Only the command line calls :func:`configure_logging`. Library code calls :func:`make_logger`,
which reads the global configuration (renderer, output) but builds its own processor chain, so
that a processor placed before the level filter (e.g. a
:class:`~tracking.metrics.MetricsProcessor`) sees debug events that the console never shows.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TextIO, cast

import structlog
from structlog.contextvars import merge_contextvars
from structlog.processors import add_log_level
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

from flasync.tracking.metrics import MetricsProcessor
from flasync.tracking.progress import ProgressBar

__all__ = ["ConsoleFields", "LevelFilter", "LibraryLogger", "configure_logging", "make_logger"]

_LEVELS: dict[str, int] = {
    "critical": logging.CRITICAL,
    "fatal": logging.CRITICAL,
    "exception": logging.ERROR,
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "msg": logging.INFO,
    "debug": logging.DEBUG,
    "notset": logging.NOTSET,
}

# Logs everything: flasync's loggers must see debug events to turn them into metrics, so the level
# is applied by a processor (LevelFilter) placed after the metrics processor, never by the wrapper.
_NON_FILTERING: type[FilteringBoundLogger] = structlog.make_filtering_bound_logger(logging.NOTSET)


def _level_number(level: str) -> int:
    try:
        return _LEVELS[level.lower()]
    except KeyError:
        known = ", ".join(sorted(_LEVELS))
        raise ValueError(f"unknown log level {level!r}; expected one of: {known}") from None


class LevelFilter:
    """Drop events below a level; a structlog processor.

    It decides on the log method's name alone (``debug``, ``info``, ...), so an event it drops
    costs one set lookup and one raised :class:`structlog.DropEvent`. Method names it does not
    know (custom ones on a generic bound logger) pass.

    Args:
        level: The lowest level that passes: ``"debug"``, ``"info"``, ``"warning"``,
            ``"error"`` or ``"critical"`` (case-insensitive).

    Raises:
        ValueError: ``level`` is not a level name.
    """

    __slots__ = ("_dropped", "level")

    def __init__(self, level: str = "info") -> None:
        self.level = _level_number(level)
        self._dropped = frozenset(name for name, number in _LEVELS.items() if number < self.level)

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        """Raise :class:`structlog.DropEvent` if ``method_name`` is below the level.

        Args:
            logger: The wrapped logger (unused).
            method_name: The name of the log method that was called, e.g. ``"debug"``.
            event_dict: The event.

        Returns:
            ``event_dict`` unchanged.

        Raises:
            structlog.DropEvent: The event is below the level.
        """
        if method_name in self._dropped:
            raise structlog.DropEvent
        return event_dict

    @property
    def dropped_methods(self) -> frozenset[str]:
        """The log methods' names below the level (the events this filter drops)."""
        return self._dropped

    def __repr__(self) -> str:
        return f"LevelFilter({logging.getLevelName(self.level).lower()!r})"


class LibraryLogger:
    """A logger for library code that prints no debug lines unless the process configured structlog.

    structlog's defaults print every level, debug included, so a library logging through ``structlog.get_logger()``
    would print its debug lines into the console of any application that never configured structlog (one calling
    :func:`flasync.run`). This logger looks at each call whether structlog is configured (the command line's
    :func:`configure_logging`, or the application's own ``structlog.configure``): then it is the configured chain,
    with its levels; else its debug events are dropped and the rest goes through structlog's defaults.

    Args:
        name: Passed to the logger factory (the stdlib logger name, when it is one).
    """

    __slots__ = ("_name", "_unconfigured")

    def __init__(self, name: str) -> None:
        self._name = name
        self._unconfigured: Any = None

    def _current(self) -> Any:
        """Return the logger a call goes to now (see the class)."""
        if structlog.is_configured():
            return structlog.get_logger(self._name)
        if self._unconfigured is None:
            self._unconfigured = structlog.wrap_logger(
                None,
                wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
                logger_factory_args=(self._name,),
            )
        return self._unconfigured

    def __getattr__(self, method: str) -> Any:
        """Return the method of the logger a call goes to now (``debug``, ``info``, ``bind``, ...)."""
        return getattr(self._current(), method)


class _StderrLogger:
    """Write each rendered line to the ``sys.stderr`` of the moment."""

    def msg(self, message: str) -> None:
        stream = sys.stderr
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = err = msg


class _StderrLoggerFactory:
    def __call__(self, *args: Any) -> _StderrLogger:
        return _StderrLogger()


def configure_logging(
    *,
    fmt: Literal["console", "json"] = "console",
    level: str = "info",
    stream: TextIO | None = None,
    progress: ProgressBar | None = None,
) -> None:
    """Configure structlog for the whole process; only the command line calls this.

    The chain is ``merge_contextvars``, ``add_log_level``, ``LevelFilter(level)``,
    ``TimeStamper(fmt="iso")`` and a renderer: a console renderer (colours only when ``stream``
    is a terminal) or one JSON object per line. The wrapper class does not filter by level, so a
    logger from :func:`make_logger` still sees debug events; ``level`` applies to loggers taken
    with ``structlog.get_logger()``, and :func:`make_logger` replaces it with its own.

    Args:
        fmt: ``"console"`` for humans, ``"json"`` for machines.
        level: The lowest level rendered by plain ``structlog.get_logger()`` loggers.
        stream: Where lines go; when None, whatever ``sys.stderr`` is at each write (so a later redirection
            of ``sys.stderr``, as test runners do, is followed).
        progress: Shows the evaluations as a bar instead of lines (console format only; placed after the level
            filter, so a level above ``info`` shows no bar). The caller closes it when the run ends.

    ``level`` also governs the libraries' own logs (MLflow, alembic, urllib3, git, matplotlib): they print their
    warnings and errors at every level except ``error`` and ``critical`` (then only those), and their info lines
    only at ``debug`` (MLflow's "Creating initial MLflow database tables" and the like are not flasync's news). MLflow
    reads its level from ``MLFLOW_LOGGING_LEVEL`` when it is imported, here or in a writer child process, so that
    variable is set too.

    Raises:
        ValueError: ``fmt`` or ``level`` is unknown.
    """
    out = sys.stderr if stream is None else stream
    tail: list[Processor]
    if fmt == "json":
        tail = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    elif fmt == "console":
        tail = [
            *([progress] if progress is not None else []),
            ConsoleFields(),
            structlog.dev.ConsoleRenderer(colors=_is_tty(out), pad_event_to=12, pad_level=False, sort_keys=False),
        ]
    else:
        raise ValueError(f"unknown log format {fmt!r}; expected 'console' or 'json'")
    _set_library_levels(level)
    structlog.configure(
        processors=[
            merge_contextvars,
            add_log_level,
            LevelFilter(level),
            structlog.processors.TimeStamper(fmt="%H:%M:%S" if fmt == "console" else "iso", utc=fmt != "console"),
            *tail,
        ],
        wrapper_class=_NON_FILTERING,
        logger_factory=structlog.WriteLoggerFactory(file=out) if stream is not None else _StderrLoggerFactory(),
        cache_logger_on_first_use=False,
    )


class ConsoleFields:
    """Shorten an event for the console (JSON lines keep every field as logged).

    Floats are rounded to 4 significant digits and NaN fields left out; ``step`` (the metric step, repeated by
    ``version``) is left out, and so is the ``run_id`` every event of a run carries (``run.started``, or
    ``run.opened`` when the run is opened while training starts, shows it once);
    ``version`` and ``of`` become ``version=n/N``, and such a progress line leaves its ``wall_s`` (the seconds since
    the run started) to the line's timestamp, keeping ``eta_s``: lines stay within 120 characters. A structlog
    processor.
    """

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        """Return the shortened event."""
        event_dict.pop("step", None)
        if event_dict.get("event") not in ("run.started", "run.opened"):
            event_dict.pop("run_id", None)
        if "of" in event_dict and "version" in event_dict:
            event_dict["version"] = f"{event_dict['version']}/{event_dict.pop('of')}"
            event_dict.pop("wall_s", None)
        for key, value in list(event_dict.items()):
            if isinstance(value, float):
                if math.isnan(value):
                    del event_dict[key]
                elif math.isfinite(value) and value != 0.0:
                    event_dict[key] = float(f"{value:.4g}")
        return event_dict


_LIBRARIES = ("mlflow", "alembic", "urllib3", "git", "matplotlib")
_MLFLOW_DB_ERRORS = "mlflow.store.db.utils"


def _set_library_levels(level: str) -> None:
    """Apply the CLI's log level to the loggers of the libraries flasync uses (see :func:`configure_logging`)."""
    number = _LEVELS.get(level.lower())
    if number is None:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(_LEVELS)}")
    library = logging.INFO if number <= logging.DEBUG else max(number, logging.WARNING)
    os.environ["MLFLOW_LOGGING_LEVEL"] = logging.getLevelName(library)
    for name in _LIBRARIES:
        logging.getLogger(name).setLevel(library)
    # MLflow's SQL store logs a database error (a full disk, a locked file) with its whole traceback before raising it
    # again; flasync handles what is raised and says it in one line (tracking.spooling): the traceback only at debug.
    logging.getLogger(_MLFLOW_DB_ERRORS).setLevel(library if number <= logging.DEBUG else logging.CRITICAL)


def make_logger(
    *,
    name: str = "flasync",
    level: str = "info",
    processors_before: Sequence[Processor] = (),
    metrics: MetricsProcessor | None = None,
) -> FilteringBoundLogger:
    """Build a logger from the global configuration without changing it.

    The chain is ``merge_contextvars``, ``add_log_level``, ``*processors_before``,
    ``LevelFilter(level)``, then the global chain minus its own ``merge_contextvars``,
    ``add_log_level`` and level filters (timestamper, renderer, ...). The output goes to
    the configured logger factory. With no ``processors_before`` the level is applied by the
    wrapper class instead, so a dropped event costs a no-op method call.

    With ``metrics``, every log call first hands its fields (the logger's bound context and the
    call's keywords, not context variables) to :meth:`MetricsProcessor.emit`; without
    ``processors_before``, an event below ``level`` then ends there, without running the chain.
    That is the cheap way to turn debug events into metrics: a dropped event costs the metrics
    alone (about half of what the chain costs), not structlog's context merge, level filter and
    ``DropEvent``. Such a logger also has ``debug_many(event, many)``: the debug events of a batch (one mapping
    of fields each), logged one by one where debug lines are rendered, and otherwise handed to
    :meth:`MetricsProcessor.emit_many` together.

    Args:
        name: Passed to the configured logger factory (the stdlib logger name, when it is one).
        level: The lowest level that reaches the rest of the chain (the renderer).
        processors_before: Processors that see every event, debug included, before the level
            filter, e.g. ``[MetricsProcessor(tracker.log_metrics)]``.
        metrics: Sees the fields of every event at the call, before the chain (see above).

    Returns:
        A bound logger (``debug``, ``info``, ..., ``bind``, and the ``a``-prefixed async variants).

    Raises:
        ValueError: ``level`` is not a level name.
    """
    config = structlog.get_config()
    rest = [p for p in config["processors"] if not _is_head_processor(p)]
    level_filter = LevelFilter(level)
    processors: list[Processor]
    wrapper: type[FilteringBoundLogger]
    if metrics is not None:
        # processors_before still see every event (the level filter follows them); without any, events below the
        # level end at the call.
        filtered = [level_filter] if processors_before else []
        processors = [merge_contextvars, add_log_level, *processors_before, *filtered, *rest]
        wrapper = _metrics_logger_class(metrics, frozenset() if processors_before else level_filter.dropped_methods)
    elif processors_before:
        processors = [merge_contextvars, add_log_level, _drop_metrics_flag, *processors_before, level_filter, *rest]
        wrapper = _NON_FILTERING
    else:
        # Without metrics an event's ``metrics=False`` flag means nothing: it must not reach the output.
        processors = [merge_contextvars, add_log_level, _drop_metrics_flag, *rest]
        wrapper = structlog.make_filtering_bound_logger(level_filter.level)
    # bind() resolves wrap_logger's lazy proxy now, so log calls never re-read the configuration.
    logger: FilteringBoundLogger = structlog.wrap_logger(
        config["logger_factory"](name),
        processors=processors,
        wrapper_class=wrapper,
        context_class=config["context_class"],
    ).bind()
    return logger


def _metrics_logger_class(metrics: MetricsProcessor, dropped: frozenset[str]) -> type[FilteringBoundLogger]:
    """Return a bound-logger class that emits each call's metrics, then ends the calls named in ``dropped``."""
    proxy = structlog.BoundLoggerBase._proxy_to_logger

    def _proxy_to_logger(self: Any, method_name: str, event: str | None = None, **event_kw: Any) -> Any:
        # Every log method of the non-filtering class (sync, async, exception, log) ends here.
        if event_kw.pop("metrics", True) is not False:
            context = self._context
            metrics.emit(event, {**context, **event_kw} if context else event_kw)
        if method_name in dropped:
            return None
        return proxy(self, method_name, event, **event_kw)

    chains_debug = "debug" not in dropped

    def debug_many(self: Any, event: str, many: Sequence[Mapping[str, Any]]) -> None:
        # Debug events that are metrics alone (their lines are dropped) go to the processor as one batch.
        if chains_debug:
            for fields in many:
                self.debug(event, **fields)
            return
        context = self._context
        metrics.emit_many(event, [{**context, **fields} for fields in many] if context else many)

    # Built with type(): the base is only known as a value (structlog makes one class per level).
    cls = type(
        "MetricsBoundLogger", (_NON_FILTERING,), {"_proxy_to_logger": _proxy_to_logger, "debug_many": debug_many}
    )
    return cast("type[FilteringBoundLogger]", cls)


def _drop_metrics_flag(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """Remove the ``metrics`` flag (a tracked run's metrics processor reads it; untracked, nothing does)."""
    event_dict.pop("metrics", None)
    return event_dict


def _is_head_processor(processor: Processor) -> bool:
    return (
        processor is merge_contextvars
        or processor is add_log_level
        or processor is _drop_metrics_flag
        or isinstance(processor, LevelFilter)
    )


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
