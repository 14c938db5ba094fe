"""The client sampler's draw of an idle online client."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.core.events import ClientId
from flasync.server.sampler import ClientSampler


class _Online:
    """Availability from a fixed mask."""

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask

    def online(self, client_id: int, t: float) -> bool:
        return bool(self.mask[client_id])

    def online_mask(self, t: float) -> np.ndarray:
        return self.mask.copy()

    def next_online(self, t: float) -> float:
        return t


def _one_by_one(busy: set[int], online: _Online, rng: np.random.Generator) -> int | None:
    """The draw as a loop of single draws: up to 8 n uniform ids, the first idle online one, else one of them."""
    num_clients = len(online.mask)
    for _ in range(8 * num_clients):
        candidate = int(rng.integers(num_clients))
        if candidate not in busy and online.online(candidate, 0.0):
            return candidate
    idle = [c for c in np.flatnonzero(online.mask).tolist() if c not in busy]
    return idle[int(rng.integers(len(idle)))] if idle else None


def _draw_as_single_draws(
    sampler: ClientSampler, busy: set[int], online: _Online, reference: np.random.Generator, times: int
) -> ClientId | None:
    """Draw ``times`` idle clients (each drawn one becomes busy), checking each draw and the generator's state
    against :func:`_one_by_one` on ``reference``; return the last draw."""
    drawn: ClientId | None = None
    for _ in range(times):
        drawn = sampler.sample_idle(busy, 0.0)
        expected = _one_by_one(busy, online, reference)
        assert drawn == (None if expected is None else ClientId(expected))
        assert sampler.rng.bit_generator.state == reference.bit_generator.state
        if drawn is not None:
            busy.add(int(drawn))
    return drawn


@settings(max_examples=60, deadline=None)
@given(
    num_clients=st.integers(1, 300),
    online_fraction=st.floats(0.0, 1.0),
    busy_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_sample_idle_draws_as_single_draws_would(
    num_clients: int, online_fraction: float, busy_fraction: float, seed: int
) -> None:
    """Drawing in blocks picks the client, and leaves the generator where, a loop of single draws would."""
    layout = np.random.default_rng(seed)
    online = _Online(layout.random(num_clients) < online_fraction)
    busy = {int(c) for c in np.flatnonzero(layout.random(num_clients) < busy_fraction)}
    sampler = ClientSampler(np.arange(num_clients), "uniform", np.random.default_rng(seed + 1), availability=online)
    reference = np.random.default_rng(seed + 1)
    _draw_as_single_draws(sampler, busy, online, reference, times=3)


def test_few_devices_online_among_many_busy_are_drawn_as_single_draws_would() -> None:
    """With most clients busy and a few online (remote devices training), the draw and the generator's state are the
    single draws' ones, and a draw with no idle online client moves the generator as 8 n single draws do."""
    num_clients = 1000
    mask = np.zeros(num_clients, dtype=bool)
    mask[[3, 500, 998]] = True
    online = _Online(mask)
    busy = set(range(num_clients)) - {500, 998, 7}
    sampler = ClientSampler(np.arange(num_clients), "uniform", np.random.default_rng(11), availability=online)
    reference = np.random.default_rng(11)
    drawn = _draw_as_single_draws(sampler, busy, online, reference, times=3)  # 500 or 998, the other, then none
    assert drawn is None
