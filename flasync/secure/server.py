"""The server's side of one SecAgg+ group: it relays keys and shares, collects masked inputs and unmasks their sum.

The server is honest but curious: it follows the protocol and may look at everything it receives. What it receives
is public keys, ciphertexts it cannot open, masked inputs (uniform in the ring to it) and, in round 3, for each
client either shares of its self-mask seed (it survived) or of its masking key (it dropped), never both; with
fewer than ``t`` colluding clients it cannot unmask a single input (Bonawitz et al., CCS 2017, theorem 6.3).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flasync.secure.keys import KEY_BYTES, agree, expand_mask
from flasync.secure.messages import (
    Advertise,
    KeysBroadcast,
    MaskedInput,
    Roster,
    ShareBundle,
    UnmaskRequest,
    UnmaskResponse,
)
from flasync.secure.protocol import MASK_INFO, GroupParams, ProtocolAbort, pairwise_mask, shares_of
from flasync.secure.ring import RingVector, ring_add, ring_sub, ring_sum, unpack
from flasync.secure.shamir import reconstruct

__all__ = ["GroupOutcome", "SecAggServer"]


@dataclass(frozen=True, slots=True)
class GroupOutcome:
    """What unmasking a group gave.

    Attributes:
        total: The sum of the survivors' inputs in the ring.
        survivors: Clients whose inputs are in ``total``.
        recovered: Clients that dropped after sharing and whose pairwise masks were removed from their shares.
    """

    total: RingVector
    survivors: frozenset[int]
    recovered: frozenset[int] = field(default_factory=frozenset)


class SecAggServer:
    """The server's state for one group.

    Args:
        params: The group's parameters.
        observe: Called with each masked input as the server receives it (instrumentation; None: nothing).
    """

    def __init__(self, params: GroupParams, observe: Callable[[int, RingVector], None] | None = None) -> None:
        """Start a group with no client heard from."""
        self.params = params
        self._observe = observe
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._sharers: set[int] = set()
        self._inputs: dict[int, RingVector] = {}

    def broadcast_keys(self, adverts: Mapping[int, Advertise]) -> dict[int, KeysBroadcast]:
        """Round 0: record the advertised keys; return, per advertiser, its advertising neighbours' keys.

        Raises:
            ProtocolAbort: Fewer than ``threshold`` clients advertised.
        """
        for client, advert in adverts.items():
            if advert.client != client or client not in self.params.neighbours:
                raise ProtocolAbort(f"an advertisement from {advert.client} is not one of the group's")
            if len(advert.c_public) != KEY_BYTES or len(advert.s_public) != KEY_BYTES:
                raise ProtocolAbort(f"client {client} advertised keys of the wrong length")
            self._keys[client] = (advert.c_public, advert.s_public)
        if len(self._keys) < self.params.threshold:
            raise ProtocolAbort(f"{len(self._keys)} clients advertised keys, fewer than the threshold")
        return {
            u: KeysBroadcast({v: self._keys[v] for v in sorted(self.params.neighbours[u] & self._keys.keys())})
            for u in sorted(self._keys)
        }

    def relay_shares(self, bundles: Mapping[int, ShareBundle]) -> dict[int, ShareBundle]:
        """Round 1: forward each encrypted share to its recipient, among the clients that sent their shares."""
        self._sharers = set(bundles)
        inbox: dict[int, dict[tuple[int, int], bytes]] = {u: {} for u in sorted(self._sharers)}
        for sender, bundle in bundles.items():
            for (from_, to), text in bundle.ciphertexts.items():
                if from_ != sender:
                    raise ProtocolAbort(f"client {sender} sent a share in another client's name")
                if to in inbox:
                    inbox[to][(from_, to)] = text
        return {u: ShareBundle(texts) for u, texts in inbox.items()}

    def rosters(self) -> dict[int, Roster]:
        """Return, per client that shared, its neighbours that shared too (those it masks with)."""
        return {u: Roster(self.params.neighbours[u] & frozenset(self._sharers)) for u in sorted(self._sharers)}

    def collect(self, masked: Mapping[int, MaskedInput]) -> UnmaskRequest:
        """Round 2: keep the masked inputs of clients that shared; return the unmask request for round 3.

        Raises:
            ProtocolAbort: Fewer than ``threshold`` masked inputs, or one of the wrong length.
        """
        for client, message in sorted(masked.items()):
            if client not in self._sharers or message.client != client:
                continue
            vector = unpack(message.payload, self.params.bits)
            if vector.shape != (self.params.length,):
                raise ProtocolAbort(f"client {client} sent {vector.shape[0]} elements, not {self.params.length}")
            if self._observe is not None:
                self._observe(client, vector)
            self._inputs[client] = vector
        if len(self._inputs) < self.params.threshold:
            raise ProtocolAbort(f"{len(self._inputs)} masked inputs, fewer than the threshold")
        survivors = frozenset(self._inputs)
        return UnmaskRequest(survivors, frozenset(self._sharers) - survivors)

    def unmask(self, request: UnmaskRequest, responses: Mapping[int, UnmaskResponse]) -> GroupOutcome:
        """Round 3: reconstruct survivors' seeds and dropped clients' keys; return the unmasked sum.

        Raises:
            ProtocolAbort: Some seed or key has fewer than ``threshold`` shares among the responses.
        """
        t, bits, length = self.params.threshold, self.params.bits, self.params.length
        answers = [responses[c] for c in sorted(responses) if c in request.survivors]
        total = ring_sum([self._inputs[u] for u in sorted(request.survivors)], bits)
        for u in sorted(request.survivors):
            seed = _recover(answers, u, seed=True, threshold=t)
            total = ring_sub(total, expand_mask(seed, length, bits), bits)
        for u in sorted(request.dropped):
            key = _recover(answers, u, seed=False, threshold=t)
            for v in sorted(self.params.neighbours[u] & request.survivors):
                shared = agree(key, self._keys[v][1], info=MASK_INFO, salt=self.params.group_id)
                vector, v_adds = pairwise_mask(shared, v, u, length, bits)
                # v added its mask with u if v < u, subtracted it otherwise: undo what v did.
                total = ring_sub(total, vector, bits) if v_adds else ring_add(total, vector, bits)
        return GroupOutcome(total, request.survivors, request.dropped)


def _recover(answers: list[UnmaskResponse], client: int, *, seed: bool, threshold: int) -> bytes:
    """Reconstruct ``client``'s seed or key from the answers (32 bytes)."""
    shares = shares_of(answers, client, seed=seed)
    if len(shares) < threshold:
        what = "self-mask seed" if seed else "masking key"
        raise ProtocolAbort(f"{len(shares)} shares of client {client}'s {what}, fewer than the threshold {threshold}")
    value = reconstruct(shares, threshold)
    if value >= 1 << (8 * KEY_BYTES):
        raise ProtocolAbort(f"the shares of client {client} do not reconstruct a key: some are corrupt")
    return value.to_bytes(KEY_BYTES, "little")
