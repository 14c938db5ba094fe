"""Client speeds and simulated links."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flasync.clients.simulated.population import Network, Population
from flasync.config import ConstantSpeed, HalfNormalSpeed, LogNormalSpeed, NetworkConfig
from flasync.core import seeding

SIZES = np.array([10, 20, 30, 40])


def test_constant_speed_is_steps_times_seconds() -> None:
    """Constant speed: every task takes steps * seconds_per_step."""
    population = Population(SIZES, ConstantSpeed(seconds_per_step=0.5), seed=0)
    assert population.train_seconds(2, steps=8, participation=3) == 4.0


def test_lognormal_slowdown_is_fixed_per_client() -> None:
    """Lognormal speed: a client's slowdown is the same in every participation (jitter 0)."""
    population = Population(SIZES, LogNormalSpeed(seconds_per_step=1.0, sigma=1.0, jitter=0.0), seed=0)
    first = [population.train_seconds(c, 1, participation=0) for c in range(4)]
    later = [population.train_seconds(c, 1, participation=5) for c in range(4)]
    assert first == later
    assert len(set(first)) == 4


def test_lognormal_spread_follows_sigma() -> None:
    """Per-client slowdowns have log-standard-deviation close to sigma."""
    sizes = np.ones(20_000, dtype=np.int64)
    population = Population(sizes, LogNormalSpeed(sigma=0.7, jitter=0.0), seed=1)
    assert np.log(population.slowdown).std() == pytest.approx(0.7, rel=0.05)


def test_halfnormal_is_at_least_the_base_time() -> None:
    """Half-normal speed: base * (1 + |N(0, sigma)|) is never below the base and varies per task."""
    population = Population(SIZES, HalfNormalSpeed(seconds_per_step=1.0, sigma=1.0), seed=0)
    times = [population.train_seconds(0, 2, participation=k) for k in range(200)]
    assert min(times) >= 2.0
    assert len(set(times)) == 200
    # E|N(0,1)| = sqrt(2/pi)
    assert np.mean(times) == pytest.approx(2.0 * (1 + math.sqrt(2 / math.pi)), rel=0.15)


def test_speeds_depend_on_seed_only() -> None:
    """The same seed gives the same durations; another seed others."""
    speed = LogNormalSpeed()
    a, b, c = (Population(SIZES, speed, seed=s) for s in (3, 3, 4))
    assert a.train_seconds(1, 5, 2) == b.train_seconds(1, 5, 2) != c.train_seconds(1, 5, 2)


def test_network_without_spread_uses_the_medians() -> None:
    """sigma = 0: transfer time is exactly latency + bytes / bandwidth for every client."""
    network = Network(NetworkConfig(latency_s=0.1, upload_bytes_per_s=1000.0, download_bytes_per_s=4000.0), 3, 0)
    assert network.upload_seconds(2, 500) == pytest.approx(0.6)
    assert network.download_seconds(0, 4000) == pytest.approx(1.1)


def test_network_spread_is_per_client_and_seeded() -> None:
    """sigma > 0: each client has its own latency and bandwidths, drawn from the seed."""
    config = NetworkConfig(latency_sigma=0.5, bandwidth_sigma=0.5)
    one, same, other = Network(config, 1000, 7), Network(config, 1000, 7), Network(config, 1000, 8)
    assert np.array_equal(one.upload_bytes_per_s, same.upload_bytes_per_s)
    assert not np.array_equal(one.upload_bytes_per_s, other.upload_bytes_per_s)
    assert len(np.unique(one.latency_s)) == 1000
    assert np.median(one.download_bytes_per_s) == pytest.approx(config.download_bytes_per_s, rel=0.1)
    assert one.upload_seconds(5, 10_000) != one.upload_seconds(6, 10_000)


def test_fewer_bytes_take_less_time() -> None:
    """Transfer time grows with the payload, so compression shortens simulated time."""
    network = Network(NetworkConfig(bandwidth_sigma=0.3), 10, 0)
    assert network.upload_seconds(3, 1_000) < network.upload_seconds(3, 100_000)


# ------------------------------------------------------------------------------------------- sampling at scale
def _population(n: int, **kwargs: float) -> Population:
    return Population(np.arange(1, n + 1, dtype=np.int64), ConstantSpeed(), seed=0, **kwargs)


@pytest.mark.parametrize("strategy", ["uniform", "weighted", "lru", "available"])
def test_every_strategy_draws_distinct_eligible_clients(strategy: str) -> None:
    """k distinct ids, none excluded, whatever the strategy."""
    population = _population(1000, available_fraction=0.5, availability_period_s=10.0)
    rng = np.random.default_rng(0)
    excluded = set(range(0, 1000, 3))
    for step in range(5):
        drawn = population.sample(200, rng, strategy=strategy, now=float(step), exclude=excluded)  # type: ignore[arg-type]
        assert len(drawn) == 200 == len(set(drawn.tolist()))
        assert not set(drawn.tolist()) & excluded
        population.mark_used(drawn)


@pytest.mark.parametrize("strategy", ["uniform", "weighted", "lru", "available"])
def test_clients_in_flight_are_excluded_alike_as_a_mapping_a_set_or_a_list(strategy: str) -> None:
    """The registry's tasks by client (a mapping, looked up as it is) exclude the same clients as a set or a list of
    their ids: the same draws, the random stream left in the same state."""
    tasks = {client: f"task {client}" for client in range(0, 300, 2)}
    draws: list[list[list[int]]] = []
    for exclude in (tasks, set(tasks), list(tasks)):
        population = _population(300, available_fraction=0.5, availability_period_s=10.0)
        rng = np.random.default_rng(3)
        drawn = []
        for step in range(20):
            one = population.sample(7, rng, strategy=strategy, now=float(step), exclude=exclude)  # type: ignore[arg-type]
            population.mark_used(one)
            drawn.append(one.tolist())
        drawn.append(rng.integers(1 << 30, size=3).tolist())
        draws.append(drawn)
    assert draws[0] == draws[1] == draws[2]
    assert not {c for step in draws[0][:-1] for c in step} & set(tasks)


def test_too_many_clients_or_an_unknown_strategy_is_an_error() -> None:
    """Drawing more clients than are eligible, or by an unknown rule, raises ValueError naming the problem."""
    population = _population(10)
    with pytest.raises(ValueError, match="cannot draw 9 clients from 10 with 2 excluded"):
        population.sample(9, np.random.default_rng(0), exclude={1, 2})
    with pytest.raises(ValueError, match="unknown sampling strategy 'best'"):
        population.sample(1, np.random.default_rng(0), strategy="best")  # type: ignore[arg-type]


def test_weighted_sampling_follows_sample_counts() -> None:
    """With sizes 1 and 9, the larger client is drawn first about 90% of the time."""
    population = Population(np.array([1, 9]), ConstantSpeed(), seed=0)
    rng = np.random.default_rng(0)
    draws = [int(population.sample(1, rng, strategy="weighted")[0]) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(0.9, abs=0.02)


def test_least_recently_used_cycles_through_everyone() -> None:
    """LRU draws every client once before any twice, then the oldest first; excluded ones come back later."""
    population = _population(10)
    rng = np.random.default_rng(0)
    first = population.sample(4, rng, strategy="lru", exclude={7})
    population.mark_used(first)
    second = population.sample(5, rng, strategy="lru", exclude={7})
    population.mark_used(second)
    assert sorted([*first.tolist(), *second.tolist()]) == [c for c in range(10) if c != 7]
    assert population.sample(1, rng, strategy="lru").tolist() == [7]  # never used: ahead of everyone
    population.mark_used([7])
    assert population.sample(4, rng, strategy="lru").tolist() == first.tolist()  # then oldest use first


def test_marking_clients_one_at_a_time_is_marking_them_in_one_array() -> None:
    """A dispatch marks one client (the registry's path, with scalar stores): over enough uses that the queue is
    compacted and grown, the LRU draws equal those of a population given the same clients in arrays."""
    one, arrays = _population(50), _population(50)
    rng_one, rng_arrays = np.random.default_rng(1), np.random.default_rng(1)
    for _ in range(150):  # 3,000 uses of 50 clients: past the queue's first 1,024 entries more than once
        drawn_one = one.sample(20, rng_one, strategy="lru")
        drawn_arrays = arrays.sample(20, rng_arrays, strategy="lru")
        assert drawn_one.tolist() == drawn_arrays.tolist()
        for client in drawn_one.tolist():
            one.mark_used([client])
        arrays.mark_used(drawn_arrays)
    assert one.last_used is not None and arrays.last_used is not None
    assert one.last_used.tolist() == arrays.last_used.tolist()
    assert one.sample(50, rng_one, strategy="lru").tolist() == arrays.sample(50, rng_arrays, strategy="lru").tolist()


def _least_recently_used_by_hand(population: Population, k: int, excluded: set[int]) -> list[int]:
    """The first ``k`` of the LRU order, not excluded: never-used clients in the fixed random order (a permutation
    from the server's stream of the run's seed), then used ones by last use, oldest first."""
    n = len(population)
    last_used = population.last_used if population.last_used is not None else np.full(n, -1)
    order = seeding.numpy_stream(population.seed, seeding.SERVER, 1).permutation(n).tolist()
    fresh = [c for c in order if last_used[c] == -1 and c not in excluded]
    used = sorted((c for c in range(n) if last_used[c] != -1 and c not in excluded), key=lambda c: int(last_used[c]))
    return (fresh + used)[:k]


@pytest.mark.parametrize("k", [1, 3, 8, 12, 40])
def test_least_recently_used_draws_follow_the_lru_order_with_any_clients_excluded(k: int) -> None:
    """Draws of a few clients (read one by one) and of many (a block at a time) are the first ``k`` of the LRU order
    not excluded, whoever is excluded: never-used clients too, deferred while excluded and drawn first later."""
    population = _population(200)
    rng, chance = np.random.default_rng(0), np.random.default_rng(k)
    for _ in range(60):
        excluded = set(chance.choice(200, size=int(chance.integers(0, 60)), replace=False).tolist())
        drawn = population.sample(k, rng, strategy="lru", exclude=excluded).tolist()
        assert drawn == _least_recently_used_by_hand(population, k, excluded)
        population.mark_used(drawn[: len(drawn) // 2 + 1])  # some drawn clients are not dispatched


@pytest.mark.parametrize(("num_clients", "concurrency"), [(40, 40), (60, 25), (300, 120)])
@pytest.mark.slow
def test_following_the_tasks_in_flight_draws_what_walking_past_them_draws(num_clients: int, concurrency: int) -> None:
    """A population following the tasks in flight (as the registry keeps them: dispatch marks used, release marks
    idle) draws, with them excluded, the clients one that walks past them draws: over thousands of tasks released
    in random order, cohorts of several clients, and the released heap compacted more than once."""
    following, walking = _population(num_clients), _population(num_clients)
    in_flight: dict[int, int] = {}
    following.follow_tasks(in_flight)
    order = np.random.default_rng(num_clients)
    rng = np.random.default_rng(0)
    drawn_at_once = [1, 1, 1, 3, 12]  # up to 8 never-used clients are read one by one, more a block at a time
    for step in range(3000):
        room = concurrency - len(in_flight)
        k = min(room, drawn_at_once[step % len(drawn_at_once)])
        if k:
            expected = _least_recently_used_by_hand(walking, k, set(in_flight))
            drawn = following.sample(k, rng, strategy="lru", exclude=in_flight)
            assert drawn.tolist() == walking.sample(k, rng, strategy="lru", exclude=set(in_flight)).tolist()
            assert drawn.tolist() == expected
            for client in drawn.tolist():
                in_flight[client] = step
            following.mark_used(drawn.tolist() if k > 1 else [int(drawn[0])])
            walking.mark_used(drawn)
        for client in order.permutation(list(in_flight))[: int(order.integers(0, 3))].tolist():  # random releases
            del in_flight[client]
            following.mark_idle(client)
    assert following.last_used is not None and walking.last_used is not None
    assert following.last_used.tolist() == walking.last_used.tolist()
    assert following._idle is not None and len(following._idle) <= 2 * num_clients + 64  # stale entries dropped


def test_a_fully_used_population_following_its_tasks_draws_the_idle_ones_by_last_use() -> None:
    """Once every client was used, refills of the free slots (the async policy's draws of the idle clients, one or
    several) are the first idle clients of the LRU order, as a walk past the busy ones finds them."""
    population = _population(30)
    in_flight: dict[int, int] = {}
    population.follow_tasks(in_flight)
    rng, order = np.random.default_rng(0), np.random.default_rng(1)
    for step in range(400):
        k = 30 - len(in_flight) if step % 7 else min(1, 30 - len(in_flight))
        expected = _least_recently_used_by_hand(population, k, set(in_flight))
        drawn = population.sample_idle_many(in_flight, 0.0, k, rng, strategy="lru")
        assert drawn == expected
        in_flight.update(dict.fromkeys(drawn, step))
        population.mark_used(drawn)
        for client in order.permutation(list(in_flight))[: int(order.integers(1, 6))].tolist():
            del in_flight[client]
            population.mark_idle(client)
    assert population._fresh is not None and population._fresh_head == len(population._fresh)  # all used


def test_the_least_recent_idle_client_is_the_draw_of_one_once_every_client_was_used() -> None:
    """:meth:`Population.least_recent_idle` answers a draw of one that excludes the followed tasks in flight with
    the client :meth:`Population.sample_idle_many` draws, once every client was used; before that, or for another
    exclusion, it has no answer (None) and the general draw is made."""
    population = _population(12)
    in_flight: dict[int, int] = {}
    population.follow_tasks(in_flight)
    rng, order = np.random.default_rng(0), np.random.default_rng(1)
    answered = 0
    for step in range(300):
        fresh = population._fresh
        every_used = fresh is not None and population._fresh_head == len(fresh) and not population._deferred
        quick = population.least_recent_idle(in_flight)
        assert population.least_recent_idle(set(in_flight)) is None  # not the followed tasks themselves
        if len(in_flight) < 12:
            (drawn,) = population.sample_idle_many(in_flight, 0.0, 1, rng, strategy="lru")
            assert quick == (drawn if every_used else None)
            answered += quick is not None
            in_flight[drawn] = step
            population.mark_used([drawn])
        else:
            assert quick is None  # no idle client
        for client in order.permutation(list(in_flight))[: int(order.integers(0, 2))].tolist():
            del in_flight[client]
            population.mark_idle(client)
    assert answered > 100


def test_a_draw_excluding_other_clients_than_those_followed_walks_the_queue() -> None:
    """Only a draw that excludes the followed tasks in flight themselves skips the busy clients: a draw with no
    exclusion (a round's cohort) still sees every used client, busy ones included."""
    population = _population(10)
    in_flight: dict[int, int] = {}
    population.follow_tasks(in_flight)
    rng = np.random.default_rng(0)
    first = population.sample(10, rng, strategy="lru").tolist()
    population.mark_used(first)
    in_flight.update(dict.fromkeys(first, 0))
    for client in first[5:]:
        del in_flight[client]
        population.mark_idle(client)
    assert population.sample(3, rng, strategy="lru", exclude=in_flight).tolist() == first[5:8]
    assert population.sample(3, rng, strategy="lru").tolist() == first[:3]  # the busy ones are the oldest
    with pytest.raises(RuntimeError, match="before the first client"):
        population.follow_tasks({})


def test_available_now_follows_the_phases() -> None:
    """Available-now draws only online clients while enough are online, and fills with offline ones otherwise."""
    population = _population(1000, available_fraction=0.2, availability_period_s=100.0)
    rng = np.random.default_rng(0)
    drawn = population.sample(50, rng, strategy="available", now=30.0)
    assert population.available(drawn, 30.0).all()
    online = int(population.available(np.arange(1000), 30.0).sum())
    everyone = population.sample(online + 10, rng, strategy="available", now=30.0)
    assert int(population.available(everyone, 30.0).sum()) == online


def test_a_million_clients_cost_tens_of_bytes_each() -> None:
    """Population arrays, LRU state and weights included, stay under 100 bytes per client."""
    population = _population(1_000_000, available_fraction=0.5)
    rng = np.random.default_rng(0)
    population.mark_used(population.sample(1000, rng, strategy="weighted"))
    population.mark_used(population.sample(1000, rng, strategy="lru"))
    assert population.nbytes < 100 * 1_000_000


async def test_lru_sampling_in_a_sync_run_visits_every_client() -> None:
    """FedAvg with LRU sampling: 4 rounds of 5 over 20 clients dispatch each client exactly once."""
    import flasync
    from flasync.core.events import TaskAssigned
    from flasync.testing import EventRecorder, small_config

    config = small_config(
        "population.sampling=lru", "stop.max_versions=4", server={"kind": "fedavg", "clients_per_round": 5}
    )
    federation = flasync.Federation(config)
    recorder = EventRecorder(federation.bus)
    await federation.run()
    assert sorted(task.client_id for task in recorder.of(TaskAssigned)) == list(range(20))


@pytest.mark.parametrize("server", ["fedbuff", "fedavg"])
async def test_async_slots_draw_lru_clients_past_those_in_flight_from_the_released(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FedBuff run with LRU sampling follows its tasks in flight: once every client was used, its slots' draws take
    the idle clients from the released ones (what the sampler takes is counted, a slot at a time or several);
    FedAvg's cohorts exclude no one, so its runs follow nothing."""
    import flasync
    from flasync.clients.simulated._idle import IdleByLastUse
    from flasync.testing import small_config

    taken: list[int] = []
    take, oldest = IdleByLastUse.take, IdleByLastUse.oldest

    def counted(self: IdleByLastUse, k: int, chosen: list[int], drawn: set[int], last_used: memoryview) -> None:
        before = len(chosen)
        take(self, k, chosen, drawn, last_used)
        taken.extend(chosen[before:])

    def counted_one(self: IdleByLastUse, last_used: memoryview) -> int | None:
        client = oldest(self, last_used)
        taken.extend([] if client is None else [client])
        return client

    monkeypatch.setattr(IdleByLastUse, "take", counted)
    monkeypatch.setattr(IdleByLastUse, "oldest", counted_one)
    aggregator = (
        {"kind": "fedbuff", "buffer_size": 2, "concurrency": 10}
        if server == "fedbuff"
        else {"kind": "fedavg", "clients_per_round": 10}
    )
    config = small_config("population.sampling=lru", "stop.max_versions=12", server=aggregator)
    await flasync.Federation(config).run()
    if server == "fedbuff":
        assert len(taken) > 10 and set(taken) <= set(range(20))
    else:
        assert taken == []


def test_slow_clients_multiply_their_training_time() -> None:
    """A fixed slowdown factor multiplies one client's simulated training time and no other's."""
    speed = ConstantSpeed(seconds_per_step=0.5)
    plain = Population(SIZES, speed, seed=0)
    slowed = Population(SIZES, speed, seed=0, slow_clients={2: 3.0})
    assert slowed.train_seconds(2, steps=8, participation=0) == 3.0 * plain.train_seconds(2, steps=8, participation=0)
    assert slowed.train_seconds(1, steps=8, participation=0) == plain.train_seconds(1, steps=8, participation=0)


def test_a_groups_link_times_in_one_pass_are_each_clients_own() -> None:
    """upload_seconds_many and download_seconds_many give every client's upload_seconds and download_seconds, bit
    for bit (a cohort's timeline must not depend on being computed together)."""
    network = Network(NetworkConfig(latency_sigma=0.5, bandwidth_sigma=0.5), 50, 3)
    clients = [7, 3, 49, 0, 7]
    sizes = [11_320, 1, 0, 10**9, 123_457]
    assert network.upload_seconds_many(clients, sizes) == [
        network.upload_seconds(c, b) for c, b in zip(clients, sizes, strict=True)
    ]
    assert network.download_seconds_many(clients, 11_320) == [network.download_seconds(c, 11_320) for c in clients]


@pytest.mark.parametrize("links", ["drawn", "drawn in blocks", "traced"])
def test_link_times_of_small_and_large_groups_are_each_clients_own(links: str) -> None:
    """A group's link times, whether read as Python floats (a few clients) or as arrays (many), equal each client's
    own bit for bit: for a population's links held whole, drawn block by block, or cycled from a device trace."""
    config = NetworkConfig(latency_sigma=0.5, bandwidth_sigma=0.5)
    trace = (np.array([1e5, 3e6, 7.5e4]), np.array([2e6, 9e5, 4e7])) if links == "traced" else None
    count = 70_000 if links == "drawn in blocks" else 300
    network = Network(config, count, 5, trace_links=trace)
    rng = np.random.default_rng(11)
    for size in (1, 3, 15, 16, 40):
        clients = rng.integers(0, count, size=size).tolist()
        sizes = rng.integers(0, 10**9, size=size).tolist()
        assert network.upload_seconds_many(clients, sizes) == [
            network.upload_seconds(c, b) for c, b in zip(clients, sizes, strict=True)
        ]
        assert network.download_seconds_many(clients, sizes[0]) == [
            network.download_seconds(c, sizes[0]) for c in clients
        ]


@pytest.mark.parametrize(
    "speed",
    [
        ConstantSpeed(seconds_per_step=0.37),
        LogNormalSpeed(seconds_per_step=0.21, sigma=0.8, jitter=0.3),
        HalfNormalSpeed(seconds_per_step=0.13, sigma=0.6),
    ],
    ids=["constant", "lognormal", "halfnormal"],
)
@pytest.mark.parametrize("clients", ["plain", "slow clients", "traced", "drawn in blocks"])
def test_a_groups_training_times_in_one_pass_are_each_tasks_own(speed: object, clients: str) -> None:
    """train_seconds_many gives every task's train_seconds bit for bit, from the same per-task draws, for every speed
    model, with fixed slowdowns, a device trace's slowdowns or speed factors drawn block by block."""
    count = 70_000 if clients == "drawn in blocks" else 300
    population = Population(
        np.full(count, 10),
        speed,  # type: ignore[arg-type]
        seed=9,
        slow_clients={3: 2.5, 17: 0.75} if clients == "slow clients" else None,
        trace_slowdown=np.array([1.0, 3.3, 0.6]) if clients == "traced" else None,
    )
    rng = np.random.default_rng(4)
    for size in (0, 1, 3, 16, 40):
        ids = rng.integers(0, count, size=size).tolist() + ([3, 17] if size else [])
        steps = rng.integers(1, 500, size=len(ids)).tolist()
        participations = rng.integers(0, 50, size=len(ids)).tolist()
        assert population.train_seconds_many(ids, steps, participations) == [
            population.train_seconds(c, n, p) for c, n, p in zip(ids, steps, participations, strict=True)
        ]
    with pytest.raises(ValueError, match="2 clients, 1 step counts and 2 participations"):
        population.train_seconds_many([1, 2], [5], [0, 0])
    with pytest.raises(ValueError, match="2 clients, 2 step counts and 1 participations"):
        population.train_seconds_many([1, 2], [5, 5], [0])


@pytest.mark.parametrize("num_clients", [30, 150])
def test_least_recently_used_cohorts_without_exclusion_follow_the_lru_order(num_clients: int) -> None:
    """Rounds' cohorts (no client excluded), of any size up to the whole population and with some drawn clients
    not dispatched, are the first clients of the LRU order, read a block of the used clients' queue at a time."""
    population = _population(num_clients)
    rng, chance = np.random.default_rng(0), np.random.default_rng(num_clients)
    for _ in range(80):
        k = int(chance.integers(1, num_clients + 1))
        drawn = population.sample(k, rng, strategy="lru").tolist()
        assert drawn == _least_recently_used_by_hand(population, k, set())
        population.mark_used(drawn if chance.random() < 0.7 else drawn[: k // 2 + 1])
