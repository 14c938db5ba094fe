"""Staleness weights: how much an update computed on an old model still counts.

The staleness of an update is counted in model versions: ``tau = version_now - base_version``, where
``base_version`` is the version the client trained from. A staleness weight ``s(tau)`` maps it to a factor in
``(0, 1]`` that discounts the update; every weight here gives ``s(0) = 1`` and does not grow with ``tau``.

The three shapes are those of FedAsync (Xie, Koyejo and Gupta, "Asynchronous Federated Optimization", 2019,
arXiv:1903.03934, section 5.2); FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS 2022) uses the polynomial one with ``a = 1/2``, ``s(tau) = 1 / sqrt(1 + tau)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "ConstantStaleness",
    "HingeStaleness",
    "PolynomialStaleness",
    "StalenessWeight",
]


class StalenessWeight(Protocol):
    """Map the staleness of an update (in model versions) to the factor that discounts it."""

    def __call__(self, staleness: int) -> float:
        """Return the weight of an update that is ``staleness`` model versions old.

        Args:
            staleness: ``version_now - base_version``, a non-negative number of model versions.

        Returns:
            The discount factor, in ``(0, 1]`` for the weights flasync ships.

        Raises:
            ValueError: If ``staleness`` is negative.
        """
        ...


def _negative(staleness: int) -> ValueError:
    """The error of a negative ``staleness`` (the weights test the sign inline: they run once per update)."""
    return ValueError(f"staleness must be >= 0 model versions, got {staleness}")


def _check_exponent(name: str, value: float) -> None:
    # `not value >= 0` also catches NaN.
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConstantStaleness:
    """Weigh every update the same, however stale: ``s(tau) = 1``.

    This is FedAsync's constant function (Xie et al., 2019, section 5.2) and turns FedBuff into an unweighted
    buffered mean.
    """

    def __call__(self, staleness: int) -> float:
        """Return ``1.0``.

        Args:
            staleness: Model versions since the client's base model; must be >= 0.

        Returns:
            ``1.0``.

        Raises:
            ValueError: If ``staleness`` is negative.
        """
        if staleness < 0:
            raise _negative(staleness)
        return 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class PolynomialStaleness:
    """Discount an update polynomially in its staleness: ``s(tau) = (1 + tau) ** -a``.

    FedAsync's polynomial function (Xie et al., 2019, section 5.2). FedBuff (Nguyen et al., AISTATS 2022) uses
    ``a = 1/2``, i.e. ``s(tau) = 1 / sqrt(1 + tau)``, which is the default here. ``a = 0`` gives the constant
    weight.

    Attributes:
        a: Exponent of the decay, finite and >= 0.
    """

    a: float = 0.5

    def __post_init__(self) -> None:
        _check_exponent("PolynomialStaleness.a", self.a)

    def __call__(self, staleness: int) -> float:
        """Return ``(1 + staleness) ** -a``.

        Args:
            staleness: Model versions since the client's base model; must be >= 0.

        Returns:
            The weight, in ``(0, 1]``.

        Raises:
            ValueError: If ``staleness`` is negative.
        """
        if staleness < 0:
            raise _negative(staleness)
        return float((1 + staleness) ** -self.a)


@dataclass(frozen=True, slots=True, kw_only=True)
class HingeStaleness:
    """Keep updates up to ``b`` versions old at full weight, then discount them hyperbolically.

    FedAsync's hinge function (Xie et al., 2019, section 5.2)::

        s(tau) = 1                          if tau <= b
        s(tau) = 1 / (a * (tau - b) + 1)    otherwise

    Attributes:
        a: Slope of the decay past the hinge, finite and >= 0 (``a = 0`` gives the constant weight).
        b: Staleness, in model versions, up to which updates keep their full weight; >= 0.
    """

    a: float = 10.0
    b: int = 4

    def __post_init__(self) -> None:
        _check_exponent("HingeStaleness.a", self.a)
        if self.b < 0:
            raise ValueError(f"HingeStaleness.b must be >= 0 model versions, got {self.b}")

    def __call__(self, staleness: int) -> float:
        """Return ``1`` up to ``b`` versions of staleness, ``1 / (a * (staleness - b) + 1)`` past it.

        Args:
            staleness: Model versions since the client's base model; must be >= 0.

        Returns:
            The weight, in ``(0, 1]``.

        Raises:
            ValueError: If ``staleness`` is negative.
        """
        if staleness < 0:
            raise _negative(staleness)
        if staleness <= self.b:
            return 1.0
        return 1.0 / (self.a * (staleness - self.b) + 1.0)
