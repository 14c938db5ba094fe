"""The messages of one secure-aggregation group and their wire format.

Each message is a frozen dataclass with ``to_bytes()``; :func:`decode_message` reads any of them back, checking
every length, so a transport carries them as plain bytes (never pickled). A message's ``nbytes`` is the length of
its wire form: the simulated cost of the protocol is what a deployment sends. The form is a one-byte type tag, then
little-endian fields: ids as 8 bytes, counts as 4, keys as 32, Shamir share values as 66, ring elements as
``ceil(bits / 8)`` bytes, ciphertexts with AES-GCM's nonce and tag.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from flasync.secure.keys import KEY_BYTES
from flasync.secure.shamir import SHARE_BYTES

__all__ = [
    "ID_BYTES",
    "Advertise",
    "KeysBroadcast",
    "MaskedInput",
    "Message",
    "MessageError",
    "Roster",
    "ShareBundle",
    "UnmaskRequest",
    "UnmaskResponse",
    "decode_message",
]

ID_BYTES = 8
"""Bytes of a client id on the wire."""

_ID = struct.Struct("<Q")
_COUNT = struct.Struct("<I")


class MessageError(ValueError):
    """Bytes that are not a well-formed secure-aggregation message."""


class _Reader:
    """Read fields off a message's bytes, refusing to read past its end."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 1

    def take(self, n: int) -> bytes:
        if self.offset + n > len(self.data):
            raise MessageError(f"a message of {len(self.data)} bytes ends inside a field")
        chunk = self.data[self.offset : self.offset + n]
        self.offset += n
        return chunk

    def id(self) -> int:
        return int(_ID.unpack(self.take(ID_BYTES))[0])

    def count(self) -> int:
        return int(_COUNT.unpack(self.take(_COUNT.size))[0])

    def share(self) -> int:
        return int.from_bytes(self.take(SHARE_BYTES), "little")

    def rest(self) -> bytes:
        chunk = self.data[self.offset :]
        self.offset = len(self.data)
        return chunk

    def done(self) -> None:
        if self.offset != len(self.data):
            raise MessageError(f"{len(self.data) - self.offset} bytes follow the end of a message")


def _ids(values: frozenset[int]) -> bytes:
    return _COUNT.pack(len(values)) + b"".join(_ID.pack(v) for v in sorted(values))


@dataclass(frozen=True, slots=True)
class Advertise:
    """Round 0, client to server: the client's two public keys (encryption ``c``, masking ``s``)."""

    client: int
    c_public: bytes
    s_public: bytes

    def to_bytes(self) -> bytes:
        """Return the wire form."""
        return b"\x01" + _ID.pack(self.client) + self.c_public + self.s_public

    @property
    def nbytes(self) -> int:
        """Return the length of the wire form."""
        return 1 + ID_BYTES + 2 * KEY_BYTES


@dataclass(frozen=True, slots=True)
class KeysBroadcast:
    """Round 0, server to one client: the public keys of its neighbours that advertised (id to ``(c, s)``)."""

    keys: Mapping[int, tuple[bytes, bytes]]

    def to_bytes(self) -> bytes:
        """Return the wire form."""
        body = b"".join(_ID.pack(u) + c + s for u, (c, s) in sorted(self.keys.items()))
        return b"\x02" + _COUNT.pack(len(self.keys)) + body

    @property
    def nbytes(self) -> int:
        """Return the length of the wire form."""
        return 1 + _COUNT.size + len(self.keys) * (ID_BYTES + 2 * KEY_BYTES)


@dataclass(frozen=True, slots=True)
class ShareBundle:
    """Round 1, client to server (and, regrouped, server to each recipient): encrypted shares by ``(sender, to)``."""

    ciphertexts: Mapping[tuple[int, int], bytes]

    def to_bytes(self) -> bytes:
        """Return the wire form."""
        body = b"".join(
            _ID.pack(a) + _ID.pack(b) + _COUNT.pack(len(text)) + text
            for (a, b), text in sorted(self.ciphertexts.items())
        )
        return b"\x03" + _COUNT.pack(len(self.ciphertexts)) + body

    @property
    def nbytes(self) -> int:
        """Return the length of the wire form."""
        each = 2 * ID_BYTES + _COUNT.size
        return 1 + _COUNT.size + sum(each + len(text) for text in self.ciphertexts.values())


@dataclass(frozen=True, slots=True)
class Roster:
    """Server to one client: the neighbours still in the protocol at this point (their ids)."""

    clients: frozenset[int]

    def to_bytes(self) -> bytes:
        """Return the wire form."""
        return b"\x04" + _ids(self.clients)

    @property
    def nbytes(self) -> int:
        """Return the length of the wire form."""
        return 1 + _COUNT.size + ID_BYTES * len(self.clients)


@dataclass(frozen=True, slots=True)
class MaskedInput:
    """Round 2, client to server: the client's masked, encoded input as packed ring elements."""

    client: int
    payload: bytes

    def to_bytes(self) -> bytes:
        """Return the wire form."""
        return b"\x05" + _ID.pack(self.client) + self.payload

    @property
    def nbytes(self) -> int:
        """Return the length of the wire form."""
        return 1 + ID_BYTES + len(self.payload)


@dataclass(frozen=True, slots=True)
class UnmaskRequest:
    """Round 3, server to one client: whose masked input arrived (``survivors``) and who dropped after sharing."""

    survivors: frozenset[int]
    dropped: frozenset[int]

    def to_bytes(self) -> bytes:
        """Return the wire form."""
        return b"\x06" + _ids(self.survivors) + _ids(self.dropped)

    @property
    def nbytes(self) -> int:
        """Return the length of the wire form."""
        return 1 + 2 * _COUNT.size + ID_BYTES * (len(self.survivors) + len(self.dropped))


@dataclass(frozen=True, slots=True)
class UnmaskResponse:
    """Round 3, client to server: share values of survivors' self-mask seeds and of dropped clients' mask keys."""

    client: int
    seed_shares: Mapping[int, int] = field(default_factory=dict)
    key_shares: Mapping[int, int] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """Return the wire form."""
        parts = [b"\x07", _ID.pack(self.client)]
        for shares in (self.seed_shares, self.key_shares):
            parts.append(_COUNT.pack(len(shares)))
            parts += [_ID.pack(u) + y.to_bytes(SHARE_BYTES, "little") for u, y in sorted(shares.items())]
        return b"".join(parts)

    @property
    def nbytes(self) -> int:
        """Return the length of the wire form."""
        shares = len(self.seed_shares) + len(self.key_shares)
        return 1 + ID_BYTES + 2 * _COUNT.size + shares * (ID_BYTES + SHARE_BYTES)


Message = Advertise | KeysBroadcast | ShareBundle | Roster | MaskedInput | UnmaskRequest | UnmaskResponse
"""Any message of the protocol."""


def decode_message(data: bytes) -> Message:
    """Read a message from its wire form.

    Raises:
        MessageError: Unknown type, a field cut short, or bytes left over.
    """
    if not data:
        raise MessageError("an empty message")
    reader, tag = _Reader(data), data[0]
    message: Message
    if tag == 1:
        message = Advertise(reader.id(), reader.take(KEY_BYTES), reader.take(KEY_BYTES))
    elif tag == 2:
        keys = {}
        for _ in range(reader.count()):
            client = reader.id()
            keys[client] = (reader.take(KEY_BYTES), reader.take(KEY_BYTES))
        message = KeysBroadcast(keys)
    elif tag == 3:
        texts = {}
        for _ in range(reader.count()):
            pair = (reader.id(), reader.id())
            texts[pair] = reader.take(reader.count())
        message = ShareBundle(texts)
    elif tag == 4:
        message = Roster(frozenset(reader.id() for _ in range(reader.count())))
    elif tag == 5:
        message = MaskedInput(reader.id(), reader.rest())
    elif tag == 6:
        survivors = frozenset(reader.id() for _ in range(reader.count()))
        message = UnmaskRequest(survivors, frozenset(reader.id() for _ in range(reader.count())))
    elif tag == 7:
        client = reader.id()
        seeds = {reader.id(): reader.share() for _ in range(reader.count())}
        message = UnmaskResponse(client, seeds, {reader.id(): reader.share() for _ in range(reader.count())})
    else:
        raise MessageError(f"unknown message type {tag}")
    reader.done()
    return message
