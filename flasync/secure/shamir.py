"""Shamir's t-out-of-n secret sharing over the prime field GF(2^521 - 1).

A secret ``s`` (an integer below ``2^512``, e.g. a 32-byte key) becomes the constant term of a random polynomial
``f`` of degree ``t - 1``; share ``i`` is ``(x_i, f(x_i))`` for distinct non-zero ``x_i``. Any ``t`` shares give
``s = f(0)`` by Lagrange interpolation; fewer reveal nothing about it (Shamir, CACM 1979). Secure aggregation shares
every client's self-mask seed and mask key this way among its neighbours (Bonawitz et al., CCS 2017, section 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from flasync.secure.keys import RandomSource

__all__ = ["PRIME", "SHARE_BYTES", "Share", "reconstruct", "split"]

PRIME = (1 << 521) - 1
"""The field's modulus: the Mersenne prime 2^521 - 1."""

SHARE_BYTES = 66
"""Bytes of one share's value on the wire (521 bits)."""

_SECRET_LIMIT = 1 << 512


class Share(NamedTuple):
    """One point of the sharing polynomial: ``x`` (non-zero) and ``y = f(x)`` in GF(PRIME)."""

    x: int
    y: int


def split(secret: int, xs: Sequence[int], threshold: int, rng: RandomSource) -> list[Share]:
    """Share ``secret`` so that any ``threshold`` of the shares at ``xs`` recover it.

    Args:
        secret: The secret, ``0 <= secret < 2^512``.
        xs: Distinct non-zero evaluation points, one per share holder.
        threshold: Shares needed to recover the secret (``1 <= threshold <= len(xs)``).
        rng: The polynomial's random coefficients.

    Returns:
        One share per point, in the order of ``xs``.

    Raises:
        ValueError: The secret, the points or the threshold are out of range.
    """
    if not 0 <= secret < _SECRET_LIMIT:
        raise ValueError("the secret must be a non-negative integer below 2^512")
    if not 1 <= threshold <= len(xs):
        raise ValueError(f"threshold must be in [1, {len(xs)}], got {threshold}")
    if len(set(xs)) != len(xs) or any(not 0 < x < PRIME for x in xs):
        raise ValueError("share points must be distinct and in [1, PRIME)")
    coefficients = [secret] + [int.from_bytes(rng.bytes(SHARE_BYTES), "little") % PRIME for _ in range(threshold - 1)]
    return [Share(x, _evaluate(coefficients, x)) for x in xs]


def reconstruct(shares: Sequence[Share], threshold: int) -> int:
    """Recover the secret from at least ``threshold`` shares (the first ``threshold`` are used).

    Raises:
        ValueError: Fewer than ``threshold`` shares, or two shares at the same point.
    """
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares cannot recover a secret shared with threshold {threshold}")
    used = shares[:threshold]
    xs = [share.x for share in used]
    if len(set(xs)) != len(xs):
        raise ValueError("two shares at the same point")
    secret = 0
    for i, share in enumerate(used):
        numerator, denominator = 1, 1
        for j, other in enumerate(xs):
            if j != i:
                numerator = numerator * other % PRIME
                denominator = denominator * (other - share.x) % PRIME
        secret = (secret + share.y * numerator * pow(denominator, -1, PRIME)) % PRIME
    return secret


def _evaluate(coefficients: Sequence[int], x: int) -> int:
    """Evaluate the polynomial with ``coefficients`` (constant term first) at ``x`` by Horner's rule."""
    value = 0
    for coefficient in reversed(coefficients):
        value = (value * x + coefficient) % PRIME
    return value
