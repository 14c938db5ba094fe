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
    """Transfer times: ``latency_s + bytes / bytes_per_s`` in each direction."""

    def __init__(self, config: NetworkConfig) -> None:
        """Use one link model for every client."""
        self.config = config

    def upload_seconds(self, client_id: int, num_bytes: int) -> float:
        """Return simulated seconds for ``client_id`` to upload ``num_bytes``."""
        return self.config.latency_s + num_bytes / self.config.upload_bytes_per_s

    def download_seconds(self, client_id: int, num_bytes: int) -> float:
        """Return simulated seconds for ``client_id`` to download ``num_bytes``."""
        return self.config.latency_s + num_bytes / self.config.download_bytes_per_s
