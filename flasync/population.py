"""Clients as arrays: sample counts and speeds, and the simulated network.

A client is not an object until it is sampled: the population is a few arrays indexed by client id, so its cost
is a few bytes per client. Durations are simulated seconds on the virtual clock.
"""

from __future__ import annotations

import math

import numpy as np

from flasync import seeding
from flasync.config import ConstantSpeed, HalfNormalSpeed, LogNormalSpeed, NetworkConfig, SpeedConfig

__all__ = ["Network", "Population"]


class Population:
    """Per-client sample counts and speed factors.

    Args:
        sizes: Samples held by each client, shape ``(num_clients,)``.
        speed: The speed model.
        seed: The run's seed (speed draws use their own streams).
    """

    def __init__(self, sizes: np.ndarray, speed: SpeedConfig, seed: int) -> None:
        """Draw per-client speed factors once (lognormal) from the run's seed."""
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.speed = speed
        self.seed = seed
        if isinstance(speed, LogNormalSpeed):
            rng = seeding.numpy_stream(seed, seeding.SPEED)
            self.slowdown = np.exp(rng.normal(0.0, speed.sigma, size=len(self.sizes)))
        else:
            self.slowdown = np.ones(len(self.sizes))

    def __len__(self) -> int:
        """Return the number of clients."""
        return len(self.sizes)

    def train_seconds(self, client_id: int, steps: int, participation: int) -> float:
        """Return simulated seconds of ``client_id``'s ``participation``-th task of ``steps`` local steps."""
        speed = self.speed
        base = steps * speed.seconds_per_step
        if isinstance(speed, ConstantSpeed):
            return base
        draw = seeding.stream_normal(self.seed, seeding.TASK_SPEED, client_id, participation)
        if isinstance(speed, LogNormalSpeed):
            return base * float(self.slowdown[client_id]) * math.exp(speed.jitter * draw)
        if isinstance(speed, HalfNormalSpeed):
            return base * (1.0 + abs(speed.sigma * draw))
        raise AssertionError(f"unhandled speed model {speed!r}")  # pragma: no cover


class Network:
    """Per-client links: transfer time is ``latency + bytes / bandwidth`` in each direction.

    Args:
        config: Medians and log-space spreads.
        num_clients: Population size.
        seed: The run's seed (the draws use their own stream, once per client).
    """

    def __init__(self, config: NetworkConfig, num_clients: int = 1, seed: int = 0) -> None:
        """Draw every client's latency and bandwidths."""
        self.config = config
        rng = seeding.numpy_stream(seed, seeding.NETWORK)
        shape = (num_clients,)
        self.latency_s = config.latency_s * np.exp(rng.normal(0.0, config.latency_sigma, shape))
        spread = np.exp(rng.normal(0.0, config.bandwidth_sigma, (2, num_clients)))
        self.upload_bytes_per_s = config.upload_bytes_per_s * spread[0]
        self.download_bytes_per_s = config.download_bytes_per_s * spread[1]

    def upload_seconds(self, client_id: int, num_bytes: int) -> float:
        """Return simulated seconds for ``client_id`` to upload ``num_bytes``."""
        return float(self.latency_s[client_id] + num_bytes / self.upload_bytes_per_s[client_id])

    def download_seconds(self, client_id: int, num_bytes: int) -> float:
        """Return simulated seconds for ``client_id`` to download ``num_bytes``."""
        return float(self.latency_s[client_id] + num_bytes / self.download_bytes_per_s[client_id])
