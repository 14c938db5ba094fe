"""SecAgg+ for one group of clients: each client's side and the server's, as synchronous state machines.

The protocol of Bonawitz et al. (CCS 2017, "Practical Secure Aggregation for Privacy-Preserving Machine
Learning"), restricted to a neighbour graph as in SecAgg+ (Bell et al., CCS 2020, "Secure Single-Server Aggregation
with (Poly)Logarithmic Overhead"). Client ``u`` with input ``x_u`` (a ring vector) sends

    y_u = x_u + PRG(b_u) + sum_{v in N(u), u < v} PRG(s_uv) - sum_{v in N(u), v < u} PRG(s_uv)   (mod 2^bits)

where ``b_u`` is a fresh self-mask seed and ``s_uv`` the key ``u`` and its neighbour ``v`` agree on with X25519.
Pairwise masks cancel in the sum of the survivors; the server removes the survivors' self masks with ``b_u``
reconstructed from ``t`` Shamir shares, and a dropped client's pairwise masks with its masking key reconstructed
the same way. A client gives, for each neighbour, either the share of its seed (it survived) or of its key (it
dropped), never both, so the server never holds what unmasks one client's input. The rounds:

0. advertise: each client sends two public keys; the server sends each client its neighbours' keys;
1. share: each client shares ``b_u`` and its masking key among its neighbours, encrypted with AES-GCM under keys
   agreed with X25519, relayed by the server;
2. masked input: each client sends ``y_u``;
3. unmask: the server names survivors and dropped clients; each surviving client answers with shares; the server
   reconstructs and outputs ``sum_{u in survivors} x_u``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flasync.secure.keys import KEY_BYTES, KeyPair, RandomSource, agree, decrypt, encrypt, expand_mask
from flasync.secure.messages import (
    ID_BYTES,
    Advertise,
    KeysBroadcast,
    MaskedInput,
    ShareBundle,
    UnmaskRequest,
    UnmaskResponse,
)
from flasync.secure.ring import RingVector, pack, ring_add, ring_sub
from flasync.secure.shamir import SHARE_BYTES, Share, split

__all__ = [
    "MASK_INFO",
    "SHARE_INFO",
    "GroupParams",
    "ProtocolAbort",
    "SecAggClient",
    "neighbour_graph",
    "pairwise_mask",
    "shares_of",
]

MASK_INFO = b"flasync-secagg-mask"
SHARE_INFO = b"flasync-secagg-share"


class ProtocolAbort(RuntimeError):
    """A client or the server stops the group: too few participants left, or a message that is not right."""


@dataclass(frozen=True, slots=True)
class GroupParams:
    """What every member of a group agrees on before round 0.

    Attributes:
        group_id: Binds keys and ciphertexts to this group (a round or a buffer slot), so nothing is reused.
        bits: The ring's bit width.
        length: Ring elements in every input.
        threshold: Shares needed to reconstruct a seed or a key (``t``).
        neighbours: Each client's neighbours in the group (symmetric; see :func:`neighbour_graph`).
    """

    group_id: bytes
    bits: int
    length: int
    threshold: int
    neighbours: Mapping[int, frozenset[int]]


def neighbour_graph(clients: Sequence[int], degree: int | None, order: Sequence[int]) -> dict[int, frozenset[int]]:
    """Return a symmetric neighbour graph: complete (``degree`` None) or a Harary graph of even ``degree``.

    SecAgg+ replaces the complete graph by a random ``k``-regular graph (Bell et al. 2020, section 3): each client
    is placed on a cycle in a random order and joined to the ``k / 2`` clients on each side of it.

    Args:
        clients: The group's client ids.
        degree: Neighbours per client (even; None or at least ``len(clients) - 1``: everyone).
        order: A permutation of ``range(len(clients))`` placing clients on the cycle (drawn by the server).
    """
    n = len(clients)
    if degree is None or degree >= n - 1:
        return {c: frozenset(clients) - {c} for c in clients}
    cycle = [clients[i] for i in order]
    half = degree // 2
    graph: dict[int, set[int]] = {c: set() for c in clients}
    for position, client in enumerate(cycle):
        for step in range(1, half + 1):
            other = cycle[(position + step) % n]
            graph[client].add(other)
            graph[other].add(client)
    return {c: frozenset(v) for c, v in graph.items()}


def pairwise_mask(key: bytes, me: int, other: int, length: int, bits: int) -> tuple[RingVector, bool]:
    """Return the mask ``me`` shares with ``other`` and whether ``me`` adds it (``me < other``) or subtracts it."""
    return expand_mask(key, length, bits), me < other


def _share_plaintext(sender: int, to: int, seed_share: int, key_share: int) -> bytes:
    return (
        sender.to_bytes(ID_BYTES, "little")
        + to.to_bytes(ID_BYTES, "little")
        + seed_share.to_bytes(SHARE_BYTES, "little")
        + key_share.to_bytes(SHARE_BYTES, "little")
    )


def _associated(params: GroupParams, sender: int, to: int) -> bytes:
    return params.group_id + sender.to_bytes(ID_BYTES, "little") + to.to_bytes(ID_BYTES, "little")


class SecAggClient:
    """One client's side of one group.

    Args:
        client: The client's id (its Shamir point is ``client + 1``).
        params: The group's parameters.
        rng: Draws the client's keys, seed, share polynomials and nonces.
    """

    def __init__(self, client: int, params: GroupParams, rng: RandomSource) -> None:
        """Draw the two key pairs and the self-mask seed."""
        self.client = client
        self.params = params
        self._rng = rng
        self._c = KeyPair.generate(rng)
        self._s = KeyPair.generate(rng)
        self._seed = rng.bytes(KEY_BYTES)
        self._peers: dict[int, tuple[bytes, bytes]] = {}
        self._shared_with: frozenset[int] = frozenset()
        self._received: dict[int, tuple[int, int]] = {}
        self._masked = False
        self._answered = False

    def advertise(self) -> Advertise:
        """Round 0: return the two public keys."""
        return Advertise(self.client, self._c.public, self._s.public)

    def share(self, keys: KeysBroadcast) -> ShareBundle:
        """Round 1: share the self-mask seed and the masking key among the neighbours that advertised.

        Raises:
            ProtocolAbort: Fewer than ``threshold`` neighbours advertised, or a non-neighbour is in the keys.
        """
        mine = self.params.neighbours[self.client]
        if not set(keys.keys) <= mine:
            raise ProtocolAbort(f"client {self.client} was sent keys of clients that are not its neighbours")
        if len(keys.keys) < self.params.threshold:
            raise ProtocolAbort(f"client {self.client}: {len(keys.keys)} neighbours left, fewer than the threshold")
        self._peers = dict(keys.keys)
        holders = sorted(self._peers)
        points = [v + 1 for v in holders]
        t = self.params.threshold
        seeds = split(int.from_bytes(self._seed, "little"), points, t, self._rng)
        masks = split(int.from_bytes(self._s.private, "little"), points, t, self._rng)
        texts: dict[tuple[int, int], bytes] = {}
        for v, seed_share, key_share in zip(holders, seeds, masks, strict=True):
            key = agree(self._c.private, self._peers[v][0], info=SHARE_INFO, salt=self.params.group_id)
            plain = _share_plaintext(self.client, v, seed_share.y, key_share.y)
            texts[(self.client, v)] = encrypt(key, plain, _associated(self.params, self.client, v), self._rng)
        return ShareBundle(texts)

    def receive_shares(self, bundle: ShareBundle) -> frozenset[int]:
        """Round 1 ends: decrypt the shares neighbours sent this client; return who sent one.

        Raises:
            ProtocolAbort: A share is not addressed to this client, or fewer than ``threshold`` arrived.
        """
        for (sender, to), text in bundle.ciphertexts.items():
            if to != self.client or sender not in self._peers:
                raise ProtocolAbort(f"client {self.client} was relayed a share not meant for it")
            key = agree(self._c.private, self._peers[sender][0], info=SHARE_INFO, salt=self.params.group_id)
            plain = decrypt(key, text, _associated(self.params, sender, to))
            if plain[:ID_BYTES] != sender.to_bytes(ID_BYTES, "little"):
                raise ProtocolAbort(f"client {self.client}: a share's sender does not match its envelope")
            start = 2 * ID_BYTES
            seed_share = int.from_bytes(plain[start : start + SHARE_BYTES], "little")
            key_share = int.from_bytes(plain[start + SHARE_BYTES :], "little")
            self._received[sender] = (seed_share, key_share)
        self._shared_with = frozenset(self._received)
        if len(self._shared_with) < self.params.threshold:
            raise ProtocolAbort(f"client {self.client}: shares from fewer neighbours than the threshold")
        return self._shared_with

    def mask(self, encoded: RingVector) -> MaskedInput:
        """Round 2: add the self mask and the pairwise masks with every neighbour that shared; pack the result.

        Raises:
            ProtocolAbort: The input has the wrong length, or the client masked once already in this group.
        """
        bits = self.params.bits
        if encoded.shape != (self.params.length,):
            raise ProtocolAbort(f"client {self.client}: input of {encoded.shape} elements, not {self.params.length}")
        if self._masked:
            raise ProtocolAbort(f"client {self.client} masks only one input per group")
        self._masked = True
        masked = ring_add(encoded, expand_mask(self._seed, self.params.length, bits), bits)
        for v in sorted(self._shared_with):
            key = agree(self._s.private, self._peers[v][1], info=MASK_INFO, salt=self.params.group_id)
            vector, adds = pairwise_mask(key, self.client, v, self.params.length, bits)
            masked = ring_add(masked, vector, bits) if adds else ring_sub(masked, vector, bits)
        return MaskedInput(self.client, pack(masked, bits))

    def unmask(self, request: UnmaskRequest) -> UnmaskResponse:
        """Round 3: give seed shares of surviving neighbours and key shares of neighbours that dropped.

        Raises:
            ProtocolAbort: The request names a client as both, names fewer survivors than the threshold, calls this
                client dropped, or comes twice.
        """
        if request.survivors & request.dropped:
            raise ProtocolAbort(f"client {self.client}: a client is named both survivor and dropped")
        if len(request.survivors) < self.params.threshold or self.client not in request.survivors:
            raise ProtocolAbort(f"client {self.client}: too few survivors, or this client is not among them")
        if self._answered:
            raise ProtocolAbort(f"client {self.client} answers one unmask request per group")
        self._answered = True
        seeds = {u: self._received[u][0] for u in sorted(request.survivors & self._shared_with)}
        keys = {u: self._received[u][1] for u in sorted(request.dropped & self._shared_with)}
        return UnmaskResponse(self.client, seeds, keys)


def shares_of(responses: Iterable[UnmaskResponse], client: int, *, seed: bool) -> list[Share]:
    """Collect the shares of ``client``'s seed (``seed``) or masking key from the responses, as Shamir points."""
    found: list[Share] = []
    for response in responses:
        values = response.seed_shares if seed else response.key_shares
        if client in values:
            found.append(Share(response.client + 1, values[client]))
    return found
