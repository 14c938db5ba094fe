"""Client speeds and simulated links."""

from __future__ import annotations

import math

import numpy as np
import pytest

from flasync.config import ConstantSpeed, HalfNormalSpeed, LogNormalSpeed, NetworkConfig
from flasync.population import Network, Population

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
