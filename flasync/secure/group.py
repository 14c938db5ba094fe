"""One secure-aggregation group run in memory: weighted encoding, the four rounds, dropouts and their cost.

Simulated clients run the protocol's real cryptography; what the group costs is counted per round (bytes each way,
messages) so that the simulation can charge it like any transfer (:func:`phase_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TypeVar

import numpy as np
import torch

from flasync.secure.keys import RandomSource
from flasync.secure.messages import (
    Advertise,
    KeysBroadcast,
    MaskedInput,
    Roster,
    ShareBundle,
    UnmaskRequest,
    UnmaskResponse,
    decode_message,
)
from flasync.secure.protocol import GroupParams, ProtocolAbort, SecAggClient
from flasync.secure.ring import FixedPoint, RingVector
from flasync.secure.server import GroupOutcome, SecAggServer

__all__ = ["GroupResult", "Phase", "PhaseCost", "WeightedEncoding", "phase_seconds", "run_group"]


class Phase(IntEnum):
    """The protocol's rounds, in order; a client that drops "at" a phase sends nothing from it on."""

    ADVERTISE = 0
    SHARE = 1
    MASK = 2
    UNMASK = 3


@dataclass(frozen=True, slots=True)
class WeightedEncoding:
    """A client's update and its weights as one ring vector: ``[encode(w * delta), encode(e)]``.

    The client applies its own weight ``w`` (example weight times staleness weight, scaled to ``[0, 1]``) before
    masking and sends its share ``e`` of the denominator beside it, so the unmasked sum is
    ``(sum w_u delta_u, sum e_u)``: the weighted mean needs nothing from one client alone.

    Attributes:
        values: Fixed-point code of the weighted delta's coordinates (clipped to its range).
        weights: Fixed-point code of the weight (range ``[-1, 1]``).
    """

    values: FixedPoint
    weights: FixedPoint

    @classmethod
    def create(cls, bits: int, clip: float, group_size: int) -> WeightedEncoding:
        """Return the encoding for ``group_size`` clients in ``bits``-bit ring with coordinates in ``[-clip, clip]``."""
        return cls(FixedPoint(bits, clip, group_size), FixedPoint(bits, 1.0, group_size))

    def length(self, num_params: int) -> int:
        """Return the ring elements of one encoded update."""
        return num_params + 1

    def encode(self, delta: torch.Tensor, weight: float, denominator: float | None = None) -> RingVector:
        """Encode ``weight * delta`` and the weight the sum is divided by (``denominator``; None: ``weight``).

        FedBuff divides the staleness-weighted sum by the sum of example weights alone: its clients pass
        ``weight = s(tau) * e`` and ``denominator = e``.

        Raises:
            ValueError: A weight outside ``[0, 1]``.
        """
        denominator = weight if denominator is None else denominator
        if not (0.0 <= weight <= 1.0 and 0.0 <= denominator <= 1.0):
            raise ValueError(f"client weights must be in [0, 1], got {weight} and {denominator}")
        scaled = self.values.encode(delta.reshape(-1).to(torch.float64) * weight)
        return np.concatenate([scaled, self.weights.encode(torch.tensor([denominator], dtype=torch.float64))])

    def decode(self, total: RingVector) -> tuple[torch.Tensor, float]:
        """Return the weighted sum of deltas (float64) and the sum of denominators of an unmasked total."""
        return self.values.decode(total[:-1]), float(self.weights.decode(total[-1:])[0])


@dataclass(slots=True)
class PhaseCost:
    """What one round of the protocol carried.

    Attributes:
        upload_bytes: Client-to-server bytes, per client that sent in this round.
        download_bytes: Server-to-client bytes, per client that received in this round.
    """

    upload_bytes: dict[int, int] = field(default_factory=dict)
    download_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Return the round's bytes both ways."""
        return sum(self.upload_bytes.values()) + sum(self.download_bytes.values())


@dataclass(frozen=True, slots=True)
class GroupResult:
    """A group's end: its outcome (None: abandoned, see ``reason``), the cost of each round and who dropped."""

    outcome: GroupOutcome | None
    costs: Mapping[Phase, PhaseCost]
    dropped: frozenset[int]
    reason: str = ""


def phase_seconds(cost: PhaseCost, *, up_bps: float, down_bps: float, latency_s: float) -> float:
    """Return a round's duration: the slowest client's download and upload, plus one round trip.

    Args:
        cost: The round's bytes per client.
        up_bps: Upload bandwidth in bytes per second.
        down_bps: Download bandwidth in bytes per second.
        latency_s: One-way latency in seconds.
    """
    clients = cost.upload_bytes.keys() | cost.download_bytes.keys()
    slowest = max(
        (cost.upload_bytes.get(c, 0) / up_bps + cost.download_bytes.get(c, 0) / down_bps for c in clients),
        default=0.0,
    )
    return 2.0 * latency_s + slowest


def run_group(
    params: GroupParams,
    inputs: Mapping[int, RingVector],
    rngs: Mapping[int, RandomSource],
    *,
    drops: Mapping[int, Phase] | None = None,
    observe: Callable[[int, RingVector], None] | None = None,
) -> GroupResult:
    """Run the four rounds among the clients of ``inputs``; a client in ``drops`` stops before its phase.

    Args:
        params: The group's parameters (its ``neighbours`` name exactly the clients of ``inputs``).
        inputs: Each client's encoded input.
        rngs: Each client's random source.
        drops: The phase at which a client drops out (it sends nothing from that phase on).
        observe: Called with each masked input the server receives.

    Returns:
        The outcome, or None with the reason when the group could not finish (too many dropouts).
    """
    drops = drops or {}
    costs = {phase: PhaseCost() for phase in Phase}
    clients = {u: SecAggClient(u, params, rngs[u]) for u in sorted(inputs)}
    server = SecAggServer(params, observe)
    dropped = frozenset(drops)

    def alive(phase: Phase) -> list[int]:
        return [u for u in sorted(clients) if drops.get(u, len(Phase)) > phase]

    try:
        advertise, share, mask, unmask = (costs[p] for p in Phase)
        adverts = _carry(advertise.upload_bytes, {u: clients[u].advertise() for u in alive(Phase.ADVERTISE)})
        broadcasts = _carry(advertise.download_bytes, server.broadcast_keys(adverts))
        bundles = {u: clients[u].share(broadcasts[u]) for u in alive(Phase.SHARE) if u in broadcasts}
        inboxes = _carry(share.download_bytes, server.relay_shares(_carry(share.upload_bytes, bundles)))
        _carry(share.download_bytes, server.rosters())
        for u in sorted(inboxes):
            clients[u].receive_shares(inboxes[u])
        sharers = server.rosters().keys()
        masked = {u: clients[u].mask(inputs[u]) for u in alive(Phase.MASK) if u in sharers}
        request = server.collect(_carry(mask.upload_bytes, masked))
        requests = _carry(unmask.download_bytes, dict.fromkeys(sorted(request.survivors), request))
        answering = [u for u in alive(Phase.UNMASK) if u in request.survivors]
        responses = _carry(unmask.upload_bytes, {u: clients[u].unmask(requests[u]) for u in answering})
        outcome = server.unmask(request, responses)
    except ProtocolAbort as abort:
        return GroupResult(None, costs, dropped, str(abort))
    return GroupResult(outcome, costs, dropped)


_M = TypeVar("_M", Advertise, KeysBroadcast, ShareBundle, Roster, MaskedInput, UnmaskRequest, UnmaskResponse)


def _carry(into: dict[int, int], messages: Mapping[int, _M]) -> dict[int, _M]:
    """Send each message through its wire form, as a transport would; charge its bytes to its client."""
    carried: dict[int, _M] = {}
    for client, message in messages.items():
        data = message.to_bytes()
        into[client] = into.get(client, 0) + len(data)
        back = decode_message(data)
        if not isinstance(back, type(message)):
            raise ProtocolAbort(f"a {type(message).__name__} came back as a {type(back).__name__}")
        carried[client] = back
    return carried
