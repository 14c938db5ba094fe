"""The used clients not in flight, by last use: how a least-recently-used draw passes over the clients in flight.

A :class:`~flasync.clients.simulated.population.Population` following the task registry's tasks in flight keeps one
:class:`IdleByLastUse`: which clients are busy, and a heap of ``(stamp, client)`` of the used clients released since
their last use. A draw then takes the oldest idle ones from the heap instead of walking past every busy client in the
order of last use: the same clients, in ``O(log n)`` a client.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

import numpy as np

__all__ = ["IdleByLastUse"]


class IdleByLastUse:
    """Busy clients and the released ones by last use.

    Args:
        in_flight: The tasks in flight by client (the task registry's); a draw that excludes this very collection
            may take its used clients from :meth:`take`.
        num_clients: Population size.
    """

    def __init__(self, in_flight: Collection[int], num_clients: int) -> None:
        """Start with no client busy and none released."""
        self.in_flight = in_flight
        # One byte a client, read and written one at a time through the bytearray (a Python int each, no NumPy
        # scalar) and many at a time through ``busy``, an array over the same memory.
        self._flags = bytearray(num_clients)
        self.busy = np.frombuffer(self._flags, dtype=bool)
        """Clients dispatched and not released since."""
        self.count = 0
        """How many clients are busy."""
        self._released: list[tuple[int, int]] = []

    def __len__(self) -> int:
        """Return the heap's entries, stale ones included."""
        return len(self._released)

    def covers(self, excluded: Collection[int]) -> bool:
        """Tell whether a draw excluding ``excluded`` may take its used clients from :meth:`take`: they are the
        tasks in flight followed, as many as the busy clients."""
        return excluded is self.in_flight and len(excluded) == self.count

    def dispatched(self, ids: np.ndarray) -> None:
        """Mark ``ids`` (distinct clients) busy."""
        busy = self.busy
        self.count += len(ids) - int(np.count_nonzero(busy[ids]))
        busy[ids] = True

    def dispatched_one(self, client: int) -> None:
        """Mark ``client`` busy."""
        flags = self._flags
        if not flags[client]:
            flags[client] = 1
            self.count += 1

    def released(self, client: int, last_used: memoryview) -> None:
        """Mark ``client`` idle, at its last use in ``last_used`` (a view of the population's int64 stamps)."""
        flags = self._flags
        if not flags[client]:
            return
        flags[client] = 0
        self.count -= 1
        heap = self._released
        heapq.heappush(heap, (last_used[client], client))
        if len(heap) > 2 * len(flags) + 64:  # more stale entries than clients: keep the live ones
            self._released = [entry for entry in heap if self._idle_at(*entry, last_used)]
            heapq.heapify(self._released)

    def oldest(self, last_used: memoryview) -> int | None:
        """Return the idle used client of the oldest last use (None: there is none), left on the heap: what
        :meth:`take` of one adds. Stale entries at the top are dropped for good, as there."""
        heap, flags = self._released, self._flags
        while heap:
            stamp, client = heap[0]
            if flags[client] or last_used[client] != stamp:
                heapq.heappop(heap)
                continue
            return client
        return None

    def take(self, k: int, chosen: list[int], taken: set[int], last_used: memoryview) -> None:
        """Add to ``chosen`` the idle used clients, oldest last use first, until it holds ``k`` (none in ``taken``);
        stale entries (clients used again since) are dropped for good, the drawn ones stay (a draw changes nothing
        until its clients are marked used). Entries are distinct ``(stamp, client)`` pairs, so the heap pops them in
        one order whatever its layout: the last client drawn is read at the top and left there."""
        heap, kept, flags = self._released, [], self._flags
        while len(chosen) < k and heap:
            stamp, client = heap[0]
            if flags[client] or last_used[client] != stamp:
                heapq.heappop(heap)
                continue
            if client not in taken:
                chosen.append(client)
                taken.add(client)
                if len(chosen) == k:
                    break
            kept.append(heapq.heappop(heap))
        for entry in kept:
            heapq.heappush(heap, entry)

    def _idle_at(self, stamp: int, client: int, last_used: memoryview) -> bool:
        """Tell whether ``client`` is idle and was last used at ``stamp`` (a live entry)."""
        return not self._flags[client] and last_used[client] == stamp
