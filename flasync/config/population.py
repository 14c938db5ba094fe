"""The simulated clients: who they are, how fast they compute and talk, when they are online and how they fail."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from flasync.config._base import _FieldError, _Section

SamplingStrategy = Literal["uniform", "weighted", "lru", "available"]
"""How the server draws clients: uniformly, weighted by samples, least recently used, or among those online."""
SAMPLING_STRATEGIES: tuple[SamplingStrategy, ...] = ("uniform", "weighted", "lru", "available")


class ConstantSpeed(_Section):
    """Every client takes ``seconds_per_step`` simulated seconds per local step."""

    kind: Literal["constant"] = "constant"
    seconds_per_step: float = Field(
        0.05, gt=0.0, description="Simulated seconds of one local step on a client of speed factor 1."
    )


class LogNormalSpeed(_Section):
    """Each client is slower by a fixed factor ``exp(N(0, sigma))`` drawn once per client (heavy-tailed stragglers).

    ``jitter`` adds a per-task factor ``exp(N(0, jitter))`` on top.
    """

    kind: Literal["lognormal"] = "lognormal"
    seconds_per_step: float = Field(
        0.05, gt=0.0, description="Simulated seconds of one local step on a client of speed factor 1."
    )
    sigma: float = Field(
        1.0, ge=0.0, description="Spread of the clients' slowdown factors (0: every client equally fast)."
    )
    jitter: float = Field(
        0.1, ge=0.0, description="Spread of a per-task slowdown factor on top of the client's own (0: none)."
    )


class HalfNormalSpeed(_Section):
    """Each task takes ``steps * seconds_per_step * (1 + |N(0, sigma)|)`` (the FedBuff paper's timing model)."""

    kind: Literal["halfnormal"] = "halfnormal"
    seconds_per_step: float = Field(
        0.05, gt=0.0, description="Simulated seconds of one local step on a client of speed factor 1."
    )
    sigma: float = Field(
        1.0, ge=0.0, description="Spread of the clients' slowdown factors (0: every client equally fast)."
    )


SpeedConfig = Annotated[ConstantSpeed | LogNormalSpeed | HalfNormalSpeed, Field(discriminator="kind")]


class PopulationConfig(_Section):
    """Who the clients are and how fast they compute."""

    num_clients: int = Field(
        100,
        ge=1,
        le=100_000_000,
        description="Clients in the population (lazy data sources hold a million or more cheaply).",
    )
    speed: SpeedConfig = LogNormalSpeed()
    regions: int | None = Field(
        None, ge=1, description="Give each client a seeded uniform 'region' attribute in 0..regions-1."
    )
    sampling: SamplingStrategy = Field(
        "uniform",
        description="How the server picks clients: uniform, weighted by samples, least recently used, available now.",
    )
    available_fraction: float = Field(
        1.0, gt=0.0, le=1.0, description="Share of its availability period a client is online (1: always)."
    )
    availability_period_s: float = Field(86_400.0, gt=0.0, description="Simulated seconds of one on/off cycle.")
    slow_clients: dict[int, float] = Field(
        default_factory=dict,
        description="Fixed slowdown factors of named clients (client id -> factor), on top of the speed model.",
    )
    trace: str | None = Field(
        None,
        min_length=1,
        description="A device trace (.csv: client, speed, online intervals, optional bandwidths; .json: FedScale's "
        "device files): each client's relative speed replaces the speed model's per-client factor, its online "
        "intervals are the availability windows, its bandwidths (if given) its links' (client k follows trace "
        "client k mod T).",
    )

    @model_validator(mode="after")
    def _check_slow_clients(self) -> PopulationConfig:
        if self.trace is not None and Path(self.trace).suffix.lower() not in (".csv", ".json"):
            raise _FieldError(("population", "trace"), f"unsupported format of {self.trace!r} (use .csv or .json)")
        for client_id, factor in self.slow_clients.items():
            if not 0 <= client_id < self.num_clients:
                raise _FieldError(
                    ("population", "slow_clients"), f"client {client_id} is not in 0..{self.num_clients - 1}"
                )
            if not (math.isfinite(factor) and factor > 0):
                raise _FieldError(("population", "slow_clients"), f"factor of client {client_id} must be > 0")
        return self


class NetworkConfig(_Section):
    """Simulated links: transfer time is ``latency + bytes / bandwidth`` on the virtual clock.

    Each client's latency and bandwidths are the configured medians times ``exp(N(0, sigma))``, drawn once per client
    from the run's seed (``sigma = 0``: every client has the medians).
    """

    latency_s: float = Field(0.05, ge=0.0, description="Median one-way latency.")
    upload_bytes_per_s: float = Field(
        1.25e6, gt=0.0, allow_inf_nan=True, description="Median client uplink (default 10 Mbit/s)."
    )
    download_bytes_per_s: float = Field(
        5.0e6, gt=0.0, allow_inf_nan=True, description="Median client downlink (default 40 Mbit/s)."
    )
    latency_sigma: float = Field(0.0, ge=0.0, le=5.0, description="Log-space spread of latency across clients.")
    bandwidth_sigma: float = Field(0.0, ge=0.0, le=5.0, description="Log-space spread of bandwidth across clients.")


class AvailabilityConfig(_Section):
    """Periodic availability: each client is online for ``online_fraction`` of every ``period_s`` seconds.

    Each client's window starts at its own phase, drawn once from the run's seed. The server samples only online
    clients, and a client whose window closes before its upload is done drops out at that moment.
    """

    period_s: float = Field(gt=0.0, description="Length of one availability cycle, in (simulated) seconds.")
    online_fraction: float = Field(gt=0.0, le=1.0, description="Share of every cycle a client is online.")


class FaultsConfig(_Section):
    """Simulated client failures, drawn per client task from the run's seed (deterministic on the virtual clock).

    For each task one uniform draw ``u`` decides its fate: ``u < crash`` the training raises; then ``hang``
    (the client never answers: only ``resilience.task_timeout_s`` ends the task); then ``dropout`` (the client
    disconnects part-way through training). The three rates must sum to less than 1.
    """

    crash: float = Field(0.0, ge=0.0, lt=1.0, description="Probability that a task's training raises.")
    hang: float = Field(0.0, ge=0.0, lt=1.0, description="Probability that a task never returns.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Probability that a client leaves mid-training.")
    availability: AvailabilityConfig | None = None
    byzantine: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of clients (a fixed set drawn from the seed) that attack with every update.",
    )
    attack: Literal["sign_flip", "scale"] = Field(
        "sign_flip", description="sign_flip: send -attack_factor x the update; scale: send +attack_factor x it."
    )
    attack_factor: float = Field(20.0, gt=0.0, le=1e6, description="How much an attacker scales its update.")

    @model_validator(mode="after")
    def _rates(self) -> FaultsConfig:
        total = self.crash + self.hang + self.dropout
        if not total < 1.0:
            raise _FieldError(("faults",), f"crash + hang + dropout must be < 1, got {total:g}")
        return self
