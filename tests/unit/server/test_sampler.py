"""The client sampler's draw of an idle online client."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.clients.simulated.faults import FaultModel
from flasync.clients.simulated.population import Population
from flasync.clients.simulated.trace import TraceWindows, synthetic_trace
from flasync.config import AvailabilityConfig, ConstantSpeed, FaultsConfig
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


def _twins(
    strategy: str, num_clients: int, seed: int, online: _Online | None
) -> tuple[ClientSampler, ClientSampler, dict[int, int], dict[int, int]]:
    """Two samplers alike (populations, streams, availability), each with the tasks in flight its population
    follows, the same clients busy in both (used and not released)."""
    layout = np.random.default_rng(seed)
    sizes = layout.integers(1, 50, num_clients)  # every client drawable by weight
    samplers, busies = [], []
    for _ in range(2):
        population = Population(
            sizes, ConstantSpeed(), seed, available_fraction=0.5 if strategy == "available" else 1.0
        )
        busy: dict[int, int] = {}
        population.follow_tasks(busy)
        samplers.append(ClientSampler(population, strategy, np.random.default_rng(seed + 1), availability=online))  # type: ignore[arg-type]
        busies.append(busy)
    for sampler, busy in zip(samplers, busies, strict=True):  # some history: clients used, some of them released
        history = np.random.default_rng(seed + 2)
        used = history.permutation(num_clients)[: int(history.integers(0, num_clients + 1))].tolist()
        assert isinstance(sampler.population, Population)
        sampler.population.mark_used(used)
        busy.update(dict.fromkeys(used, 0))
        for client in used:
            if history.random() < 0.5:
                del busy[client]
                sampler.population.mark_idle(client)
    return samplers[0], samplers[1], busies[0], busies[1]


def _one_at_a_time(sampler: ClientSampler, busy: dict[int, int], k: int, now: float) -> list[ClientId]:
    """Fill ``k`` slots as single draws did: draw one idle client, dispatch it (mark it used and busy), again."""
    drawn: list[ClientId] = []
    for _ in range(k):
        client = sampler.sample_idle(busy, now)
        if client is None:
            break
        drawn.append(client)
        busy[int(client)] = 1
        assert isinstance(sampler.population, Population)
        sampler.population.mark_used([int(client)])
    return drawn


@pytest.mark.parametrize("kind", ["uniform", "weighted", "lru", "available", "windows", "few online"])
@settings(max_examples=60, deadline=None)
@given(num_clients=st.integers(1, 200), seed=st.integers(0, 2**32 - 1), fills=st.integers(1, 4))
@pytest.mark.slow
def test_sample_idle_many_draws_what_successive_single_draws_would(
    kind: str, num_clients: int, seed: int, fills: int
) -> None:
    """For every sampling kind, a batch of k draws gives the clients, in order, that k single draws give, each after
    the previous client became busy and used; it leaves the random stream and the LRU marks where they leave them,
    and stops where a single draw finds no idle online client."""
    layout = np.random.default_rng(seed + 3)
    online = None
    if kind == "windows":
        online = _Online(layout.random(num_clients) < layout.random())
    elif kind == "few online":  # remote devices: a handful connected among many training
        online = _Online(np.isin(np.arange(num_clients), layout.integers(0, num_clients, 3)))
    strategy = kind if kind in ("weighted", "lru", "available") else "uniform"
    batched, single, busy_batched, busy_single = _twins(strategy, num_clients, seed, online)
    for fill in range(fills):
        idle = num_clients - len(busy_single)
        k = int(layout.integers(0, idle + 1 if online is None else num_clients + 2))
        try:
            expected = _one_at_a_time(single, busy_single, k, float(fill))
        except IndexError:  # a weighted draw gives up on idle clients of little weight among many busy: so does a batch
            with pytest.raises(IndexError):
                batched.sample_idle_many(busy_batched, float(fill), k)
            return
        drawn = batched.sample_idle_many(busy_batched, float(fill), k)
        assert drawn == expected
        assert batched.rng.bit_generator.state == single.rng.bit_generator.state
        assert isinstance(batched.population, Population)
        batched.population.mark_used(drawn)
        busy_batched.update(dict.fromkeys(drawn, 1))
        for client in layout.permutation(sorted(busy_single))[: int(layout.integers(0, 4))].tolist():
            for busy, sampler in ((busy_single, single), (busy_batched, batched)):
                del busy[client]
                assert isinstance(sampler.population, Population)
                sampler.population.mark_idle(client)
    assert isinstance(batched.population, Population) and isinstance(single.population, Population)
    assert np.array_equal(np.asarray(batched.population.last_used), np.asarray(single.population.last_used))


@pytest.mark.parametrize("seed", [2297, 3819, 9435, 0, 1])
def test_sample_idle_many_past_a_draws_budget_takes_one_of_the_idle_as_a_single_draw_does(seed: int) -> None:
    """A single draw that finds no idle online client among its 8 n uniform draws takes one of the idle ones by one
    more draw (streams 2297, 3819 and 9435 miss the one idle client 800 times), and the next single draw, finding
    none idle, makes its 8 n draws and fails: a batch does the same at the same points."""
    num_clients = 100
    online = _Online(np.ones(num_clients, dtype=bool))
    busy = set(range(num_clients)) - {5}
    single = ClientSampler(np.arange(num_clients), "uniform", np.random.default_rng(seed), availability=online)
    batched = ClientSampler(np.arange(num_clients), "uniform", np.random.default_rng(seed), availability=online)
    reference = np.random.default_rng(seed)
    assert _draw_as_single_draws(single, set(busy), online, reference, times=2) is None  # 5, then none
    assert batched.sample_idle_many(busy, 0.0, 3) == [ClientId(5)]
    assert batched.rng.bit_generator.state == single.rng.bit_generator.state


@pytest.mark.parametrize("windows", ["periodic", "trace"])
@settings(max_examples=20, deadline=None)
@given(num_clients=st.integers(2, 150), seed=st.integers(0, 2**16), now=st.floats(0.0, 500.0))
def test_sample_idle_many_over_the_fault_models_windows_draws_what_single_draws_would(
    windows: str, num_clients: int, seed: int, now: float
) -> None:
    """With the fault model's own availability windows (periodic phases, or a device trace's sessions), a batch
    draws the clients, and moves the stream, as successive single draws at the same time do."""
    trace = None
    if windows == "trace":
        trace = TraceWindows(synthetic_trace(7, horizon_s=300.0, online_fraction=0.4, seed=seed), num_clients)
    config = FaultsConfig(availability=AvailabilityConfig(period_s=100.0, online_fraction=0.3))
    faults = FaultModel(config, seed, num_clients, trace=trace)
    layout = np.random.default_rng(seed)
    busy = {int(c) for c in np.flatnonzero(layout.random(num_clients) < layout.random())}
    k = int(layout.integers(1, num_clients + 2))
    single = ClientSampler(np.arange(num_clients), "uniform", np.random.default_rng(seed), availability=faults)
    batched = ClientSampler(np.arange(num_clients), "uniform", np.random.default_rng(seed), availability=faults)
    expected, single_busy = [], set(busy)
    for _ in range(k):
        client = single.sample_idle(single_busy, now)
        if client is None:
            break
        expected.append(client)
        single_busy.add(int(client))
    assert batched.sample_idle_many(busy, now, k) == expected
    assert batched.rng.bit_generator.state == single.rng.bit_generator.state
