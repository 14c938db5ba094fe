"""Secure aggregation of synchronous rounds and of FedBuff buffers, with simulated clients and their costs.

:class:`SecureAggregator` runs one group (a FedAvg round's cohort, or one buffer's clients) through SecAgg+ with
the protocol's real cryptography, draws the clients' dropouts from the run's seed, and prices every protocol round
on the network model (:func:`~flasync.secure.group.phase_seconds`), so a simulation shows what secure aggregation
costs in bytes and simulated seconds.

:class:`SecureBuffer` is buffered asynchronous aggregation (FedBuff, Nguyen et al., AISTATS 2022) under secure
aggregation. The group whose sum is revealed is the buffer: the first ``K`` clients to finish training after the
previous buffer closed. While a buffer fills the model's version cannot change (FedBuff steps only when a buffer is
full), so when the ``K``-th client arrives the server names the version ``v`` the buffer will step from; each client
computes its staleness ``v - base`` and weights its own update (staleness weight times example weight) before
masking, which is exactly FedBuff's weighting, and the server learns only the buffer's weighted sum and its total
weight. The price is that a client waits, online, from the end of its training until its buffer is full, then takes
part in the protocol's four rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flasync.secure.group import GroupResult, Phase, PhaseCost, WeightedEncoding, phase_seconds, run_group
from flasync.secure.keys import SeededRandom
from flasync.secure.protocol import GroupParams, neighbour_graph
from flasync.secure.ring import RingVector, element_bytes

__all__ = ["ClientUpdate", "GroupReport", "Link", "SecureAggregator", "SecureBuffer", "WaitingUpdate"]


@dataclass(frozen=True, slots=True)
class Link:
    """The network the protocol's messages cross: bandwidths in bytes per second and one-way latency in seconds.

    The defaults are ``[network]``'s medians (10 Mbit/s up, 40 Mbit/s down, 50 ms).
    """

    upload_bytes_per_s: float = 1.25e6
    download_bytes_per_s: float = 5.0e6
    latency_s: float = 0.05


@dataclass(frozen=True, slots=True)
class ClientUpdate:
    """One client's input to a group: its delta, the weight it applies before masking and its share of the divisor.

    Attributes:
        client: The client's id.
        delta: Its update.
        weight: Multiplies the delta before masking, in ``[0, 1]``.
        example_weight: What the client adds to the divisor, in ``[0, 1]`` (None: ``weight``).
    """

    client: int
    delta: torch.Tensor
    weight: float
    example_weight: float | None = None


@dataclass(frozen=True, slots=True)
class GroupReport:
    """What one secure group gave and cost.

    Attributes:
        group: The group's id (round or buffer index).
        weighted_sum: ``sum_u w_u delta_u`` of the survivors, float32 (None: the group was abandoned).
        total_weight: ``sum_u e_u``, the survivors' example weights (the mean's divisor).
        survivors: Clients whose updates are in the sum.
        recovered: Clients that dropped after sharing and whose masks were removed with the others' shares.
        dropped: Clients that dropped at some round of the protocol.
        reason: Why the group was abandoned (empty when it was not).
        phase_bytes: Bytes both ways of each protocol round.
        phase_s: Simulated seconds of each protocol round.
        plain_upload_bytes: What the survivors' updates would have cost as plain float32 uploads.
        upload_bytes: Each member's bytes to the server over the four rounds.
        download_bytes: Each member's bytes from the server over the four rounds.
    """

    group: int
    weighted_sum: torch.Tensor | None
    total_weight: float
    survivors: frozenset[int]
    recovered: frozenset[int]
    dropped: frozenset[int]
    reason: str
    phase_bytes: Mapping[str, int]
    phase_s: Mapping[str, float]
    plain_upload_bytes: int
    upload_bytes: Mapping[int, int] = field(default_factory=dict)
    download_bytes: Mapping[int, int] = field(default_factory=dict)

    @property
    def abandoned(self) -> bool:
        """Return whether the group ended without a sum."""
        return self.weighted_sum is None

    def figures(self) -> dict[str, float]:
        """Return the group's figures for one log line (dotted metric keys under ``secagg.``).

        Bytes and simulated seconds of each protocol round, clients dropped and recovered, whether the group was
        abandoned, and the overhead: all protocol bytes over what the survivors' plain float32 uploads would be.
        """
        figures: dict[str, float] = {}
        for phase, nbytes in self.phase_bytes.items():
            figures[f"secagg.{phase}_bytes"] = float(nbytes)
            figures[f"secagg.{phase}_s"] = self.phase_s[phase]
        figures["secagg.dropped"] = float(len(self.dropped))
        figures["secagg.recovered"] = float(len(self.recovered))
        figures["secagg.abandoned"] = float(self.abandoned)
        if self.plain_upload_bytes:
            figures["secagg.bytes_ratio"] = sum(self.phase_bytes.values()) / self.plain_upload_bytes
        return figures

    def log(self, log: Any, *, step: int) -> None:
        """Write :meth:`figures` as one ``secagg`` line; the tracking processor makes each field a metric, e.g.
        ``secagg/share_bytes`` (dots become slashes in MLflow keys)."""
        figures = {key.removeprefix("secagg."): value for key, value in self.figures().items()}
        log.info("secagg", step=step, group=self.group, **figures)

    def mean(self) -> torch.Tensor | None:
        """Return the weighted mean ``sum w delta / sum e`` (None: abandoned, or no weight)."""
        if self.weighted_sum is None or self.total_weight <= 0.0:
            return None
        return self.weighted_sum / self.total_weight


class SecureAggregator:
    """Run groups of simulated clients through SecAgg+ and report their sums and costs.

    Args:
        bits: The ring's bit width.
        clip: Each weighted coordinate is clipped to ``[-clip, clip]``.
        group_size: The largest group (the encoding holds its sum without overflow).
        threshold: Shares that unmask a seed or a key.
        neighbours: Each client's neighbours (None: every other member).
        seed: Every key, seed, neighbour graph and dropout is drawn from it (per group and client).
        link: The network the messages cross.
        dropout_rate: Chance that a client drops at some round of the protocol (drawn per group and client).
    """

    def __init__(
        self,
        *,
        bits: int,
        clip: float,
        group_size: int,
        threshold: int,
        neighbours: int | None,
        seed: int,
        link: Link,
        dropout_rate: float = 0.0,
    ) -> None:
        """Bind the parameters."""
        self.encoding = WeightedEncoding.create(bits, clip, group_size)
        self.bits = bits
        self.group_size = group_size
        self.threshold = threshold
        self.neighbours = neighbours
        self.seed = seed
        self.link = link
        self.dropout_rate = dropout_rate

    def drops(self, group: int, clients: Sequence[int]) -> dict[int, Phase]:
        """Return the round each dropping client of ``group`` stops at (the same for the same seed)."""
        drops: dict[int, Phase] = {}
        for client in clients:
            draw = np.random.default_rng((self.seed, group, client, 1)).random(2)
            if draw[0] < self.dropout_rate:
                drops[client] = Phase(int(draw[1] * len(Phase)))
        return drops

    def aggregate(
        self,
        group: int,
        updates: Sequence[ClientUpdate],
        *,
        drops: Mapping[int, Phase] | None = None,
        announce_bytes: int = 0,
        observe: Callable[[int, RingVector], None] | None = None,
        price: Callable[[PhaseCost], float] | None = None,
    ) -> GroupReport:
        """Run ``updates``' clients through the protocol as group ``group``; return the sum and the costs.

        Args:
            group: The group's id: keys, masks and graph are drawn for it alone.
            updates: Each member's update and weight (at most ``group_size``).
            drops: Who drops at which round (None: drawn with :meth:`drops`).
            announce_bytes: What the server sends each member with round 0 beside the keys (a buffer's version).
            observe: Called with each masked input the server receives (see :class:`SecAggServer`).
            price: A round's simulated seconds from its bytes per client (None: :func:`phase_seconds` on ``link``).

        Raises:
            ValueError: More members than ``group_size``, or one client twice.
        """
        clients = [u.client for u in updates]
        if len(updates) > self.group_size or len(set(clients)) != len(clients):
            raise ValueError(f"a group takes at most {self.group_size} distinct clients, got {clients}")
        num_params = int(updates[0].delta.numel())
        order = list(np.random.default_rng((self.seed, group, 0)).permutation(len(clients)))
        params = GroupParams(
            group_id=b"flasync-group-" + group.to_bytes(8, "little"),
            bits=self.bits,
            length=self.encoding.length(num_params),
            threshold=self.threshold,
            neighbours=neighbour_graph(clients, self.neighbours, order),
        )
        inputs = {u.client: self.encoding.encode(u.delta, u.weight, u.example_weight) for u in updates}
        rngs = {c: SeededRandom((self.seed, group, c, 2)) for c in clients}
        drops = self.drops(group, clients) if drops is None else drops
        result = run_group(params, inputs, rngs, drops=drops, observe=observe)
        if announce_bytes:
            downloads = result.costs[Phase.ADVERTISE].download_bytes
            for client in downloads:
                downloads[client] += announce_bytes
        return self._report(group, result, num_params, price)

    def _price(self, cost: PhaseCost) -> float:
        """Return a round's simulated seconds on the one :attr:`link` every client has."""
        link = self.link
        return phase_seconds(
            cost, up_bps=link.upload_bytes_per_s, down_bps=link.download_bytes_per_s, latency_s=link.latency_s
        )

    def _report(
        self, group: int, result: GroupResult, num_params: int, price: Callable[[PhaseCost], float] | None
    ) -> GroupReport:
        price = self._price if price is None else price
        phase_bytes = {p.name.lower(): c.total_bytes for p, c in result.costs.items()}
        phase_s = {p.name.lower(): price(c) for p, c in result.costs.items()}
        uploads: dict[int, int] = {}
        downloads: dict[int, int] = {}
        for cost in result.costs.values():
            for client, nbytes in cost.upload_bytes.items():
                uploads[client] = uploads.get(client, 0) + nbytes
            for client, nbytes in cost.download_bytes.items():
                downloads[client] = downloads.get(client, 0) + nbytes
        outcome = result.outcome
        if outcome is None:
            return GroupReport(
                group,
                None,
                0.0,
                frozenset(),
                frozenset(),
                result.dropped,
                result.reason,
                phase_bytes,
                phase_s,
                0,
                uploads,
                downloads,
            )
        weighted, total_weight = self.encoding.decode(outcome.total)
        return GroupReport(
            group=group,
            weighted_sum=weighted.to(torch.float32),
            total_weight=total_weight,
            survivors=outcome.survivors,
            recovered=outcome.recovered,
            dropped=result.dropped,
            reason="",
            phase_bytes=phase_bytes,
            phase_s=phase_s,
            plain_upload_bytes=4 * num_params * len(outcome.survivors),
            upload_bytes=uploads,
            download_bytes=downloads,
        )

    @property
    def element_bytes(self) -> int:
        """Return the bytes of one masked coordinate on the wire."""
        return element_bytes(self.bits)


_VERSION_BYTES = 8  # the version a buffer steps from, sent to each member with round 0


@dataclass(frozen=True, slots=True)
class WaitingUpdate:
    """A client that finished training and waits, holding its update, for its buffer to fill."""

    client: int
    base_version: int
    delta: torch.Tensor
    example_weight: float
    arrived_s: float


@dataclass(slots=True)
class SecureBuffer:
    """FedBuff's buffers as secure groups: the first ``buffer_size`` arrivals form a group; its sum steps the model.

    Attributes:
        aggregator: Runs each full buffer's group.
        buffer_size: K, updates per buffer.
        staleness_weight: The staleness weight each client applies to itself, of ``version - base_version``.
        example_weight_scale: A client's example weight is divided by this (its weight must land in ``[0, 1]``).
        version: The model's version the filling buffer will step from.
        waiting: The clients of the filling buffer, in arrival order.
        buffers: Buffers closed so far (each one a group id).
    """

    aggregator: SecureAggregator
    buffer_size: int
    staleness_weight: Callable[[int], float]
    example_weight_scale: float = 1.0
    version: int = 0
    waiting: list[WaitingUpdate] = field(default_factory=list)
    buffers: int = 0

    def arrive(self, update: WaitingUpdate) -> tuple[GroupReport, list[float]] | None:
        """Add an arrival; once the buffer is full run its group and return the report and each member's wait.

        The version steps when the group gives a sum; an abandoned buffer leaves the version where it was.

        Raises:
            ValueError: The update claims a base version newer than the model's, or its client already waits.
        """
        if not 0 <= update.base_version <= self.version:
            raise ValueError(f"base version {update.base_version} is not in [0, {self.version}]")
        if any(w.client == update.client for w in self.waiting):
            raise ValueError(f"client {update.client} already waits in this buffer (one update per client a buffer)")
        self.waiting.append(update)
        if len(self.waiting) < self.buffer_size:
            return None
        members, self.waiting = self.waiting, []
        closed_s = members[-1].arrived_s
        updates = []
        for m in members:
            # what each client computes itself, once the server named the version its buffer steps from
            example = min(1.0, m.example_weight / self.example_weight_scale)
            staleness = self.staleness_weight(self.version - m.base_version)
            updates.append(ClientUpdate(m.client, m.delta, min(1.0, staleness * example), example))
        report = self.aggregator.aggregate(self.buffers, updates, announce_bytes=_VERSION_BYTES)
        self.buffers += 1
        if not report.abandoned:
            self.version += 1
        return report, [closed_s - m.arrived_s for m in members]

    def state_dict(self) -> dict[str, Any]:
        """Return the buffer's state: the version, the buffers closed and the clients waiting with their updates.

        The waiting updates are the clients' state (each client holds its own until its buffer fills); a simulation
        checkpoints them with the run, as it checkpoints every simulated client.
        """
        return {
            "version": self.version,
            "buffers": self.buffers,
            "waiting": [
                {
                    "client": w.client,
                    "base_version": w.base_version,
                    "delta": w.delta.clone(),
                    "example_weight": w.example_weight,
                    "arrived_s": w.arrived_s,
                }
                for w in self.waiting
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.version = int(state["version"])
        self.buffers = int(state["buffers"])
        self.waiting = [
            WaitingUpdate(
                int(w["client"]),
                int(w["base_version"]),
                w["delta"].clone(),
                float(w["example_weight"]),
                float(w["arrived_s"]),
            )
            for w in state["waiting"]
        ]
