"""Fixed-point encoding of real vectors into the ring Z_{2^bits}, and the ring's arithmetic.

Secure aggregation masks integers, so every client maps its (weighted, clipped) update into the ring before masking
and the server maps the unmasked sum back (Bonawitz et al., CCS 2017, section 3; Bell et al., CCS 2020). A value
``a`` in ``[-clip, clip]`` is encoded as ``round(a * scale) mod 2^bits`` (two's complement), with

    scale = floor((2^(bits-1) - 1) / (group_size * clip)),

so a sum of at most ``group_size`` encoded values lies in ``[-(2^(bits-1) - 1), 2^(bits-1) - 1]`` and decodes
without wrap-around: overflow is impossible by construction. Each client's rounding error is at most
``0.5 / scale`` per coordinate, a sum's at most ``group_size * 0.5 / scale``.

Ring vectors are ``numpy.uint64`` arrays: ``uint64`` arithmetic is exact modulo ``2^64``, and ``2^bits`` divides
``2^64``, so sums reduce correctly with one final mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["FixedPoint", "RingVector", "pack", "ring_add", "ring_mask", "ring_sub", "ring_sum", "unpack"]

RingVector = npt.NDArray[np.uint64]
"""A vector of the ring Z_{2^bits}, one ``uint64`` a coordinate (the high bits beyond ``bits`` are zero)."""

MIN_BITS = 8
MAX_BITS = 64


def ring_mask(bits: int) -> np.uint64:
    """Return ``2^bits - 1`` as a ``uint64`` (the mask reducing a ``uint64`` modulo ``2^bits``)."""
    return np.uint64((1 << bits) - 1)


def ring_add(a: RingVector, b: RingVector, bits: int) -> RingVector:
    """Return ``a + b mod 2^bits``."""
    total: RingVector = np.bitwise_and(a + b, ring_mask(bits))
    return total


def ring_sub(a: RingVector, b: RingVector, bits: int) -> RingVector:
    """Return ``a - b mod 2^bits``."""
    difference: RingVector = np.bitwise_and(a - b, ring_mask(bits))
    return difference


def ring_sum(vectors: list[RingVector], bits: int) -> RingVector:
    """Return the sum of equally long ring vectors modulo ``2^bits``.

    Raises:
        ValueError: No vector is given.
    """
    if not vectors:
        raise ValueError("ring_sum needs at least one vector")
    total = vectors[0].copy()
    for vector in vectors[1:]:
        total += vector
    return np.bitwise_and(total, ring_mask(bits))


def element_bytes(bits: int) -> int:
    """Return the bytes one ring element takes on the wire."""
    return (bits + 7) // 8


def pack(vector: RingVector, bits: int) -> bytes:
    """Serialize a ring vector little-endian in ``ceil(bits / 8)`` bytes a coordinate."""
    width = element_bytes(bits)
    raw = vector.astype("<u8").view(np.uint8).reshape(-1, 8)[:, :width]
    return raw.tobytes()


def unpack(data: bytes, bits: int) -> RingVector:
    """Read back what :func:`pack` wrote, reduced modulo ``2^bits``.

    Raises:
        ValueError: The length is not a whole number of elements.
    """
    width = element_bytes(bits)
    if len(data) % width:
        raise ValueError(f"{len(data)} bytes are not a whole number of {width}-byte ring elements")
    raw = np.frombuffer(data, dtype=np.uint8).reshape(-1, width)
    full = np.zeros((raw.shape[0], 8), dtype=np.uint8)
    full[:, :width] = raw
    return np.bitwise_and(full.view("<u8").reshape(-1).astype(np.uint64), ring_mask(bits))


@dataclass(frozen=True, slots=True)
class FixedPoint:
    """Encode values in ``[-clip, clip]`` into Z_{2^bits} so that any ``group_size`` of them sum without overflow.

    Attributes:
        bits: The ring's bit width (8 to 64).
        clip: Values are clipped to ``[-clip, clip]`` before encoding.
        group_size: The most encoded values a sum may hold.
    """

    bits: int
    clip: float
    group_size: int

    def __post_init__(self) -> None:
        """Refuse parameters whose quantization step would be zero (see :attr:`scale`)."""
        if not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {self.bits}")
        if not self.clip > 0 or self.group_size < 1:
            raise ValueError("clip must be > 0 and group_size >= 1")
        if self.scale < 1:
            raise ValueError(
                f"{self.bits} bits cannot sum {self.group_size} values in [-{self.clip}, {self.clip}] "
                "with a quantization step of at most 1: raise bits or lower the clipping range"
            )

    @property
    def scale(self) -> int:
        """Return the integer steps per unit: ``floor((2^(bits-1) - 1) / (group_size * clip))``."""
        return int(((1 << (self.bits - 1)) - 1) // (self.group_size * self.clip))

    @property
    def step(self) -> float:
        """Return the quantization step ``1 / scale`` (a client's rounding error is at most half of it)."""
        return 1.0 / self.scale

    def encode(self, values: torch.Tensor) -> RingVector:
        """Clip ``values`` (any float tensor, flattened) to ``[-clip, clip]`` and encode them into the ring."""
        limit = float(((1 << (self.bits - 1)) - 1) // self.group_size)
        if int(limit) > ((1 << (self.bits - 1)) - 1) // self.group_size:  # float64 rounded the bound up
            limit = math.nextafter(limit, 0.0)
        scaled = values.detach().reshape(-1).to(torch.float64).clamp(-self.clip, self.clip) * float(self.scale)
        integers = torch.round(scaled.clamp(-limit, limit)).to(torch.int64).numpy()
        return np.bitwise_and(integers.astype(np.uint64), ring_mask(self.bits))

    def decode(self, vector: RingVector) -> torch.Tensor:
        """Map a ring vector (a sum of at most ``group_size`` encodings) back to float64 values."""
        reduced = np.bitwise_and(vector, ring_mask(self.bits))
        if self.bits == MAX_BITS:
            signed = reduced.view(np.int64)
        else:
            half = np.uint64(1 << (self.bits - 1))
            signed = reduced.astype(np.int64) - np.where(reduced >= half, np.int64(1 << self.bits), np.int64(0))
        return torch.from_numpy(signed.astype(np.float64) / float(self.scale))
