"""Independent random streams derived from the run's seed.

Every consumer of randomness gets its own stream, keyed by purpose and identifiers, so that results do not depend
on the order in which streams are created or used: ``torch_stream(seed, TASK, task_id)`` is the same generator
whichever client, thread or machine asks for it.

Keys are mixed with SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA
2014): a few integer operations per key element, where NumPy's ``SeedSequence`` costs tens of microseconds - which
matters when a stream is made for every client task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "AVAILABILITY",
    "CLIENT_EVAL",
    "CODEC",
    "CONTROL_CODEC",
    "DATA",
    "EDGE_CODEC",
    "FAULTS",
    "MODEL_INIT",
    "NETWORK",
    "PARTITION",
    "PRIVACY",
    "SERVER",
    "SPEED",
    "TASK",
    "TASK_SPEED",
    "numpy_stream",
    "stream_normal",
    "stream_seed",
    "stream_seeds",
    "stream_uniform",
    "torch_generator",
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
NETWORK = 7
CODEC = 8
TOPOLOGY = 9
FAULTS = 10
AVAILABILITY = 11
EDGE_CODEC = 12
DOWNLOAD_CODEC = 13
PRIVACY = 14
CONTROL_CODEC = 15
CLIENT_EVAL = 16
PERSONAL = 17

_MASK = (1 << 64) - 1
_ARRAY_MIX_FROM = 16  # keys from which stream_seeds mixes them as arrays


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix(seed: int, key: tuple[int, ...]) -> int:
    state = _splitmix64(seed & _MASK)
    for part in key:
        state = _splitmix64(state ^ (part & _MASK))
    return state


def stream_seed(seed: int, *key: int) -> int:
    """Return a 63-bit integer seed for the stream ``key`` of ``seed``."""
    return _mix(seed, key) >> 1


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_splitmix64` of every element (uint64 arithmetic wraps modulo 2**64, as the masks do)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def stream_seeds(seed: int, purpose: int, ids: Sequence[int], counters: Sequence[int]) -> list[int]:
    """Return ``stream_seed(seed, purpose, ids[k], counters[k])`` for every ``k``, mixed together in a few array
    operations instead of a dozen integer operations each (e.g. the task streams of a round's clients).

    Args:
        seed: The run's seed.
        purpose: The key's first element (``TASK``, ...).
        ids: The key's second elements (e.g. client ids), each >= 0.
        counters: The key's third elements (e.g. participations), each >= 0, as many as ``ids``.
    """
    if len(ids) < _ARRAY_MIX_FROM:  # the array operations' own cost is that of a dozen keys
        return [stream_seed(seed, purpose, key, counter) for key, counter in zip(ids, counters, strict=True)]
    head = _mix(seed, (purpose,))
    state = np.asarray(ids, dtype=np.uint64) ^ np.uint64(head)
    state = _splitmix64_array(_splitmix64_array(state) ^ np.asarray(counters, dtype=np.uint64))
    seeds: list[int] = (state >> np.uint64(1)).tolist()
    return seeds


def torch_generator(seed: int) -> torch.Generator:
    """Return a CPU torch generator seeded with ``seed`` (one of :func:`stream_seeds`)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def stream_normal(seed: int, *key: int) -> float:
    """Return one standard normal draw for the stream ``key`` of ``seed`` (Box-Muller over two 53-bit uniforms)."""
    state = _mix(seed, key)
    second = _splitmix64(state ^ 0x5851F42D4C957F2D)  # not the state of any small-integer key extension
    u1 = ((state >> 11) + 1) / 9007199254740993.0  # in (0, 1]
    u2 = (second >> 11) / 9007199254740992.0  # in [0, 1)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def stream_uniform(seed: int, *key: int) -> float:
    """Return one uniform draw in ``[0, 1)`` for the stream ``key`` of ``seed`` (53 bits)."""
    return (_mix(seed, key) >> 11) / 9007199254740992.0


def numpy_stream(seed: int, *key: int) -> np.random.Generator:
    """Return a NumPy generator for the stream ``key`` of ``seed``."""
    return np.random.default_rng(_mix(seed, key))


def torch_stream(seed: int, *key: int, device: str | torch.device = "cpu") -> torch.Generator:
    """Return a torch generator for the stream ``key`` of ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, *key))
    return generator
