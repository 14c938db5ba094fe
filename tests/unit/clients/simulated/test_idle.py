"""The used clients not in flight, by last use: the heap a least-recently-used draw passes over busy clients with."""

from __future__ import annotations

import numpy as np
import pytest

from flasync.clients.simulated._idle import IdleByLastUse


class _Reference:
    """What the heap stands for, kept plainly: each client's last use and whether it is busy."""

    def __init__(self, num_clients: int) -> None:
        self.last_used = np.full(num_clients, -1, dtype=np.int64)
        self.busy = np.zeros(num_clients, dtype=bool)

    def oldest_idle(self, k: int, taken: set[int]) -> list[int]:
        used = [c for c in range(len(self.busy)) if self.last_used[c] >= 0 and not self.busy[c] and c not in taken]
        return sorted(used, key=lambda c: int(self.last_used[c]))[:k]


@pytest.mark.parametrize("num_clients", [5, 30, 200])
def test_draws_take_the_idle_clients_by_last_use_whatever_was_drawn_before(num_clients: int) -> None:
    """Over thousands of dispatches (one by one and in arrays), releases and draws of one or several clients (some
    drawn and not dispatched, some with clients already taken), each draw is the idle used clients, oldest use
    first, and the oldest alone (:meth:`IdleByLastUse.oldest`) is the first of them: the last client of a draw read
    at the heap's top and left there changes no later draw, and compacting the heap's stale entries neither."""
    in_flight: dict[int, int] = {}
    idle, reference = IdleByLastUse(in_flight, num_clients), _Reference(num_clients)
    rng = np.random.default_rng(num_clients)
    uses = 0
    for _ in range(3000):
        action = int(rng.integers(0, 4))
        if action == 0:  # a dispatch of one idle client
            free = np.flatnonzero(~reference.busy)
            if len(free):
                client = int(rng.choice(free))
                reference.last_used[client], uses = uses, uses + 1
                reference.busy[client] = True
                idle.dispatched_one(client)
        elif action == 1:  # a dispatch of several
            free = np.flatnonzero(~reference.busy)
            ids = rng.permutation(free)[: int(rng.integers(1, 4))]
            reference.last_used[ids] = np.arange(uses, uses + len(ids))
            uses += len(ids)
            reference.busy[ids] = True
            idle.dispatched(ids)
        elif action == 2:  # a release
            busy = np.flatnonzero(reference.busy)
            if len(busy):
                client = int(rng.choice(busy))
                reference.busy[client] = False
                idle.released(client, reference.last_used.data)
        else:  # a draw
            k = int(rng.integers(1, 5))
            taken = set(rng.choice(num_clients, size=int(rng.integers(0, 3))).tolist())
            chosen: list[int] = []
            idle.take(k, chosen, set(taken), reference.last_used.data)
            assert chosen == reference.oldest_idle(k, taken)
            assert idle.oldest(reference.last_used.data) == next(iter(reference.oldest_idle(1, set())), None)
        assert idle.count == int(reference.busy.sum())
        assert np.array_equal(idle.busy, reference.busy)
    assert len(idle) <= 2 * num_clients + 64


def test_the_busy_array_and_the_one_by_one_marks_are_one_memory() -> None:
    """Clients marked busy in an array are busy one by one, and the other way round."""
    idle = IdleByLastUse({}, 6)
    idle.dispatched(np.array([1, 4]))
    idle.dispatched_one(2)
    idle.dispatched_one(2)  # already busy: counted once
    assert idle.busy.tolist() == [False, True, True, False, True, False]
    assert idle.count == 3
    stamps = np.array([-1, 0, 2, -1, 1, -1], dtype=np.int64)
    idle.released(4, stamps.data)
    idle.released(4, stamps.data)  # already idle: nothing changes
    assert idle.busy.tolist() == [False, True, True, False, False, False]
    assert idle.count == 2
    chosen: list[int] = []
    idle.take(3, chosen, set(), stamps.data)
    assert chosen == [4]
