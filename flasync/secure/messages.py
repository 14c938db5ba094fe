"""The messages of one secure-aggregation group, with their size on the wire.

Every message names its sender; the sizes count what a real transport must carry (ids as 8 bytes, keys as 32,
Shamir share values as 66, AES-GCM's nonce and tag, ring elements as ``ceil(bits / 8)`` bytes), so the simulated
cost of the protocol is the cost a deployment pays.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from flasync.secure.keys import KEY_BYTES
from flasync.secure.shamir import SHARE_BYTES

__all__ = [
    "ID_BYTES",
    "Advertise",
    "KeysBroadcast",
    "MaskedInput",
    "Roster",
    "ShareBundle",
    "UnmaskRequest",
    "UnmaskResponse",
]

ID_BYTES = 8
"""Bytes of a client id on the wire."""


@dataclass(frozen=True, slots=True)
class Advertise:
    """Round 0, client to server: the client's two public keys (encryption ``c``, masking ``s``)."""

    client: int
    c_public: bytes
    s_public: bytes

    @property
    def nbytes(self) -> int:
        """Return the message's bytes on the wire."""
        return ID_BYTES + 2 * KEY_BYTES


@dataclass(frozen=True, slots=True)
class KeysBroadcast:
    """Round 0, server to one client: the public keys of its neighbours that advertised (id to ``(c, s)``)."""

    keys: Mapping[int, tuple[bytes, bytes]]

    @property
    def nbytes(self) -> int:
        """Return the message's bytes on the wire."""
        return len(self.keys) * (ID_BYTES + 2 * KEY_BYTES)


@dataclass(frozen=True, slots=True)
class ShareBundle:
    """Round 1, client to server (and, regrouped, server to each recipient): encrypted shares by ``(sender, to)``."""

    ciphertexts: Mapping[tuple[int, int], bytes]

    @property
    def nbytes(self) -> int:
        """Return the message's bytes on the wire (both ids and the ciphertext of each share)."""
        return sum(2 * ID_BYTES + len(text) for text in self.ciphertexts.values())


@dataclass(frozen=True, slots=True)
class Roster:
    """Server to one client: the neighbours still in the protocol at this point (their ids)."""

    clients: frozenset[int]

    @property
    def nbytes(self) -> int:
        """Return the message's bytes on the wire."""
        return ID_BYTES * len(self.clients)


@dataclass(frozen=True, slots=True)
class MaskedInput:
    """Round 2, client to server: the client's masked, encoded input as packed ring elements."""

    client: int
    payload: bytes

    @property
    def nbytes(self) -> int:
        """Return the message's bytes on the wire."""
        return ID_BYTES + len(self.payload)


@dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """Round 3, server to one client: whose masked input arrived (``survivors``) and who dropped after sharing."""

    survivors: frozenset[int]
    dropped: frozenset[int]

    @property
    def nbytes(self) -> int:
        """Return the message's bytes on the wire."""
        return ID_BYTES * (len(self.survivors) + len(self.dropped))


@dataclass(frozen=True, slots=True)
class UnmaskResponse:
    """Round 3, client to server: share values of survivors' self-mask seeds and of dropped clients' mask keys."""

    client: int
    seed_shares: Mapping[int, int] = field(default_factory=dict)
    key_shares: Mapping[int, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Return the message's bytes on the wire."""
        return ID_BYTES + (len(self.seed_shares) + len(self.key_shares)) * (ID_BYTES + SHARE_BYTES)
