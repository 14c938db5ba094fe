"""Secure aggregation's section: SecAgg+ among the updates of each round (FedAvg) or each buffer (FedBuff)."""

from __future__ import annotations

from pydantic import Field, model_validator

from flasync.config._base import _FieldError, _Section

__all__ = ["SecureAggregationConfig"]


class SecureAggregationConfig(_Section):
    """Secure aggregation (SecAgg+, Bonawitz et al. CCS 2017; Bell et al. CCS 2020): the server learns the sum of a
    round's (FedAvg) or a buffer's (FedBuff) updates and nothing less. Each client weights its update itself, clips
    every coordinate to ``[-clip, clip]``, encodes it into the ring Z_{2^bits} and masks it; the server unmasks the
    sum once ``threshold`` clients give their shares. ``bits`` must hold the sum of a whole group without overflow,
    which is checked against the group's size."""

    enabled: bool = Field(False, description="Mask every update so the server only learns each group's sum.")
    bits: int = Field(32, ge=16, le=64, description="Bits of the ring Z_{2^bits} updates are encoded into.")
    clip: float = Field(
        1.0, gt=0.0, description="Each coordinate of a weighted update is clipped to [-clip, clip] before encoding."
    )
    neighbours: int | None = Field(
        None,
        ge=2,
        description="SecAgg+: each client masks with and shares among this many neighbours (even); unset: all.",
    )
    threshold: int | None = Field(
        None,
        ge=2,
        description="t: shares that unmask; fewer than t colluding clients and the server learn nothing of one "
        "update (unset: a majority of each client's neighbours).",
    )
    max_dropouts: int = Field(
        1, ge=0, description="D: clients of a group that may drop during the protocol and still be recovered."
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Chance that a member of a group drops out at one of the protocol's four rounds (drawn from the "
        "run's seed per group and client, the round uniformly): up to max_dropouts are recovered, more abandon the "
        "group (its sum is not revealed and the model does not step on it).",
    )
    round_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="Remote clients: seconds of the run's clock (wall seconds with clock = 'wall') each round of "
        "the protocol waits for its members' messages; those that have not answered by then have dropped out.",
    )
    example_weight_scale: float | None = Field(
        None,
        gt=0.0,
        description="A client's example weight is divided by this before masking (weights must land in [0, 1]); "
        "unset: the largest client's sample count, known in simulation.",
    )

    @model_validator(mode="after")
    def _even_degree(self) -> SecureAggregationConfig:
        if self.neighbours is not None and self.neighbours % 2:
            raise _FieldError(
                ("secure_aggregation", "neighbours"), f"must be even (a Harary graph), got {self.neighbours}"
            )
        return self

    def degree(self, group_size: int) -> int:
        """Return each client's neighbours in a group of ``group_size``."""
        every = group_size - 1
        return every if self.neighbours is None else min(self.neighbours, every)

    def effective_threshold(self, group_size: int) -> int:
        """Return ``t`` for a group of ``group_size``: the configured one or a majority of the neighbours."""
        return self.threshold if self.threshold is not None else self.degree(group_size) // 2 + 1

    def check_group(self, group_size: int, where: tuple[str, ...]) -> None:
        """Refuse parameters that cannot protect or unmask a group of ``group_size`` clients.

        Raises:
            _FieldError: The ring overflows, or the threshold and dropouts do not fit the neighbours.
        """
        loc = ("secure_aggregation",)
        if group_size < 3:
            raise _FieldError(where, f"secure aggregation needs groups of at least 3 clients, got {group_size}")
        steps = ((1 << (self.bits - 1)) - 1) // (group_size * self.clip)
        if steps < 1:
            raise _FieldError(
                (*loc, "bits"),
                f"{self.bits} bits cannot sum {group_size} updates in [-{self.clip:g}, {self.clip:g}]: raise bits",
            )
        k, t = self.degree(group_size), self.effective_threshold(group_size)
        if t <= k // 2:
            raise _FieldError(
                (*loc, "threshold"), f"must exceed half of the {k} neighbours (Bell et al. 2020), got {t}"
            )
        if t + self.max_dropouts > k:
            raise _FieldError(
                (*loc, "max_dropouts"),
                f"threshold {t} + max_dropouts {self.max_dropouts} exceeds the {k} neighbours of each client",
            )
