"""Tests of flasync.codecs: the self-describing wire format of updates and models."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.codecs import HEADER, MAGIC, decode, encode
from flasync.errors import DecodeError

PROPERTY = settings(max_examples=100, deadline=None)
HEADER_FORMAT = "<4sBBHQQ"
HEADER_BYTES = 24

# Every float32 bit pattern is reachable: NaNs with any payload and sign, both infinities, -0.0, subnormals.
_BITS = st.lists(st.integers(min_value=-(2**31), max_value=2**31 - 1), max_size=64)


def _from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _patched(payload: bytes, offset: int, fmt: str, value: object) -> bytes:
    patched = bytearray(payload)
    struct.pack_into(fmt, patched, offset, value)
    return bytes(patched)


def _vector(n: int = 5) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 0.5 - 1.0


# -------------------------------------------------------------------------------------------- round trip
@PROPERTY
@given(_BITS)
def test_round_trip_is_bit_exact(bits: list[int]) -> None:
    """``decode(encode(x))`` has exactly the bits of ``x``, NaN payloads and -0.0 included."""
    x = _from_bits(bits)
    assert _same_bits(decode(encode(x), expected_elements=x.numel()), x)


@PROPERTY
@given(_BITS)
def test_payload_length_is_header_plus_four_bytes_per_element(bits: list[int]) -> None:
    """``len(encode(x))`` is 24 + 4 * n."""
    x = _from_bits(bits)
    assert len(encode(x)) == HEADER_BYTES + 4 * x.numel()


def test_round_trip_of_special_values() -> None:
    """NaN, both infinities, -0.0, the smallest subnormal and the largest float survive unchanged."""
    x = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-45, 3.4028235e38, -1.5], dtype=torch.float32
    )
    assert _same_bits(decode(encode(x), expected_elements=8), x)


def test_round_trip_of_empty_vector() -> None:
    """An empty vector is a bare 24-byte header and decodes to an empty float32 vector."""
    payload = encode(torch.zeros(0))
    assert len(payload) == HEADER_BYTES
    decoded = decode(payload, expected_elements=0)
    assert decoded.shape == (0,)
    assert decoded.dtype == torch.float32


def test_encode_non_contiguous_vector() -> None:
    """A strided 1-D view encodes its own elements, not the underlying storage."""
    base = _vector(10)
    assert _same_bits(decode(encode(base[::2]), expected_elements=5), base[::2].contiguous())


def test_decode_accepts_bytearray_and_memoryview() -> None:
    """``decode`` reads ``bytearray`` and ``memoryview`` payloads too."""
    x = _vector()
    payload = encode(x)
    assert _same_bits(decode(bytearray(payload), expected_elements=5), x)
    assert _same_bits(decode(memoryview(payload), expected_elements=5), x)


def test_decoded_tensor_does_not_alias_payload() -> None:
    """The decoded tensor is a copy: writing to the payload buffer afterwards leaves it unchanged."""
    x = _vector()
    payload = bytearray(encode(x))
    decoded = decode(payload, expected_elements=5)
    payload[HEADER_BYTES:] = bytes(len(payload) - HEADER_BYTES)
    assert _same_bits(decoded, x)


def test_encode_rejects_2d_tensor() -> None:
    """A 2-D tensor is a ValueError naming its shape."""
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        encode(torch.zeros(2, 3))


def test_encode_rejects_scalar_tensor() -> None:
    """A 0-D tensor is a ValueError too."""
    with pytest.raises(ValueError, match="1-D"):
        encode(torch.tensor(1.0))


# ------------------------------------------------------------------------------------------------ header
def test_header_struct_is_the_documented_layout() -> None:
    """The module's header struct is ``<4sBBHQQ``, 24 bytes."""
    assert HEADER.format == HEADER_FORMAT
    assert HEADER.size == HEADER_BYTES == struct.calcsize(HEADER_FORMAT)


def test_header_fields_at_documented_offsets() -> None:
    """Magic, version 1, dense codec 0, flags 0, element count and body length sit at offsets 0, 4, 5, 6, 8, 16."""
    payload = encode(_vector(7))
    assert struct.unpack_from(HEADER_FORMAT, payload) == (MAGIC, 1, 0, 0, 7, 28)
    assert payload[0:4] == b"FLSU"
    assert payload[4] == 1
    assert payload[5] == 0
    assert struct.unpack_from("<H", payload, 6) == (0,)
    assert struct.unpack_from("<Q", payload, 8) == (7,)
    assert struct.unpack_from("<Q", payload, 16) == (28,)


def test_body_is_little_endian_float32() -> None:
    """The dense body after the header is the values as little-endian float32."""
    x = _vector(7)
    assert encode(x)[HEADER_BYTES:] == x.numpy().astype("<f4").tobytes()


# ----------------------------------------------------------------------------------------------- rejects
def test_decode_rejects_every_truncation() -> None:
    """Every proper prefix of a valid payload, down to the empty one, is a DecodeError."""
    payload = encode(_vector(3))
    for length in range(len(payload)):
        with pytest.raises(DecodeError):
            decode(payload[:length], expected_elements=3)


@PROPERTY
@given(bits=_BITS, data=st.data())
def test_decode_rejects_random_truncation(bits: list[int], data: st.DataObject) -> None:
    """A payload cut anywhere before its end is a DecodeError."""
    x = _from_bits(bits)
    payload = encode(x)
    length = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    with pytest.raises(DecodeError):
        decode(payload[:length], expected_elements=x.numel())


def test_decode_rejects_one_extra_byte() -> None:
    """A valid payload followed by one more byte is a DecodeError."""
    with pytest.raises(DecodeError, match="body"):
        decode(encode(_vector()) + b"\x00", expected_elements=5)


def test_decode_rejects_wrong_magic() -> None:
    """Another magic is a DecodeError."""
    payload = b"XLSU" + encode(_vector())[4:]
    with pytest.raises(DecodeError, match="magic"):
        decode(payload, expected_elements=5)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_decode_rejects_wrong_version(version: int) -> None:
    """A format version other than 1 is a DecodeError."""
    payload = _patched(encode(_vector()), 4, "<B", version)
    with pytest.raises(DecodeError, match="version"):
        decode(payload, expected_elements=5)


@pytest.mark.parametrize("codec_id", [1, 7, 255])
def test_decode_rejects_unknown_codec(codec_id: int) -> None:
    """An unregistered codec id is a DecodeError."""
    payload = _patched(encode(_vector()), 5, "<B", codec_id)
    with pytest.raises(DecodeError, match="codec"):
        decode(payload, expected_elements=5)


@pytest.mark.parametrize("flags", [1, 0x8000, 0xFFFF])
def test_decode_rejects_nonzero_flags(flags: int) -> None:
    """Reserved flags set is a DecodeError."""
    payload = _patched(encode(_vector()), 6, "<H", flags)
    with pytest.raises(DecodeError, match="flags"):
        decode(payload, expected_elements=5)


@pytest.mark.parametrize("expected", [0, 4, 6, 2**40])
def test_decode_rejects_unexpected_element_count(expected: int) -> None:
    """A valid payload of 5 elements is a DecodeError when the model expects another count."""
    with pytest.raises(DecodeError, match="elements"):
        decode(encode(_vector()), expected_elements=expected)


@pytest.mark.parametrize("body_bytes", [0, 19, 21, 2**64 - 1])
def test_decode_rejects_header_body_length_mismatch(body_bytes: int) -> None:
    """A header announcing a body length other than what follows is a DecodeError."""
    payload = _patched(encode(_vector()), 16, "<Q", body_bytes)
    with pytest.raises(DecodeError, match="body"):
        decode(payload, expected_elements=5)


def test_decode_rejects_body_not_matching_element_count() -> None:
    """A consistent header whose element count does not fit the body length is a DecodeError."""
    payload = _patched(encode(_vector()), 8, "<Q", 6)
    with pytest.raises(DecodeError, match="body"):
        decode(payload, expected_elements=6)


# -------------------------------------------------------------------------------------------------- fuzz
@PROPERTY
@given(payload=st.binary(max_size=64), expected=st.integers(min_value=0, max_value=4))
def test_arbitrary_bytes_decode_or_raise_decode_error(payload: bytes, expected: int) -> None:
    """Arbitrary bytes raise DecodeError, or are a valid payload that re-encodes to themselves."""
    try:
        decoded = decode(payload, expected_elements=expected)
    except DecodeError:
        return
    assert encode(decoded) == payload


@PROPERTY
@given(
    magic=st.sampled_from([MAGIC, b"FLSV", b"\x00\x00\x00\x00"]),
    version=st.sampled_from([0, 1, 2]),
    codec_id=st.sampled_from([0, 1, 255]),
    flags=st.sampled_from([0, 1]),
    num_elements=st.sampled_from([0, 1, 3, 2**63, 2**64 - 1]),
    body_bytes=st.sampled_from([0, 4, 12, 2**64 - 1]),
    body=st.binary(max_size=16),
    expected=st.sampled_from([0, 1, 3]),
)
def test_near_valid_headers_decode_or_raise_decode_error(
    magic: bytes,
    version: int,
    codec_id: int,
    flags: int,
    num_elements: int,
    body_bytes: int,
    body: bytes,
    expected: int,
) -> None:
    """Headers with plausible but wrong fields raise DecodeError, or form a valid payload."""
    payload = struct.pack(HEADER_FORMAT, magic, version, codec_id, flags, num_elements, body_bytes) + body
    try:
        decoded = decode(payload, expected_elements=expected)
    except DecodeError:
        return
    assert encode(decoded) == payload


@PROPERTY
@given(bits=_BITS.filter(bool), data=st.data())
def test_corrupted_byte_decodes_or_raises_decode_error(bits: list[int], data: st.DataObject) -> None:
    """A valid payload with one byte replaced raises DecodeError, or decodes to what re-encodes to it."""
    x = _from_bits(bits)
    payload = bytearray(encode(x))
    index = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    payload[index] = data.draw(st.integers(min_value=0, max_value=255))
    try:
        decoded = decode(bytes(payload), expected_elements=x.numel())
    except DecodeError:
        return
    assert encode(decoded) == bytes(payload)
    assert payload[:4] == MAGIC
