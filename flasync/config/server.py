"""The server: sync or async aggregation, staleness weights and server optimizers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from flasync.config._base import _FieldError, _Section


class ConstantStalenessConfig(_Section):
    """``s(tau) = 1``."""

    kind: Literal["constant"] = "constant"


class PolynomialStalenessConfig(_Section):
    """``s(tau) = (1 + tau)^-a``."""

    kind: Literal["polynomial"] = "polynomial"
    a: float = Field(0.5, ge=0.0, description="Exponent: s(tau) = (1 + tau)^-a.")


class HingeStalenessConfig(_Section):
    """``s(tau) = 1`` if ``tau <= b`` else ``1 / (a (tau - b) + 1)``."""

    kind: Literal["hinge"] = "hinge"
    a: float = Field(10.0, ge=0.0, description="Slope of the discount after b: s(tau) = 1 / (a (tau - b) + 1).")
    b: int = Field(4, ge=0, description="Staleness up to which an update counts fully.")


StalenessConfig = Annotated[
    ConstantStalenessConfig | PolynomialStalenessConfig | HingeStalenessConfig,
    Field(discriminator="kind"),
]


class SGDServerOptimizer(_Section):
    """``w <- w - lr * m``, ``m <- momentum * m + g`` with ``g`` the averaged client delta (FedAvgM with momentum)."""

    kind: Literal["sgd"] = "sgd"
    lr: float = Field(1.0, gt=0.0, description="Server learning rate applied to the aggregated pseudo-gradient.")
    momentum: float = Field(
        0.0, ge=0.0, lt=1.0, description="Server momentum (0: plain averaging steps; FedAvgM with momentum)."
    )
    nesterov: bool = Field(False, description="Step with g + momentum * m instead of m (needs momentum > 0).")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDServerOptimizer:
        if self.nesterov and self.momentum <= 0:
            raise _FieldError(("server", "optimizer", "nesterov"), "needs momentum > 0")
        return self


class AdamServerOptimizer(_Section):
    """Server Adam on the pseudo-gradient (FedAdam, Reddi et al. 2021); ``eps`` is the paper's adaptivity ``tau``."""

    kind: Literal["adam"] = "adam"
    lr: float = Field(0.01, gt=0.0, description="Server learning rate applied to the aggregated pseudo-gradient.")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Decay of the first-moment estimate (Reddi et al. 2021).")
    beta2: float = Field(0.99, ge=0.0, lt=1.0, description="Decay of the second-moment estimate (Reddi et al. 2021).")
    eps: float = Field(1e-3, gt=0.0, description="The adaptivity tau added to sqrt(v).")


class AdagradServerOptimizer(_Section):
    """FedAdagrad (Reddi et al. 2021, Algorithm 2): ``v <- v + g^2``, ``w <- w - lr m / (sqrt(v) + tau)``."""

    kind: Literal["adagrad"] = "adagrad"
    lr: float = Field(0.01, gt=0.0, description="Server learning rate applied to the aggregated pseudo-gradient.")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="First-moment decay (0: plain Adagrad).")
    tau: float = Field(1e-3, gt=0.0, description="Adaptivity: added to sqrt(v); v starts at tau^2.")


class YogiServerOptimizer(_Section):
    """FedYogi (Reddi et al. 2021, Algorithm 2): ``v <- v - (1 - beta2) g^2 sign(v - g^2)``."""

    kind: Literal["yogi"] = "yogi"
    lr: float = Field(0.01, gt=0.0, description="Server learning rate applied to the aggregated pseudo-gradient.")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Decay of the first-moment estimate (Reddi et al. 2021).")
    beta2: float = Field(0.99, ge=0.0, lt=1.0, description="Decay of the second-moment estimate (Reddi et al. 2021).")
    tau: float = Field(1e-3, gt=0.0, description="Adaptivity: added to sqrt(v); v starts at tau^2.")


ServerOptimizerConfig = Annotated[
    SGDServerOptimizer | AdamServerOptimizer | AdagradServerOptimizer | YogiServerOptimizer,
    Field(discriminator="kind"),
]


class FedAvgServer(_Section):
    """Synchronous FedAvg: sample a cohort per round, wait for it, combine the round's updates, one server step.

    ``aggregation`` combines a round's updates by sample-weighted mean (McMahan et al., AISTATS 2017), or
    coordinate-wise median or trimmed mean (Yin et al., ICML 2018), robust to a minority of broken clients.
    """

    kind: Literal["fedavg"] = "fedavg"
    clients_per_round: int = Field(10, ge=1, description="Clients sampled for each synchronous round.")
    optimizer: ServerOptimizerConfig = SGDServerOptimizer()
    aggregation: Literal["mean", "median", "trimmed_mean"] = Field(
        "mean", description="Combine a round's updates by weighted mean, coordinate-wise median or trimmed mean."
    )
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5, description="trimmed_mean: share cut at each end.")
    min_clients: int | None = Field(
        None,
        ge=1,
        description="Open a round only once this many clients are online (connected remote devices, or simulated "
        "clients inside their availability window); unset: as soon as one is.",
    )
    min_clients_wait_s: float = Field(
        60.0, gt=0.0, description="Longest wait for min_clients before a round opens with the clients online then."
    )


class FedBuffServer(_Section):
    """Buffered asynchronous aggregation (Nguyen et al., AISTATS 2022)."""

    kind: Literal["fedbuff"] = "fedbuff"
    buffer_size: int = Field(10, ge=1, description="K: updates per server step.")
    concurrency: int = Field(20, ge=1, description="C: client tasks in flight.")
    staleness: StalenessConfig = PolynomialStalenessConfig()
    max_staleness: int | None = Field(None, ge=0, description="Drop (and count) older updates.")
    example_weight: Literal["equal", "samples"] = Field(
        "equal", description="How an update counts before its staleness weight: equally, or by the client's samples."
    )
    optimizer: ServerOptimizerConfig = SGDServerOptimizer()


class FedAsyncServer(_Section):
    """Per-update mixing ``w <- (1 - a_tau) w + a_tau w_local`` (Xie et al. 2019)."""

    kind: Literal["fedasync"] = "fedasync"
    alpha: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="Mixing weight of each update into the global model, times its staleness weight (Xie et al. 2019).",
    )
    concurrency: int = Field(20, ge=1, description="Clients training at once.")
    staleness: StalenessConfig = PolynomialStalenessConfig()
    max_staleness: int | None = Field(
        None, ge=0, description="Refuse updates more versions old than this (None: no limit)."
    )


ServerConfig = Annotated[FedAvgServer | FedBuffServer | FedAsyncServer, Field(discriminator="kind")]
