"""Independent random streams derived from the run's seed.

Every consumer of randomness gets its own stream, keyed by purpose and identifiers, so that results do not depend
on the order in which streams are created or used: ``stream(seed, TASK, task_id)`` is the same generator whichever
client, thread or machine asks for it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "DATA",
    "MODEL_INIT",
    "PARTITION",
    "SERVER",
    "SPEED",
    "TASK",
    "TASK_SPEED",
    "numpy_stream",
    "stream_seed",
    "torch_stream",
]

# Purposes (the first element of a stream's key).
MODEL_INIT = 0
DATA = 1
PARTITION = 2
SPEED = 3
SERVER = 4
TASK = 5
TASK_SPEED = 6


def stream_seed(seed: int, *key: int) -> int:
    """Return a 63-bit integer seed for the stream ``key`` of ``seed``."""
    state = np.random.SeedSequence(seed, spawn_key=key).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def numpy_stream(seed: int, *key: int) -> np.random.Generator:
    """Return a NumPy generator for the stream ``key`` of ``seed``."""
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=key))


def torch_stream(seed: int, *key: int, device: str | torch.device = "cpu") -> torch.Generator:
    """Return a torch generator for the stream ``key`` of ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, *key))
    return generator
