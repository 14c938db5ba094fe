"""Clients as arrays: sample counts, speeds, availability and recency, client sampling, and the simulated network.

A client is not an object until it is sampled: the population is a few columns indexed by client id. Seeded traits
(speed factors, link latencies and bandwidths) are :class:`~flasync.clients.simulated._draws.DrawnColumn` s, whole
for a small population and drawn again a block at a time for a large one; sample counts may be one value broadcast
over every client; availability phases (``available_fraction < 1``), least-recently-used state (built by the first
:meth:`Population.mark_used`) and weighted sampling's cumulative sums are arrays of a few bytes per client, built only
when used. A draw of ``k`` clients costs ``O(k)`` (uniform, weighted, available-now) or ``O(k)`` amortised (least
recently used), never ``O(num_clients)``. Durations are simulated seconds on the virtual clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from flasync.clients.simulated._draws import DrawnColumn
from flasync.clients.simulated._idle import IdleByLastUse
from flasync.config import (
    SAMPLING_STRATEGIES,
    ConstantSpeed,
    HalfNormalSpeed,
    LogNormalSpeed,
    NetworkConfig,
    SamplingStrategy,
    SpeedConfig,
)
from flasync.core import seeding

__all__ = ["SAMPLING_STRATEGIES", "Network", "Population", "SamplingStrategy"]

_NEVER = -1
_ONE_BY_ONE = 8  # never-used clients drawn at most, from which the order is read a block at a time
_ARRAY_PASS_FROM = 16  # clients from which the link times of a group are computed as arrays (a fixed cost of ~8)
_LOOKED_UP = (dict, set, frozenset, Mapping)  # what a draw looks clients up in as it is (one tuple, not one a draw)


class Population:
    """Per-client sample counts, speed factors, availability phases and last use; draws cohorts of clients.

    Args:
        sizes: Samples held by each client, shape ``(num_clients,)``.
        speed: The speed model.
        seed: The run's seed (speed and availability draws use their own streams).
        available_fraction: Share of each availability period a client is online (1: always).
        availability_period_s: Length of a client's on/off cycle in simulated seconds (a day, by default); each
            client's cycle starts at its own random phase.
        slow_clients: Fixed slowdown factors of some clients (id -> factor), multiplying their training time.
        trace_slowdown: A device trace's slowdown factor (``1 / speed``) of each trace client; client ``k`` takes
            that of trace client ``k mod T`` in place of the speed model's per-client factor (its per-task
            draws, lognormal jitter or half-normal spread, stay).
    """

    def __init__(
        self,
        sizes: np.ndarray,
        speed: SpeedConfig,
        seed: int,
        *,
        available_fraction: float = 1.0,
        availability_period_s: float = 86_400.0,
        slow_clients: Mapping[int, float] | None = None,
        trace_slowdown: np.ndarray | None = None,
    ) -> None:
        """Draw per-client speed factors and availability phases once, from the run's seed."""
        if not 0.0 < available_fraction <= 1.0:
            raise ValueError(f"available_fraction must be in (0, 1], got {available_fraction}")
        if not availability_period_s > 0.0:
            raise ValueError(f"availability_period_s must be > 0, got {availability_period_s}")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        n = len(self.sizes)
        self.speed = speed
        self.seed = seed
        self.slowdown: DrawnColumn | None = None
        """Each client's speed factor (log-normal speed only), drawn on demand for a large population."""
        self.trace_slowdown = None if trace_slowdown is None else np.asarray(trace_slowdown, dtype=np.float64)
        """A device trace's slowdown of each trace client (None: the speed model's)."""
        if isinstance(speed, LogNormalSpeed) and trace_slowdown is None:
            sigma = speed.sigma
            self.slowdown = DrawnColumn(
                seeding.numpy_stream(seed, seeding.SPEED), n, lambda g, m: g.normal(0.0, sigma, size=m), np.exp
            )
        self.available_fraction = available_fraction
        self.availability_period_s = availability_period_s
        self.phase: np.ndarray | None = None
        if available_fraction < 1.0:
            self.phase = seeding.numpy_stream(seed, seeding.SPEED, 1).random(n, dtype=np.float32)
        # Least recently used: last_used[c] is the stamp of c's latest use (_NEVER: never used); never-used clients
        # come first in a fixed random order, then used ones in the order of their last use (a queue whose stale
        # entries - clients used again since - are skipped lazily). All built on first use.
        self._uses = 0
        self.last_used: np.ndarray | None = None
        self._stamps: memoryview | None = None
        self._fresh: np.ndarray | None = None
        self._fresh_head = 0
        self._deferred: list[int] = []
        self._queue = np.zeros(0, dtype=np.int32)
        self._queue_stamp = np.zeros(0, dtype=np.int64)
        self._queue_head = 0
        self._queue_tail = 0
        # The tasks in flight, where the population follows them (see follow_tasks), and (built with the LRU state)
        # the used clients not in flight by last use, that a draw passes over the busy clients with.
        self._follows: Collection[int] | None = None
        self._idle: IdleByLastUse | None = None
        self._cdf: np.ndarray | None = None
        self.fixed_slowdown: dict[int, float] = {int(c): float(f) for c, f in (slow_clients or {}).items()}
        """The fixed slowdown factors of the few clients that have one (every other client's is 1)."""

    def __len__(self) -> int:
        """Return the number of clients."""
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        """Return the bytes of every per-client array the population holds now."""
        arrays = [self.sizes, self.phase, self.last_used, self._fresh, self._queue, self._cdf, self.trace_slowdown]
        held = sum(_held_bytes(a) for a in arrays if a is not None) + self._queue_stamp.nbytes
        return held + (self.slowdown.nbytes if self.slowdown is not None else 0)

    def train_seconds(self, client_id: int, steps: int, participation: int) -> float:
        """Return simulated seconds of ``client_id``'s ``participation``-th task of ``steps`` local steps."""
        speed = self.speed
        base = steps * speed.seconds_per_step * self.fixed_slowdown.get(client_id, 1.0)
        traced = self.trace_slowdown
        if traced is not None:
            base *= float(traced[client_id % len(traced)])
        if isinstance(speed, ConstantSpeed):
            return base
        draw = seeding.stream_normal(self.seed, seeding.TASK_SPEED, client_id, participation)
        if isinstance(speed, LogNormalSpeed):
            if traced is not None:
                return base * math.exp(speed.jitter * draw)
            assert self.slowdown is not None
            return base * float(self.slowdown[client_id]) * math.exp(speed.jitter * draw)
        if isinstance(speed, HalfNormalSpeed):
            return base * (1.0 + abs(speed.sigma * draw))
        raise AssertionError(f"unhandled speed model {speed!r}")  # pragma: no cover

    def train_seconds_many(
        self, client_ids: Sequence[int], steps: Sequence[int], participations: Sequence[int]
    ) -> list[float]:
        """Return :meth:`train_seconds` of each client, its local steps and its participation, in one pass (the same
        floats, from the same per-task draws)."""
        return _train_seconds_many(self, client_ids, steps, participations)

    # ------------------------------------------------------------------------------------------- availability
    def available(self, clients: np.ndarray, now: float) -> np.ndarray:
        """Return a bool mask: which of ``clients`` are online at simulated time ``now``."""
        clients = np.asarray(clients)
        if self.phase is None:
            return np.ones(clients.shape, dtype=bool)
        position = (now / self.availability_period_s + self.phase[clients]) % 1.0
        mask: np.ndarray = position < self.available_fraction
        return mask

    # ------------------------------------------------------------------------------------------------ sampling
    def sample(
        self,
        k: int,
        rng: np.random.Generator,
        *,
        strategy: SamplingStrategy = "uniform",
        now: float = 0.0,
        exclude: Collection[int] = (),
    ) -> np.ndarray:
        """Draw ``k`` distinct clients not in ``exclude``; return their ids (int64, in draw order).

        Strategies:

        * ``uniform``: every eligible client equally likely.
        * ``weighted``: probability proportional to the client's sample count (successive sampling: a draw with
          replacement that skips repeats is, conditionally, proportional to the weights of those not yet drawn).
        * ``lru``: the least recently used clients (see :meth:`mark_used`); never-used ones first, in a fixed
          random order.
        * ``available``: uniform among clients online at ``now``; if fewer than ``k`` are online, the rest are
          drawn uniformly from the offline ones.

        Raises:
            ValueError: If fewer than ``k`` clients are eligible or the strategy is unknown.
        """
        n = len(self)
        # A set or mapping (the registry's clients in flight) is looked up as it is: copying it would cost a draw
        # of one client as many steps as there are tasks in flight.
        excluded = exclude if isinstance(exclude, _LOOKED_UP) else {int(c) for c in exclude}
        if k < 0 or k > n - len(excluded):
            raise ValueError(f"cannot draw {k} clients from {n} with {len(excluded)} excluded")
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        if strategy == "uniform":
            return _rejection(k, excluded, lambda m: rng.choice(n, size=min(m, n), replace=False))
        if strategy == "weighted":
            cdf = self._weights_cdf()
            return _rejection(
                k, excluded, lambda m: np.searchsorted(cdf, rng.random(m) * cdf[-1], side="right"), limit=64
            )
        if strategy == "lru":
            return np.asarray(self._least_recently_used(k, excluded), dtype=np.int64)
        if strategy == "available":
            if self.phase is None:
                return self.sample(k, rng, strategy="uniform", exclude=excluded)

            def online_candidates(m: int) -> np.ndarray:
                candidates: np.ndarray = rng.integers(n, size=m)
                online: np.ndarray = candidates[self.available(candidates, now)]
                return online

            online = _rejection(
                k,
                excluded,
                online_candidates,
                limit=16,
                oversample=1.0 / self.available_fraction,
            )
            if len(online) == k:
                return online
            everyone = np.arange(n)
            online = everyone[self.available(everyone, now)]  # few online: look at all of them
            online = np.setdiff1d(online, np.fromiter(excluded, dtype=np.int64, count=len(excluded)))
            chosen = rng.permutation(online)[:k]
            rest = self.sample(k - len(chosen), rng, strategy="uniform", exclude={*excluded, *online.tolist()})
            return np.concatenate([chosen, rest]).astype(np.int64)
        raise ValueError(f"unknown sampling strategy {strategy!r}; expected one of {', '.join(SAMPLING_STRATEGIES)}")

    def sample_idle_many(
        self, busy: Collection[int], now: float, k: int, rng: np.random.Generator, *, strategy: SamplingStrategy
    ) -> list[int]:
        """Draw the clients ``k`` successive ``sample(1, rng, strategy=strategy, now=now, exclude=...)`` calls would,
        each excluding ``busy`` and the clients drawn before it, consuming ``rng`` as they would; raise as
        :meth:`sample` does. A least-recently-used draw of ``k`` is such draws already (a drawn client is excluded and
        its use only moves it behind the others)."""
        excluded = busy if isinstance(busy, _LOOKED_UP) else {int(c) for c in busy}
        if strategy == "lru":
            if not 0 <= k <= len(self) - len(excluded):
                raise ValueError(f"cannot draw {k} clients from {len(self)} with {len(excluded)} excluded")
            return self._least_recently_used(k, excluded) if k else []
        drawn = [int(self.sample(1, rng, strategy=strategy, now=now, exclude=excluded)[0])] if k else []
        taken = {*excluded, *drawn} if k > 1 else set()  # ``busy`` is not the population's to add to
        for _ in range(k - 1):
            drawn.append(int(self.sample(1, rng, strategy=strategy, now=now, exclude=taken)[0]))
            taken.add(drawn[-1])
        return drawn

    def least_recent_idle(self, busy: Collection[int]) -> int | None:
        """Return the client :meth:`sample_idle_many` draws alone excluding ``busy``, least recently used, found at
        once where the heap of idle clients answers such a draw; None elsewhere (draw the general way then)."""
        idle, stamps = self._idle, self._stamps
        if idle is None or stamps is None or not self._idle_answers(busy):
            return None
        return idle.oldest(stamps)

    def _idle_answers(self, excluded: Collection[int]) -> bool:
        """Tell whether the heap of idle clients answers a draw excluding ``excluded``: every client was used and
        ``excluded`` is the tasks in flight followed (:meth:`follow_tasks`)."""
        used = self._fresh is not None and not self._deferred and self._fresh_head == len(self._fresh)
        return used and self._idle is not None and self._idle.covers(excluded)

    def mark_used(self, clients: np.ndarray | list[int]) -> None:
        """Record that ``clients`` were just dispatched (in this order), for least-recently-used sampling."""
        if type(clients) is list and len(clients) == 1:  # one dispatch: scalar stores, a fifth of the arrays' cost
            self._mark_one(int(clients[0]))
            return
        ids = np.asarray(clients, dtype=np.int64).reshape(-1)
        if len(ids) == 0:
            return
        self._lru_state()
        assert self.last_used is not None
        stamps = np.arange(self._uses, self._uses + len(ids), dtype=np.int64)
        self._uses += len(ids)
        self.last_used[ids] = stamps
        if self._idle is not None:
            self._idle.dispatched(ids)
        need = self._queue_tail + len(ids)
        if need > len(self._queue):
            self._compact(need)
        self._queue[self._queue_tail : self._queue_tail + len(ids)] = ids
        self._queue_stamp[self._queue_tail : self._queue_tail + len(ids)] = stamps
        self._queue_tail += len(ids)

    def follow_tasks(self, in_flight: Collection[int]) -> None:
        """Follow the tasks in flight for least-recently-used sampling: ``in_flight`` (the task registry's clients
        in flight, by client) holds the clients :meth:`mark_used` was told of and :meth:`mark_idle` was not told of
        since. A draw that excludes ``in_flight`` itself then passes over the busy clients without looking at them
        (the same clients as a walk past them would draw).

        Raises:
            RuntimeError: If a client was marked used already.
        """
        if self._uses:
            raise RuntimeError("follow_tasks must be called before the first client is marked used")
        self._follows = in_flight
        if self.last_used is not None:
            self._idle = IdleByLastUse(in_flight, len(self))

    def mark_idle(self, client: int) -> None:
        """Record that ``client``'s task in flight ended (see :meth:`follow_tasks`)."""
        if self._idle is not None:
            assert self._stamps is not None
            self._idle.released(client, self._stamps)

    # ------------------------------------------------------------------------------------------------ private
    def _mark_one(self, client: int) -> None:
        """:meth:`mark_used` of one client."""
        if self.last_used is None:
            self._lru_state()
        assert self._stamps is not None
        stamp = self._uses
        self._uses = stamp + 1
        self._stamps[client] = stamp
        if self._idle is not None:
            self._idle.dispatched_one(client)
        tail = self._queue_tail
        if tail + 1 > len(self._queue):
            self._compact(tail + 1)
            tail = self._queue_tail
        self._queue[tail] = client
        self._queue_stamp[tail] = stamp
        self._queue_tail = tail + 1

    def _weights_cdf(self) -> np.ndarray:
        if self._cdf is None:
            if int(self.sizes.sum()) <= 0:
                raise ValueError("weighted sampling needs at least one client with samples")
            self._cdf = np.cumsum(self.sizes, dtype=np.float64)
        return self._cdf

    def _lru_state(self) -> None:
        if self.last_used is None:
            n = len(self)
            self.last_used = np.full(n, _NEVER, dtype=np.int64)
            self._stamps = self.last_used.data  # a memoryview: one stamp read or written as a Python int
            self._fresh = seeding.numpy_stream(self.seed, seeding.SERVER, 1).permutation(n).astype(np.int32)
            if self._follows is not None:
                self._idle = IdleByLastUse(self._follows, n)

    def _compact(self, need: int) -> None:
        """Drop stale queue entries; grow the queue if it is still too small."""
        assert self.last_used is not None
        ids = self._queue[self._queue_head : self._queue_tail]
        stamps = self._queue_stamp[self._queue_head : self._queue_tail]
        live = self.last_used[ids] == stamps
        ids, stamps = ids[live], stamps[live]
        extra = need - self._queue_tail
        size = max(2 * (len(ids) + extra), 1024)
        self._queue = np.zeros(size, dtype=np.int32)
        self._queue_stamp = np.zeros(size, dtype=np.int64)
        self._queue[: len(ids)] = ids
        self._queue_stamp[: len(ids)] = stamps
        self._queue_head, self._queue_tail = 0, len(ids)

    def _least_recently_used(self, k: int, excluded: Collection[int]) -> list[int]:
        if self.last_used is None:
            self._lru_state()
        assert self.last_used is not None and self._fresh is not None and self._stamps is not None
        chosen: list[int] = []
        taken: set[int] = set()
        idle = self._idle
        if idle is not None and self._idle_answers(excluded):
            idle.take(k, chosen, taken, self._stamps)  # every client was used: the idle ones by last use
            return chosen
        chunk = max(2 * k, 64)
        # Never-used clients, in their fixed random order. The head moves past used clients for good, and past
        # excluded (in-flight) never-used ones by deferring them to a short list that later draws look at first.
        still_deferred = []
        for candidate in self._deferred:
            if self.last_used[candidate] != _NEVER:
                continue
            still_deferred.append(candidate)
            if candidate not in excluded and len(chosen) < k:
                chosen.append(candidate)
                taken.add(candidate)
        self._deferred = still_deferred
        self._never_used(k, excluded, chosen, taken, chunk)
        if len(chosen) < k and self._idle is not None and self._idle.covers(excluded):
            self._idle.take(k, chosen, taken, self._stamps)  # the used clients not in flight, by last use
            return chosen
        # Then used clients, oldest last use first; stale entries at the head are dropped for good.
        self._queue_head = _walk_queue(
            self._queue,
            self._queue_stamp,
            self.last_used,
            (self._queue_head, self._queue_tail),
            k,
            excluded,
            chosen,
            taken,
            chunk,
        )
        return chosen

    def _never_used(self, k: int, excluded: Collection[int], chosen: list[int], taken: set[int], chunk: int) -> None:
        """Add to ``chosen`` never-used clients in their fixed random order, from the head, until it holds ``k``.

        The head moves past used clients for good, and past excluded (in-flight) never-used ones by deferring them.
        A draw of a few clients reads the order one client at a time; a larger one a block at a time (the same
        clients, the same head).
        """
        assert self.last_used is not None and self._fresh is not None
        if k - len(chosen) <= _ONE_BY_ONE:
            fresh, last_used, end = self._fresh, self.last_used, len(self._fresh)
            position, at_head = self._fresh_head, True
            while len(chosen) < k and position < end:
                candidate = int(fresh[position])
                if last_used[candidate] == _NEVER:
                    if candidate in excluded:
                        if at_head:
                            self._deferred.append(candidate)
                    else:
                        if at_head:  # everything before this client is used or deferred
                            self._fresh_head = position
                            at_head = False
                        if candidate not in taken:
                            chosen.append(candidate)
                            taken.add(candidate)
                position += 1
                if at_head:
                    self._fresh_head = position
            return
        position, at_head = self._fresh_head, True
        while len(chosen) < k and position < len(self._fresh):
            block = self._fresh[position : position + chunk]
            unused = self.last_used[block] == _NEVER
            for offset, candidate in zip(np.flatnonzero(unused).tolist(), block[unused].tolist(), strict=True):
                if candidate in excluded:
                    if at_head:
                        self._deferred.append(candidate)
                    continue
                if at_head:  # everything before this client is used or deferred
                    self._fresh_head = position + offset
                    at_head = False
                if candidate not in taken:
                    chosen.append(candidate)
                    taken.add(candidate)
                if len(chosen) == k:
                    break
            if at_head:
                self._fresh_head = position + len(block)
            position += len(block)


class Network:
    """Per-client links: transfer time is ``latency + bytes / bandwidth`` in each direction.

    Args:
        config: Medians and log-space spreads.
        num_clients: Population size.
        seed: The run's seed (the draws use their own stream, once per client).
        trace_links: A device trace's uplink and downlink bandwidths of each trace client (bytes a second); client
            ``k`` takes those of trace client ``k mod T`` instead of drawn ones (its latency is still drawn).
    """

    def __init__(
        self,
        config: NetworkConfig,
        num_clients: int = 1,
        seed: int = 0,
        trace_links: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        """Draw every client's latency and bandwidths (one stream: latencies, then uploads, then downloads)."""
        self.config = config
        rng = seeding.numpy_stream(seed, seeding.NETWORK)
        latency, bandwidth = config.latency_sigma, config.bandwidth_sigma
        self.latency_s = DrawnColumn(
            rng, num_clients, lambda g, m: g.normal(0.0, latency, m), lambda z: config.latency_s * np.exp(z)
        )
        self.upload_bytes_per_s: DrawnColumn | _Cycled = DrawnColumn(
            rng, num_clients, lambda g, m: g.normal(0.0, bandwidth, m), lambda z: config.upload_bytes_per_s * np.exp(z)
        )
        self.download_bytes_per_s: DrawnColumn | _Cycled = DrawnColumn(
            rng,
            num_clients,
            lambda g, m: g.normal(0.0, bandwidth, m),
            lambda z: config.download_bytes_per_s * np.exp(z),
        )
        if trace_links is not None:
            self.upload_bytes_per_s = _Cycled(trace_links[0])
            self.download_bytes_per_s = _Cycled(trace_links[1])

    @property
    def nbytes(self) -> int:
        """Return the bytes the links hold (see :class:`DrawnColumn`)."""
        return self.latency_s.nbytes + self.upload_bytes_per_s.nbytes + self.download_bytes_per_s.nbytes

    def upload_seconds(self, client_id: int, num_bytes: int) -> float:
        """Return simulated seconds for ``client_id`` to upload ``num_bytes``."""
        return float(self.latency_s[client_id] + num_bytes / self.upload_bytes_per_s[client_id])

    def download_seconds(self, client_id: int, num_bytes: int) -> float:
        """Return simulated seconds for ``client_id`` to download ``num_bytes``."""
        return float(self.latency_s[client_id] + num_bytes / self.download_bytes_per_s[client_id])

    def upload_seconds_many(self, client_ids: Sequence[int], num_bytes: Sequence[int]) -> list[float]:
        """Return :meth:`upload_seconds` of each client and size, in one pass (the same floats)."""
        if len(client_ids) < _ARRAY_PASS_FROM:  # Python floats: the same IEEE operations as NumPy's scalars
            latency, rate = self.latency_s.item, self.upload_bytes_per_s.item
            return [latency(c) + size / rate(c) for c, size in zip(client_ids, num_bytes, strict=True)]
        ids = np.asarray(client_ids, dtype=np.int64)
        seconds: list[float] = (
            self.latency_s[ids] + np.asarray(num_bytes, dtype=np.float64) / self.upload_bytes_per_s[ids]
        ).tolist()
        return seconds

    def download_seconds_many(self, client_ids: Sequence[int], num_bytes: int) -> list[float]:
        """Return :meth:`download_seconds` of each client for ``num_bytes``, in one pass (the same floats)."""
        if len(client_ids) < _ARRAY_PASS_FROM:  # Python floats: the same IEEE operations as NumPy's scalars
            latency, rate = self.latency_s.item, self.download_bytes_per_s.item
            return [latency(c) + num_bytes / rate(c) for c in client_ids]
        ids = np.asarray(client_ids, dtype=np.int64)
        seconds: list[float] = (self.latency_s[ids] + float(num_bytes) / self.download_bytes_per_s[ids]).tolist()
        return seconds


class _Cycled:
    """A trace's per-client values seen by population client id: client ``k`` has the value of ``k mod T``."""

    def __init__(self, values: np.ndarray) -> None:
        """Keep the trace's values."""
        self.values = np.asarray(values, dtype=np.float64)

    @property
    def nbytes(self) -> int:
        """Return the bytes held (the trace's values)."""
        return int(self.values.nbytes)

    def __getitem__(self, clients: int | np.ndarray) -> Any:
        """Return one client's value or an array of the values of an array of clients."""
        if isinstance(clients, int | np.integer):
            return self.values[int(clients) % len(self.values)]
        return self.values[np.asarray(clients, dtype=np.int64) % len(self.values)]

    def floats(self, clients: Sequence[int]) -> list[float]:
        """Return the values of ``clients`` as Python floats."""
        item, count = self.values.item, len(self.values)
        return [item(int(client) % count) for client in clients]

    @property
    def item(self) -> Callable[[int], float]:
        """What returns one client's value as a Python float."""
        return self._float_of

    def _float_of(self, client: int) -> float:
        values = self.values
        value: float = values.item(int(client) % len(values))
        return value


def _walk_queue(
    queue: np.ndarray,
    queue_stamp: np.ndarray,
    last_used: np.ndarray,
    span: tuple[int, int],
    k: int,
    excluded: Collection[int],
    chosen: list[int],
    taken: set[int],
    chunk: int,
) -> int:
    """Add to ``chosen`` the clients of the used-clients queue's live entries (those at their client's last use) in
    ``span`` (head, tail), in order, none ``excluded`` or ``taken``, until it holds ``k``; return the new head (the
    first live entry, stale ones before it dropped for good). A block of ``chunk`` entries is read at a time."""
    position, tail = span
    head, at_head, need = position, True, k - len(chosen)
    while need > 0 and position < tail:
        ids = queue[position : min(position + chunk, tail)]
        live = last_used[ids] == queue_stamp[position : position + len(ids)]
        if at_head:
            lead = int(np.argmax(live)) if live.any() else len(ids)
            head = position + lead
            at_head = lead == len(ids)
        found: list[int] = ids[live].tolist()  # distinct: a client's one live entry is its last use
        if excluded or taken:
            found = [c for c in found if c not in excluded and c not in taken]
        found = found[:need]
        chosen += found
        taken.update(found)
        need -= len(found)
        position += len(ids)
    return head


def _train_seconds_many(
    population: Population, clients: Sequence[int], steps: Sequence[int], participations: Sequence[int]
) -> list[float]:
    """:meth:`Population.train_seconds` of each of ``clients``, the same operations in the same order per task."""
    if not len(clients) == len(steps) == len(participations):
        raise ValueError(f"{len(clients)} clients, {len(steps)} step counts and {len(participations)} participations")
    speed, fixed, traced = population.speed, population.fixed_slowdown, population.trace_slowdown
    per_step = speed.seconds_per_step
    if fixed:
        base = [n * per_step * fixed.get(c, 1.0) for c, n in zip(clients, steps, strict=True)]
    else:  # a factor of 1.0 leaves every float as it is
        base = [n * per_step for n in steps]
    if traced is not None:
        item, count = traced.item, len(traced)
        base = [b * item(c % count) for b, c in zip(base, clients, strict=True)]
    if isinstance(speed, ConstantSpeed):
        return base
    seed, normal, purpose = population.seed, seeding.stream_normal, seeding.TASK_SPEED
    draws = [normal(seed, purpose, c, p) for c, p in zip(clients, participations, strict=True)]
    if isinstance(speed, LogNormalSpeed):
        jitter, exp = speed.jitter, math.exp
        if traced is not None:
            return [b * exp(jitter * d) for b, d in zip(base, draws, strict=True)]
        assert population.slowdown is not None
        slowdown = population.slowdown.item
        return [b * slowdown(c) * exp(jitter * d) for b, c, d in zip(base, clients, draws, strict=True)]
    if isinstance(speed, HalfNormalSpeed):
        sigma = speed.sigma
        return [b * (1.0 + abs(sigma * d)) for b, d in zip(base, draws, strict=True)]
    raise AssertionError(f"unhandled speed model {speed!r}")  # pragma: no cover


def _rejection(
    k: int,
    excluded: Collection[int],
    draw: Callable[[int], np.ndarray],
    *,
    limit: int = 1_000,
    oversample: float = 1.0,
) -> np.ndarray:
    """Draw candidates in batches, keeping new, non-excluded ones in draw order, until ``k`` are kept."""
    chosen: list[int] = []
    seen: set[int] = set()  # drawn already (the excluded are looked up where they are)
    for _ in range(limit):
        want = k - len(chosen)
        batch = draw(math.ceil((want + len(excluded)) * oversample * 1.25) + 8)
        for candidate in np.asarray(batch).tolist():
            if candidate not in seen and candidate not in excluded:
                seen.add(candidate)
                chosen.append(candidate)
                if len(chosen) == k:
                    return np.asarray(chosen, dtype=np.int64)
    return np.asarray(chosen, dtype=np.int64)


def _held_bytes(array: np.ndarray) -> int:
    """Return the bytes ``array`` holds: none for one value broadcast over every client (a zero stride)."""
    return 0 if array.ndim == 1 and array.strides[0] == 0 else int(array.nbytes)
