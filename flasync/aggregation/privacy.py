"""Central differential privacy: clipped updates, Gaussian noise at the server, and the privacy spent.

DP-FedAvg (McMahan, Ramage, Talwar and Zhang, "Learning Differentially Private Recurrent Language Models", ICLR
2018) and its buffered asynchronous form DP-FedBuff (Nguyen et al., AISTATS 2022, Section 6): every client update
is clipped to L2 norm ``C`` (the intake does it), a version's weighted sum of at most one update per client gets
Gaussian noise ``N(0, (z C)^2 I)`` and is divided by the fixed count ``K``, and the server optimizer steps with the
result. Staleness weights are at most 1 and example weights are equal, so one client changes the sum by at most
``C`` in L2 norm: each version is a Gaussian mechanism with noise multiplier ``z`` on the clients whose updates it
holds (user-level privacy: a client's whole data set is the unit protected).

The privacy spent is computed by Google's ``dp-accounting`` library (its RDP accountant, Mironov 2017; Mironov,
Talwar and Zhang 2019 for the subsampled Gaussian), never by hand: every version is one Poisson-subsampled
Gaussian event with sampling rate ``q``, composed over the versions made. :func:`sampling_rate` says what ``q`` is
and when the amplification by sampling it claims does not hold (then ``q = 1``: no amplification).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flasync.core.errors import ConfigError

__all__ = [
    "GaussianMechanism",
    "PrivacyAccountant",
    "PrivacyPlan",
    "calibrate_noise_multiplier",
    "sampling_rate",
]

# RDP orders: the integers, where the library's subsampled-Gaussian RDP is an exact finite sum, and a few large
# ones for small noise (fractional orders go through a series that may not converge at small sampling rates).
_ORDERS: tuple[float, ...] = (*(float(a) for a in range(2, 65)), 80.0, 96.0, 128.0, 192.0, 256.0, 512.0, 1024.0)


def _dp_accounting() -> Any:
    try:
        import dp_accounting  # an optional extra, imported only by runs with privacy on
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ConfigError(
            "privacy.enabled needs Google's dp-accounting library: pip install 'flasync[privacy]'"
        ) from exc
    return dp_accounting


def _event(noise_multiplier: float, rate: float) -> Any:
    dpa = _dp_accounting()
    gaussian = dpa.GaussianDpEvent(noise_multiplier)
    return gaussian if rate >= 1.0 else dpa.PoissonSampledDpEvent(rate, gaussian)


class PrivacyAccountant:
    """The privacy spent after ``T`` versions, each a (subsampled) Gaussian mechanism with the same parameters.

    The RDP of one version is computed once by ``dp-accounting``'s ``RdpAccountant``; RDP composes additively, so
    ``T`` versions cost ``T`` times it, and the library's conversion gives epsilon at ``delta`` (microseconds per
    version instead of the milliseconds a fresh composition costs).

    Args:
        noise_multiplier: ``z``: the noise's standard deviation over the clipping norm.
        sampling_rate: ``q``: the probability that a given client's update is in a version (1: no amplification).
        delta: The ``delta`` epsilon is reported at.

    Raises:
        ValueError: If ``noise_multiplier`` is not positive, ``sampling_rate`` not in (0, 1] or ``delta`` not in
            (0, 1).
    """

    def __init__(self, *, noise_multiplier: float, sampling_rate: float, delta: float) -> None:
        if not noise_multiplier > 0:
            raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        self.noise_multiplier = noise_multiplier
        self.sampling_rate = sampling_rate
        self.delta = delta
        dpa = _dp_accounting()
        accountant = dpa.rdp.RdpAccountant(orders=list(_ORDERS))
        accountant.compose(_event(noise_multiplier, sampling_rate))
        self._orders = list(accountant.orders)
        self._rdp_per_version = [float(v) for v in accountant.rdp]
        self._compute_epsilon: Callable[..., tuple[float, float]] = dpa.rdp.rdp_privacy_accountant.compute_epsilon

    def epsilon(self, versions: int) -> float:
        """Return epsilon at :attr:`delta` after ``versions`` versions (0 for none)."""
        if versions <= 0:
            return 0.0
        rdp = [versions * v for v in self._rdp_per_version]
        eps, _ = self._compute_epsilon(self._orders, rdp, self.delta)
        return float(eps)


def calibrate_noise_multiplier(*, target_epsilon: float, delta: float, sampling_rate: float, versions: int) -> float:
    """Return the smallest noise multiplier whose privacy spent after ``versions`` versions is ``target_epsilon``.

    The search is ``dp-accounting``'s ``calibrate_dp_mechanism`` over the same events :class:`PrivacyAccountant`
    composes.

    Raises:
        ConfigError: If no noise multiplier up to 1000 reaches the target.
    """
    dpa = _dp_accounting()

    def fresh() -> Any:
        return dpa.rdp.RdpAccountant(orders=list(_ORDERS))

    def events(z: float) -> Any:
        return dpa.SelfComposedDpEvent(_event(z, sampling_rate), versions)

    try:
        z = dpa.calibrate_dp_mechanism(
            fresh,
            events,
            target_epsilon,
            delta,
            dpa.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(
            f"privacy.target_epsilon: no noise multiplier reaches epsilon {target_epsilon:g} at delta {delta:g} "
            f"over {versions} versions ({exc})"
        ) from exc
    return float(z)


def sampling_rate(*, per_version: int, num_clients: int, uniform: bool) -> float:
    """Return the sampling rate ``q`` the accountant assumes for a version.

    A version holds the updates of ``per_version`` clients (FedAvg's ``clients_per_round`` plus over-selection,
    FedBuff's ``K``) out of ``num_clients``. With uniform sampling the accountant treats the version as Poisson
    sampling with ``q = per_version / num_clients``, the approximation DP-FedAvg makes for fixed-size cohorts. Under
    async dispatch the clients in a version are those that finished in its window, so fast clients are more likely
    to be in it than uniform sampling says; the figure is then an estimate, not a bound. Without uniform sampling
    (weighted, least recently used, availability windows) the sampling amplifies nothing the accountant can count,
    and ``q = 1``: a valid bound for any selection, since a client contributes at most one update per version.
    """
    if not uniform:
        return 1.0
    return min(1.0, per_version / num_clients)


@dataclass(frozen=True, slots=True)
class GaussianMechanism:
    """Noise a version's sum of clipped updates and divide it by a fixed count.

    Attributes:
        clip_norm: ``C``: every update's L2 norm is at most this (the intake clips).
        noise_multiplier: ``z``: the noise's standard deviation is ``z C``.
        denominator: ``K``: the noisy sum is divided by this fixed count, not by the number of updates received
            (which would reveal it).
        generator: The noise's random stream for a version index (deterministic per run and version).
    """

    clip_norm: float
    noise_multiplier: float
    denominator: int
    generator: Callable[[int], torch.Generator]

    def privatize(self, weighted_sum: torch.Tensor, step: int) -> torch.Tensor:
        """Return ``(weighted_sum + N(0, (z C)^2 I)) / K`` for the ``step``-th version (a new tensor)."""
        std = self.noise_multiplier * self.clip_norm
        generator = self.generator(step)
        noise = torch.randn(weighted_sum.shape, generator=generator, dtype=weighted_sum.dtype, device=generator.device)
        noisy = weighted_sum + noise.to(weighted_sum.device).mul_(std)
        return noisy.div_(self.denominator)

    @property
    def std(self) -> float:
        """The noise's standard deviation on the sum."""
        return self.noise_multiplier * self.clip_norm


@dataclass(frozen=True, slots=True)
class PrivacyPlan:
    """A run's differential privacy, resolved: the noise it adds and how its privacy spent is counted.

    Attributes:
        clip_norm: ``C``.
        noise_multiplier: ``z`` (given, or calibrated from a target epsilon).
        sampling_rate: ``q`` the accountant assumes (see :func:`sampling_rate`).
        denominator: ``K``: the fixed count a version's noised sum is divided by.
        accountant: Epsilon at the run's delta after a number of versions.
    """

    clip_norm: float
    noise_multiplier: float
    sampling_rate: float
    denominator: int
    accountant: PrivacyAccountant

    def params(self) -> dict[str, float]:
        """Return what the configuration does not say by itself, as run params."""
        return {
            "privacy.resolved.noise_multiplier": self.noise_multiplier,
            "privacy.resolved.sampling_rate": self.sampling_rate,
            "privacy.resolved.noise_std": self.noise_multiplier * self.clip_norm,
        }
