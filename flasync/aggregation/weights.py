"""Example weights: how much one client's update counts before staleness discounts it.

FLSim splits an update's weight into an *example weight* (how much data stands behind the update) and a
*staleness weight* (how old the model it started from is, :mod:`flasync.aggregation.staleness`); an aggregator
multiplies the two, ``w_k = e_k * s(tau_k)``. FedAvg (McMahan et al., AISTATS 2017) weighs by samples,
``e_k = n_k``; FedBuff (Nguyen et al., AISTATS 2022) by default weighs every update equally, ``e_k = 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["EqualExampleWeight", "ExampleWeight", "SampleExampleWeight"]


class ExampleWeight(Protocol):
    """Map an update's number of training samples to its example weight ``e_k > 0``."""

    def __call__(self, num_samples: int) -> float:
        """Return the example weight of an update trained on ``num_samples`` samples."""
        ...


@dataclass(frozen=True, slots=True)
class EqualExampleWeight:
    """Weigh every update the same: ``e_k = 1``."""

    def __call__(self, num_samples: int) -> float:
        """Return 1."""
        return 1.0


@dataclass(frozen=True, slots=True)
class SampleExampleWeight:
    """Weigh an update by its number of samples: ``e_k = n_k`` (FedAvg's weighting)."""

    def __call__(self, num_samples: int) -> float:
        """Return ``float(num_samples)``."""
        return float(num_samples)
