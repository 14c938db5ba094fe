"""The simulated failure model: which client tasks crash, hang or drop out, and when clients are online.

Every decision is a pure function of the run's seed, the client id and its participation index (or of the time,
for availability), drawn from :mod:`flasync.core.seeding` streams. So a task's fate does not depend on when, in what
order or by which thread it runs, the server can predict nothing it should not, and a test can recompute every
fate after a run from the :class:`~flasync.core.events.TaskAssigned` events alone.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from flasync.clients.simulated.trace import TraceWindows
from flasync.config import FaultsConfig
from flasync.core import seeding

__all__ = ["Fate", "FaultModel", "TaskFate"]


class Fate(enum.StrEnum):
    """What happens to one client task."""

    OK = "ok"
    """The client trains and uploads (unless its availability window closes first)."""
    CRASH = "crash"
    """Training raises an exception part-way through."""
    HANG = "hang"
    """The client never answers; only the server's task timeout ends the task."""
    DROPOUT = "dropout"
    """The client disconnects part-way through training; the server sees the connection close."""


@dataclass(frozen=True, slots=True)
class TaskFate:
    """A task's fate and, for a crash or dropout, the share of its training time that passes before it."""

    fate: Fate
    fraction: float


class FaultModel:
    """Per-task failure draws and per-client availability windows (periodic, or a device trace's).

    Args:
        config: The rates and the optional periodic availability windows.
        seed: The run's seed.
        num_clients: Population size.
        trace: A device trace's availability windows instead of periodic ones (``population.trace``).
    """

    def __init__(self, config: FaultsConfig, seed: int, num_clients: int, trace: TraceWindows | None = None) -> None:
        """Draw each client's availability phase once."""
        self.config = config
        self.seed = seed
        self.num_clients = num_clients
        self.trace = trace
        byzantine = round(config.byzantine * num_clients)
        self.attackers: frozenset[int] = frozenset()
        """The clients that attack with every update (``faults.byzantine`` of the population)."""
        if byzantine:
            rng = seeding.numpy_stream(seed, seeding.FAULTS, 1)
            self.attackers = frozenset(int(c) for c in rng.choice(num_clients, size=byzantine, replace=False))
        availability = config.availability
        if availability is None:
            self.phase = np.zeros(num_clients)
        else:
            rng = seeding.numpy_stream(seed, seeding.AVAILABILITY)
            self.phase = rng.uniform(0.0, availability.period_s, size=num_clients)

    def attack_factor(self, client_id: int) -> float:
        """Return what ``client_id`` multiplies its update by before sending it (1 for an honest client)."""
        if client_id not in self.attackers:
            return 1.0
        factor = self.config.attack_factor
        return -factor if self.config.attack == "sign_flip" else factor

    @property
    def windows(self) -> bool:
        """Tell whether clients have availability windows (periodic or a trace's)."""
        return self.config.availability is not None or self.trace is not None

    @property
    def active(self) -> bool:
        """Tell whether any fault is configured."""
        cfg = self.config
        return cfg.crash > 0 or cfg.hang > 0 or cfg.dropout > 0 or self.windows

    def fate(self, client_id: int, participation: int) -> TaskFate:
        """Return the fate of ``client_id``'s ``participation``-th task (the same whenever it is asked)."""
        cfg = self.config
        if cfg.crash == 0 and cfg.hang == 0 and cfg.dropout == 0:
            return TaskFate(Fate.OK, 1.0)
        u = seeding.stream_uniform(self.seed, seeding.FAULTS, client_id, participation)
        fraction = seeding.stream_uniform(self.seed, seeding.FAULTS, client_id, participation, 1)
        if u < cfg.crash:
            return TaskFate(Fate.CRASH, fraction)
        if u < cfg.crash + cfg.hang:
            return TaskFate(Fate.HANG, 1.0)
        if u < cfg.crash + cfg.hang + cfg.dropout:
            return TaskFate(Fate.DROPOUT, fraction)
        return TaskFate(Fate.OK, 1.0)

    # ------------------------------------------------------------------------------------------- availability
    def online(self, client_id: int, t: float) -> bool:
        """Tell whether ``client_id`` is online at time ``t``."""
        if self.trace is not None:
            return self.trace.online(client_id, t)
        availability = self.config.availability
        if availability is None or availability.online_fraction >= 1.0:
            return True
        window, position = availability.online_fraction * availability.period_s, self._position(client_id, t)
        # Online while its window has time left at ``t``'s precision: one ending within rounding of ``t`` (which
        # :meth:`offline_at` would give as ``t`` itself) is offline, or a task given it would fail at once, forever.
        return bool(position < window and t + (window - position) > t)

    def online_mask(self, t: float) -> np.ndarray:
        """Return a boolean array: which clients are online at time ``t``."""
        if self.trace is not None:
            return self.trace.online_mask(t)
        availability = self.config.availability
        if availability is None or availability.online_fraction >= 1.0:
            return np.ones(self.num_clients, dtype=bool)
        window = availability.online_fraction * availability.period_s
        position = np.fmod(t + self.phase, availability.period_s)
        online: np.ndarray = (position < window) & (t + (window - position) > t)  # as :meth:`online`
        return online

    def offline_at(self, client_id: int, t: float) -> float:
        """Return when ``client_id``, online at ``t``, next goes offline (``inf`` if it never does)."""
        if self.trace is not None:
            return self.trace.offline_at(client_id, t)
        availability = self.config.availability
        if availability is None or availability.online_fraction >= 1.0:
            return math.inf
        return t + (availability.online_fraction * availability.period_s - self._position(client_id, t))

    def _position(self, client_id: int, t: float) -> float:
        """Return where ``t`` falls in ``client_id``'s availability period (``availability`` set)."""
        availability = self.config.availability
        assert availability is not None
        return math.fmod(t + float(self.phase[client_id]), availability.period_s)

    def next_online(self, t: float) -> float:
        """Return the first time ``>= t`` at which some client is online."""
        if self.trace is not None:
            return self.trace.next_online(t)
        availability = self.config.availability
        if availability is None:
            return t
        period = availability.period_s
        if self.online_mask(t).any():
            return t
        position = np.fmod(t + self.phase, period)
        # A hair past the window's start, so that rounding cannot leave the client just short of it.
        return t + float(np.min(period - position)) + 1e-9 * period
