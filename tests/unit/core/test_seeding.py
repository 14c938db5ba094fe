"""Tests of flasync.core.seeding: independent random streams keyed by purpose and identifiers."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.core import seeding
from flasync.core.seeding import numpy_stream, stream_normal, stream_seed, torch_stream

PROPERTY = settings(max_examples=200, deadline=None)

_SEEDS = st.integers(min_value=0, max_value=2**64 - 1)
_KEYS = st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=4).map(tuple)


@pytest.fixture(autouse=True)
def _global_rngs_restored() -> Iterator[None]:
    """Restore torch's and NumPy's global generators after each test (some tests reseed them on purpose)."""
    state = np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    np.random.set_state(state)


def _torch_draws(seed: int, *key: int) -> torch.Tensor:
    return torch.randint(0, 2**62, (8,), generator=torch_stream(seed, *key))


def _numpy_draws(seed: int, *key: int) -> np.ndarray:
    return numpy_stream(seed, *key).integers(0, 2**62, size=8)


# --------------------------------------------------------------------------------------------- same key
def test_same_key_same_torch_stream() -> None:
    """Two torch generators for the same seed and key draw the same values."""
    assert torch.equal(_torch_draws(42, seeding.TASK, 3, 1), _torch_draws(42, seeding.TASK, 3, 1))


def test_same_key_same_numpy_stream() -> None:
    """Two NumPy generators for the same seed and key draw the same values."""
    assert np.array_equal(_numpy_draws(42, seeding.TASK, 3, 1), _numpy_draws(42, seeding.TASK, 3, 1))


def test_torch_stream_is_seeded_with_stream_seed() -> None:
    """``torch_stream`` seeds its generator with ``stream_seed`` of the same key."""
    assert torch_stream(9, seeding.SERVER).initial_seed() == stream_seed(9, seeding.SERVER)


@PROPERTY
@given(seed=_SEEDS, key=_KEYS)
def test_stream_seed_is_deterministic(seed: int, key: tuple[int, ...]) -> None:
    """``stream_seed`` is a pure function of seed and key."""
    assert stream_seed(seed, *key) == stream_seed(seed, *key)


# ---------------------------------------------------------------------------------------- different key
@pytest.mark.parametrize(
    ("first", "second"),
    [
        ((0, seeding.TASK, 3, 1), (0, seeding.TASK, 4, 1)),
        ((0, seeding.TASK, 3, 1), (0, seeding.TASK, 3, 2)),
        ((0, seeding.TASK, 3, 1), (0, seeding.TASK_SPEED, 3, 1)),
        ((0, seeding.TASK, 3, 1), (1, seeding.TASK, 3, 1)),
        ((0, seeding.TASK, 1, 2), (0, seeding.TASK, 2, 1)),
        ((0, seeding.DATA), (0, seeding.DATA, 0)),
        ((0,), (0, 0)),
    ],
    ids=["client", "participation", "purpose", "seed", "order", "longer-key", "empty-key"],
)
def test_different_keys_give_different_streams(first: tuple[int, ...], second: tuple[int, ...]) -> None:
    """Changing the seed, any key element, their order or the key's length changes both streams."""
    assert not torch.equal(_torch_draws(*first), _torch_draws(*second))
    assert not np.array_equal(_numpy_draws(*first), _numpy_draws(*second))


@PROPERTY
@given(seed=_SEEDS, key=_KEYS, other=_KEYS)
def test_distinct_keys_give_distinct_seeds(seed: int, key: tuple[int, ...], other: tuple[int, ...]) -> None:
    """Two different keys of one seed get different stream seeds."""
    if key != other:
        assert stream_seed(seed, *key) != stream_seed(seed, *other)


@PROPERTY
@given(seed=_SEEDS, other=_SEEDS, key=_KEYS)
def test_distinct_run_seeds_give_distinct_seeds(seed: int, other: int, key: tuple[int, ...]) -> None:
    """One key under two different run seeds gets different stream seeds."""
    if seed != other:
        assert stream_seed(seed, *key) != stream_seed(other, *key)


def test_distinct_clients_give_distinct_seeds() -> None:
    """The task seeds of 10,000 clients are all different."""
    seeds = {stream_seed(0, seeding.TASK, client, 0) for client in range(10_000)}
    assert len(seeds) == 10_000


# ------------------------------------------------------------------------------------------------- range
@PROPERTY
@given(seed=st.integers(min_value=-(2**70), max_value=2**70), key=_KEYS)
def test_stream_seed_is_63_bit(seed: int, key: tuple[int, ...]) -> None:
    """``stream_seed`` is in [0, 2**63), for any integer seed."""
    assert 0 <= stream_seed(seed, *key) < 2**63


def test_stream_seed_uses_the_top_bit_range() -> None:
    """Seeds spread over the whole 63-bit range, not a small corner of it."""
    seeds = [stream_seed(5, seeding.TASK, i) for i in range(1000)]
    assert max(seeds) >= 2**62
    assert min(seeds) < 2**62


# ------------------------------------------------------------------------------------------ stream_normal
@PROPERTY
@given(seed=_SEEDS, key=_KEYS)
@pytest.mark.slow
def test_stream_normal_is_deterministic_and_finite(seed: int, key: tuple[int, ...]) -> None:
    """``stream_normal`` is a pure function of seed and key, and always finite."""
    value = stream_normal(seed, *key)
    assert value == stream_normal(seed, *key)
    assert math.isfinite(value)


def test_stream_normal_differs_between_keys() -> None:
    """Different clients get different draws."""
    draws = {stream_normal(0, seeding.TASK_SPEED, client, 0) for client in range(100)}
    assert len(draws) == 100


def test_stream_normal_is_standard_over_many_keys() -> None:
    """Over 20,000 keys the draws have mean about 0 and standard deviation about 1."""
    draws = [
        stream_normal(2024, seeding.TASK_SPEED, client, participation)
        for client in range(2000)
        for participation in range(10)
    ]
    assert abs(statistics.fmean(draws)) < 0.05
    assert abs(statistics.pstdev(draws) - 1.0) < 0.05


# ------------------------------------------------------------------------------------------ independence
def test_streams_do_not_depend_on_creation_order() -> None:
    """Creating the same streams in reverse order gives each the same values."""
    keys = [(seeding.TASK, client, 0) for client in range(5)]
    forward = {key: _torch_draws(3, *key) for key in keys}
    backward = {key: _torch_draws(3, *key) for key in reversed(keys)}
    assert all(torch.equal(forward[key], backward[key]) for key in keys)


def test_numpy_streams_do_not_depend_on_creation_order() -> None:
    """Creating NumPy streams in reverse order gives each the same values."""
    keys = [(seeding.PARTITION, i) for i in range(5)]
    forward = {key: _numpy_draws(3, *key) for key in keys}
    backward = {key: _numpy_draws(3, *key) for key in reversed(keys)}
    assert all(np.array_equal(forward[key], backward[key]) for key in keys)


def test_streams_do_not_depend_on_interleaved_use() -> None:
    """Drawing from one stream between another's draws does not change the other's values."""
    alone = torch_stream(1, seeding.TASK, 0)
    expected = torch.rand(6, generator=alone)
    interleaved = torch_stream(1, seeding.TASK, 0)
    neighbour = torch_stream(1, seeding.TASK, 1)
    parts = []
    for _ in range(3):
        parts.append(torch.rand(2, generator=interleaved))
        torch.rand(5, generator=neighbour)
    assert torch.equal(torch.cat(parts), expected)


def test_streams_do_not_depend_on_global_generators() -> None:
    """Reseeding torch's and NumPy's global generators does not change any stream."""
    torch.manual_seed(1)
    np.random.seed(1)
    before = (_torch_draws(8, seeding.SPEED), _numpy_draws(8, seeding.SPEED), stream_normal(8, seeding.SPEED))
    torch.manual_seed(2)
    np.random.seed(2)
    torch.rand(10)
    after = (_torch_draws(8, seeding.SPEED), _numpy_draws(8, seeding.SPEED), stream_normal(8, seeding.SPEED))
    assert torch.equal(before[0], after[0])
    assert np.array_equal(before[1], after[1])
    assert before[2] == after[2]


@given(
    seed=st.integers(0, 2**64 - 1),
    keys=st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 10**6)), min_size=1, max_size=50),
)
def test_stream_seeds_mixes_many_keys_as_stream_seed_mixes_each(seed: int, keys: list[tuple[int, int]]) -> None:
    """The array mix gives every key's stream_seed, bit for bit, and its generator draws what torch_stream's does."""
    ids, counters = [k for k, _ in keys], [c for _, c in keys]
    seeds = seeding.stream_seeds(seed, seeding.TASK, ids, counters)
    assert seeds == [stream_seed(seed, seeding.TASK, k, c) for k, c in keys]
    k, c = keys[0]
    assert torch.equal(
        torch.randperm(20, generator=seeding.torch_generator(seeds[0])),
        torch.randperm(20, generator=torch_stream(seed, seeding.TASK, k, c)),
    )
