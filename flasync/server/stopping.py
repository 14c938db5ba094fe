"""When a run ends, and how often it evaluates and checkpoints: the stop rules and the pace of a run."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from flasync.server.accounting import ServerStats

__all__ = ["INTERRUPTED", "StopRules", "eta_seconds"]

INTERRUPTED = "interrupted"
"""The stop reason of a run a stop request ended (:meth:`~flasync.server.Server.request_stop`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StopRules:
    """When the run ends (the first limit reached wins) and how often it evaluates and checkpoints."""

    max_versions: int
    target_accuracy: float | None = None
    max_simulated_s: float | None = None
    max_wall_s: float | None = None
    eval_every: int = 1
    checkpoint_every: int | None = None
    checkpoint_every_s: float | None = None

    def reason(
        self, stats: ServerStats, *, requested: bool, now: Callable[[], float], elapsed_s: Callable[[], float]
    ) -> str:
        """Return why the run must end now, or an empty string while it goes on.

        A stop request wins, then ``max_versions``, ``target_accuracy``, ``max_simulated_s`` and ``max_wall_s``,
        in that order.

        Args:
            stats: The run's counters (versions made, last accuracy).
            requested: Whether a stop was requested.
            now: Reads the run's clock (simulated seconds), only if ``max_simulated_s`` is set.
            elapsed_s: Reads the wall seconds since the run started, only if ``max_wall_s`` is set.
        """
        if requested:
            return INTERRUPTED
        if stats.versions >= self.max_versions:
            return "max_versions"
        if self.target_accuracy is not None and stats.accuracy >= self.target_accuracy:
            return "target_accuracy"
        if self.max_simulated_s is not None and now() >= self.max_simulated_s:
            return "max_simulated_s"
        if self.max_wall_s is not None and elapsed_s() >= self.max_wall_s:
            return "max_wall_s"
        return ""

    def evaluates(self, version: int) -> bool:
        """Tell whether the model of ``version`` is evaluated (every ``eval_every`` versions)."""
        return version % self.eval_every == 0

    def checkpoints(self, version: int, since_s: Callable[[], float] | None = None) -> bool:
        """Tell whether a checkpoint is offered at ``version``: every ``checkpoint_every`` versions, or at the first
        version made ``checkpoint_every_s`` wall seconds or more after the last checkpoint (``since_s`` reads them,
        only if that is set); never at ``max_versions`` (the last version is the run's result, not a point to restart
        from)."""
        if version >= self.max_versions:
            return False
        every = self.checkpoint_every
        if every is not None and version % every == 0:
            return True
        every_s = self.checkpoint_every_s
        return every_s is not None and since_s is not None and since_s() >= every_s


def eta_seconds(rules: StopRules, done: int, version: int, wall_s: float) -> float:
    """Wall seconds left until ``max_versions`` (or ``max_wall_s``, if sooner) at the pace so far: ``done`` versions
    made by this process in ``wall_s`` (NaN before the first); a run may end sooner on its other stop rules."""
    if done <= 0 or wall_s <= 0.0:
        return math.nan
    left = wall_s * max(rules.max_versions - version, 0) / done
    if rules.max_wall_s is not None:
        left = min(left, max(rules.max_wall_s - wall_s, 0.0))
    return left
