"""Client sampling: who trains next, drawn from the server's own random stream.

The sampler draws idle clients for free slots (async slots: each draw excluding the clients drawn before it, as
successive single draws would) or a cohort at once (sync rounds) by the population's strategy (uniform, weighted by
samples, least recently used, available now), and only online clients when the fault model has availability windows,
or (remote devices) when the transport says who is connected.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any, Protocol, cast

import numpy as np

from flasync.config import SamplingStrategy
from flasync.core.events import ClientId

__all__ = ["Availability", "ClientSampler", "Roster"]


class Availability(Protocol):
    """Which clients can take a task now: simulated availability windows, or remote devices connected now."""

    def online(self, client_id: int, t: float) -> bool:
        """Tell whether ``client_id`` is online at time ``t``."""
        ...

    def online_mask(self, t: float) -> np.ndarray:
        """Return a boolean array over the population: who is online at time ``t``."""
        ...

    def next_online(self, t: float) -> float:
        """Return when to look again for an online client (``t`` if one is online now)."""
        ...


class Roster(Protocol):
    """The clients the server draws from, by id: a simulated population or the devices a deployment knows."""

    def __len__(self) -> int:
        """Return how many clients there are."""
        ...

    def sample(
        self,
        k: int,
        rng: np.random.Generator,
        *,
        strategy: SamplingStrategy = "uniform",
        now: float = 0.0,
        exclude: Collection[int] = (),
    ) -> np.ndarray:
        """Draw ``k`` distinct client ids by ``strategy`` at time ``now``, none of them in ``exclude``."""
        ...

    def sample_idle_many(
        self, busy: Collection[int], now: float, k: int, rng: np.random.Generator, *, strategy: SamplingStrategy
    ) -> list[int]:
        """Draw the clients ``k`` successive ``sample(1, ..., exclude=busy)`` calls would, each excluding the clients
        drawn before it, consuming ``rng`` as they would."""
        ...

    def least_recent_idle(self, busy: Collection[int]) -> int | None:
        """Return the client a least-recently-used draw of one excluding ``busy`` takes where that is quick to find
        (None: draw it with :meth:`sample_idle_many`)."""
        ...


class ClientSampler:
    """Draw clients for tasks.

    Args:
        population: The clients.
        strategy: How to draw (``uniform``, ``weighted``, ``lru`` or ``available``).
        rng: The server's random stream (its state is part of a checkpoint).
        availability: Who is online (simulated availability windows, or the remote devices connected now); None:
            every client always is.
    """

    def __init__(
        self,
        population: Roster,
        strategy: SamplingStrategy,
        rng: np.random.Generator,
        availability: Availability | None = None,
    ) -> None:
        """Bind the population and the random stream."""
        self.population = population
        self.strategy = strategy
        self.rng = rng
        self.faults = availability
        self.quick_one: Callable[[Collection[int]], int | None] | None = (
            population.least_recent_idle if strategy == "lru" else None
        )
        """Where the strategy has one, a quicker way to what ``sample_idle_many(busy, now, 1)`` draws: the client,
        or None where it has no answer at once (draw the general way then). A least-recently-used draw of one reads
        no clock and no random stream (:meth:`Roster.least_recent_idle`)."""

    @property
    def checkpointable(self) -> bool:
        """Tell whether :meth:`state_dict` holds everything the sampler needs (the LRU queue is not kept)."""
        return self.strategy != "lru"

    def sample_idle(self, busy: Collection[int], now: float) -> ClientId | None:
        """Return one client not in ``busy`` (None if no idle client is online now)."""
        population, rng = self.population, self.rng
        if self.strategy != "uniform":
            drawn = population.sample(1, rng, strategy=self.strategy, now=now, exclude=busy)
            return ClientId(int(drawn[0]))
        num_clients = len(population)
        faults = self.faults
        if faults is None:
            while True:
                candidate = ClientId(int(rng.integers(num_clients)))
                if candidate not in busy:
                    return candidate
        idle, ids = _idle(faults.online_mask(now), busy)
        hit = _first_draw_in(idle, len(ids), 8 * num_clients, rng)
        if hit is not None:
            return ClientId(hit)
        if not len(ids):
            return None
        return ClientId(int(ids[int(rng.integers(len(ids)))]))

    def sample_idle_many(self, busy: Collection[int], now: float, k: int) -> list[ClientId]:
        """Return the clients ``k`` successive :meth:`sample_idle` calls would, each with the clients drawn before it
        added to ``busy``, leaving the random stream where they would.

        Fewer than ``k`` where a draw finds no idle client online: that draw's random draws are made, no later one.
        """
        rng = self.rng
        if self.strategy != "uniform":
            drawn = self.population.sample_idle_many(busy, now, k, rng, strategy=self.strategy)
            return cast(list[ClientId], drawn)  # the ints, typed as the client ids they are
        if k <= 1:
            one = self.sample_idle(busy, now) if k == 1 else None
            return [] if one is None else [one]
        num_clients = len(self.population)
        faults = self.faults
        if faults is None:
            allowed = np.ones(num_clients, dtype=bool)
            allowed[np.fromiter(busy, dtype=np.intp, count=len(busy))] = False
            count = num_clients - len(busy)
            if count < k:
                raise ValueError(f"cannot draw {k} idle clients: {count} of the {num_clients} are idle")
            return [ClientId(c) for c in _successive_draws(allowed, count, k, None, rng)]
        idle, ids = _idle(faults.online_mask(now), busy)
        return [ClientId(c) for c in _successive_draws(idle, len(ids), k, 8 * num_clients, rng)]

    def next_online(self, now: float) -> float:
        """Return when the next client comes online (now, without availability windows)."""
        return now if self.faults is None else self.faults.next_online(now)

    def online_count(self, now: float) -> int:
        """Count the clients online now (the whole population without availability)."""
        return len(self.population) if self.faults is None else int(self.faults.online_mask(now).sum())

    def cohort(self, size: int, now: float) -> np.ndarray | None:
        """Draw ``size`` distinct clients (fewer if fewer are online; None if none is online now)."""
        if self.faults is None:
            return self.draw(size, now)
        online = np.flatnonzero(self.faults.online_mask(now))
        if not len(online):
            return None
        return self.rng.choice(online, size=min(size, len(online)), replace=False)

    def draw(self, size: int, now: float) -> np.ndarray:
        """Draw ``size`` distinct clients by the strategy, ignoring availability."""
        if self.strategy == "uniform":
            return self.rng.choice(len(self.population), size=size, replace=False)
        return self.population.sample(size, self.rng, strategy=self.strategy, now=now)

    def state_dict(self) -> dict[str, Any]:
        """Return the random stream's state."""
        return {"rng": json.dumps(self.rng.bit_generator.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.rng.bit_generator.state = json.loads(state["rng"])


def _idle(online: np.ndarray, busy: Collection[int]) -> tuple[np.ndarray, np.ndarray]:
    """Return the mask of the clients ``online`` and not ``busy`` (a new array) and their ids, in order.

    The work follows the smaller side: where fewer clients are online than busy (remote devices, most of them
    training), the online ones are looked up in ``busy``; else the busy ones are cleared from the mask.
    """
    online_ids = np.flatnonzero(online)
    if len(online_ids) <= len(busy):
        ids = np.fromiter((c for c in online_ids.tolist() if c not in busy), dtype=np.intp)
        idle = np.zeros(len(online), dtype=bool)
        idle[ids] = True
        return idle, ids
    idle = online.copy()
    idle[np.fromiter(busy, dtype=np.intp, count=len(busy))] = False
    return idle, np.flatnonzero(idle)


def _first_draw_in(allowed: np.ndarray, count: int, draws: int, rng: np.random.Generator) -> int | None:
    """Draw uniform ids below ``len(allowed)`` one at a time, up to ``draws`` of them, until one is ``allowed``.

    Returns that id (None if none of the ``draws`` was), leaving ``rng`` where drawing them one by one would: the
    draws are made in blocks (``rng.integers(n, size=m)`` yields the values of ``m`` single draws), and the block
    holding the hit is drawn again from its start, only up to the hit. ``count`` is how many ids are ``allowed``.
    """
    num_clients = len(allowed)
    if not count:  # no draw can hit: the generator moves on by ``draws`` single draws
        while draws > 0:
            rng.integers(num_clients, size=min(draws, 1 << 16))
            draws -= 1 << 16
        return None
    block = max(16, 2 * num_clients // count)  # about two hits a block
    while draws > 0:
        size = min(block, draws)
        state = rng.bit_generator.state
        candidates = rng.integers(num_clients, size=size)
        hits = np.flatnonzero(allowed[candidates])
        if len(hits):
            rng.bit_generator.state = state
            rng.integers(num_clients, size=int(hits[0]) + 1)
            return int(candidates[hits[0]])
        draws -= size
    return None


def _successive_draws(
    allowed: np.ndarray, count: int, k: int, budget: int | None, rng: np.random.Generator
) -> list[int]:
    """Make up to ``k`` successive single draws of an ``allowed`` client, each then no longer allowed.

    A single draw draws uniform ids below ``len(allowed)`` one at a time until one is allowed, at most ``budget``
    of them (None: no limit); if none of them is, it takes one of the allowed ids (in ascending order) by one more
    draw, or, with none allowed, fails: the draws stop there. The ids are drawn in blocks (``rng.integers(n,
    size=m)`` yields the values of ``m`` single draws) and the block holding the last one needed is drawn again from
    its start, only up to it, so that ``rng`` ends where the single draws leave it. ``allowed`` (``count`` of its ids
    true) is cleared at every id drawn.

    Returns:
        The ids drawn, in order.
    """
    num_clients, spent = len(allowed), 0  # spent: draws made by the single draw in progress
    drawn: list[int] = []
    while len(drawn) < k:
        if not count:
            if budget is None:
                raise ValueError("no client is left to draw")
            _first_draw_in(allowed, 0, budget - spent, rng)  # moves on as the failing single draw does
            return drawn
        want = k - len(drawn)
        size = max(16, (2 * num_clients * want) // count)
        if budget is not None:
            size = min(size, budget * want)
        state = rng.bit_generator.state
        candidates = rng.integers(num_clients, size=size)
        positions = np.flatnonzero(allowed[candidates])
        if len(positions):  # the first draw of each id: a later one finds it drawn
            _, first = np.unique(candidates[positions], return_index=True)
            positions = positions[np.sort(first)][:want]
        used, hits, failed_at = _spans(positions, size, spent, budget, want)
        if failed_at is None and len(hits) < want:  # the whole block was needed
            for position in hits:
                client = int(candidates[position])
                drawn.append(client)
                allowed[client] = False
            count -= len(hits)
            spent = used
            continue
        rng.bit_generator.state = state
        end = failed_at if failed_at is not None else int(hits[-1]) + 1
        rng.integers(num_clients, size=end)
        for position in hits:
            client = int(candidates[position])
            drawn.append(client)
            allowed[client] = False
        count -= len(hits)
        spent = 0
        if failed_at is not None and not count:  # that single draw found no client idle: the draws end
            return drawn
        if failed_at is not None:  # that single draw found none of its ``budget`` draws allowed: one of them
            ids = np.flatnonzero(allowed)
            client = int(ids[int(rng.integers(len(ids)))])
            drawn.append(client)
            allowed[client] = False
            count -= 1
    return drawn


def _spans(
    positions: np.ndarray, size: int, spent: int, budget: int | None, want: int
) -> tuple[int, np.ndarray, int | None]:
    """Split a block of ``size`` draws at the hits ``positions`` (``want`` at most) into single draws and check each
    against ``budget``.

    ``spent`` draws of the first single draw were made before the block. Returns the draws of the single draw left
    in progress at the block's end, the hits made within budget, and the block position (exclusive) at which a
    single draw ran out of its ``budget`` draws (None: none did).
    """
    if budget is None:
        tail = size - (int(positions[-1]) + 1) if len(positions) else size + spent
        return tail, positions, None
    starts = np.empty(len(positions), dtype=np.int64)
    if len(positions):
        starts[0] = -spent
        starts[1:] = positions[:-1] + 1
    over = np.flatnonzero(positions - starts + 1 > budget)
    if len(over):  # the first single draw past its budget stops there
        index = int(over[0])
        return 0, positions[:index], int(starts[index]) + budget
    if len(positions) == want:
        return 0, positions, None
    begin = int(positions[-1]) + 1 if len(positions) else -spent
    if size - begin > budget:
        return 0, positions, begin + budget
    return size - begin, positions, None
