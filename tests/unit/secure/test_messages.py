"""Tests of the protocol messages' wire format (flasync.secure.messages)."""

from __future__ import annotations

import pytest

from flasync.secure.messages import (
    Advertise,
    KeysBroadcast,
    MaskedInput,
    Message,
    MessageError,
    Roster,
    ShareBundle,
    UnmaskRequest,
    UnmaskResponse,
    decode_message,
)
from flasync.secure.shamir import PRIME

_MESSAGES: list[Message] = [
    Advertise(7, b"c" * 32, b"s" * 32),
    KeysBroadcast({3: (b"a" * 32, b"b" * 32), 9: (b"x" * 32, b"y" * 32)}),
    ShareBundle({(3, 9): b"\x01" * 176, (3, 11): b"\x02" * 176}),
    Roster(frozenset({1, 5, 2**40})),
    MaskedInput(4, b"\x00\xff" * 50),
    UnmaskRequest(frozenset({1, 2, 3}), frozenset({4})),
    UnmaskResponse(2, {1: PRIME - 1, 3: 0}, {4: 123456789}),
    KeysBroadcast({}),
]


@pytest.mark.parametrize("message", _MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_and_counts_its_wire_bytes(message: Message) -> None:
    """decode_message(to_bytes()) gives the message back, and nbytes is the wire form's length."""
    data = message.to_bytes()
    assert decode_message(data) == message
    assert message.nbytes == len(data)


@pytest.mark.parametrize("message", _MESSAGES[:-1], ids=lambda m: type(m).__name__)
def test_cut_or_padded_messages_are_refused(message: Message) -> None:
    """A message cut short inside a field, or with bytes after its end, is a MessageError."""
    data = message.to_bytes()
    if not isinstance(message, MaskedInput):  # a masked input's payload runs to the end: padding is payload
        with pytest.raises(MessageError):
            decode_message(data + b"\x00")
    with pytest.raises(MessageError):
        decode_message(data[: 1 + 8 - 1])


def test_unknown_and_empty_messages_are_refused() -> None:
    """An unknown type tag or no bytes at all is a MessageError."""
    for data in (b"", b"\x09abc"):
        with pytest.raises(MessageError):
            decode_message(data)
