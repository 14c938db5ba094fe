"""Instruments: optional hooks into a run, in trio's shape.

An :class:`Instrument` is an object whose hooks the run calls as things happen; every hook is a no-op here, so a
subclass overrides only what it needs. Hooks run on the event loop, synchronously, and must be quick and must not
block (no I/O): hand slow work to a thread or keep it for the end of the run. A hook that raises is removed from
the bus and the error is logged; the run goes on.

Attach one to a run's bus with :meth:`flasync.core.bus.EventBus.add_instrument` (the runtime attaches its profiler and
alert monitor this way), or to any bus in a test.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Instrument", "debug_many", "logs_debug"]


class Instrument:
    """Optional hooks into a run; override the ones you need.

    Attributes:
        takes_batches: Whether :meth:`event_published` understands batch events (``flasync.core.events.BATCH_EVENTS``,
            whose ``members`` are the events each stands for). While an instrument that does not is attached,
            publishers send every event of its own.
    """

    takes_batches: bool = False

    def event_published(self, event: object) -> None:
        """Called once for every event published on the bus, after it was delivered to the subscribers."""

    def bus_closed(self) -> None:
        """Called once when the bus closes (the run is over; no more events will come)."""


def logs_debug(log: object) -> bool:
    """Tell whether ``log``'s debug calls reach anything: a structlog filtering logger set above debug (an untracked
    run's) drops them at the call, so a hot path can skip building their fields. A logger that cannot tell is taken
    to log them (a tracked run's does: its debug events are metrics)."""
    enabled = getattr(log, "is_enabled_for", None)
    return True if enabled is None else bool(enabled(logging.DEBUG))


def debug_many(log: Any, event: str, many: Sequence[Mapping[str, Any]]) -> None:
    """Log one debug event ``event`` per mapping of fields in ``many``, as ``log.debug(event, **fields)`` each.

    A tracked run's logger (``tracking.make_logger(metrics=...)``) whose debug lines are dropped takes them as one
    batch of metrics (its ``debug_many``): the same rows, in the same order, for a batch of updates at the cost of
    one call. Any other logger gets the calls one by one. The lines carry no ``metrics`` flag: each is a metric event.
    """
    if not many:  # no line: no call (a batch of none sends no metric either)
        return
    batch = getattr(type(log), "debug_many", None)  # on the class: structlog's generic loggers proxy any attribute
    if batch is not None:
        batch(log, event, many)
        return
    for fields in many:
        log.debug(event, **fields)
