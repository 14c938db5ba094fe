"""Tests of flasync.codecs: the self-describing wire format of updates and models."""

from __future__ import annotations

import itertools
import math
import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.codecs import (
    HEADER,
    MAGIC,
    BFloat16,
    Float16,
    Int8,
    Pipeline,
    RandomK,
    Stage,
    TopK,
    decode,
    decode_stacked,
    encode,
    encode_rows,
)
from flasync.core.errors import DecodeError

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


def _assert_valid_decode(payload: bytes, decoded: torch.Tensor, expected: int) -> None:
    """A payload that decoded is a float32 vector of the expected length; a dense float32 one re-encodes to itself."""
    assert decoded.dtype == torch.float32
    assert decoded.shape == (expected,)
    if payload[5] == 0 and struct.unpack_from("<H", payload, 6) == (0,):
        assert encode(decoded) == payload


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


def test_decode_rejects_non_contiguous_memoryview() -> None:
    """A strided memoryview is a DecodeError, not a TypeError."""
    with pytest.raises(DecodeError, match="contiguous"):
        decode(memoryview(encode(_vector()) * 2)[::2], expected_elements=5)


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


@pytest.mark.parametrize("codec_id", [4, 7, 255])
def test_decode_rejects_unknown_codec(codec_id: int) -> None:
    """An unregistered codec id is a DecodeError."""
    payload = _patched(encode(_vector()), 5, "<B", codec_id)
    with pytest.raises(DecodeError, match="codec"):
        decode(payload, expected_elements=5)


@pytest.mark.parametrize("flags", [4, 0x8000, 0xFFFF])
def test_decode_rejects_unknown_flags(flags: int) -> None:
    """Flag bits other than sparse (bit 0) and int8-chunked (bit 1) are a DecodeError."""
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
    _assert_valid_decode(payload, decoded, expected)


@PROPERTY
@given(
    magic=st.sampled_from([MAGIC, b"FLSV", b"\x00\x00\x00\x00"]),
    version=st.sampled_from([0, 1, 2]),
    codec_id=st.sampled_from([0, 1, 2, 3, 255]),
    flags=st.sampled_from([0, 1, 2, 3, 4]),
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
    _assert_valid_decode(payload, decoded, expected)


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
    _assert_valid_decode(bytes(payload), decoded, x.numel())
    assert payload[:4] == MAGIC


# ========================================================================================== compression
FAST = settings(max_examples=40, deadline=None)
FLOAT16_MAX = 65504.0
BFLOAT16_MAX = float.fromhex("0x1.fep127")

_PIPELINES = [
    Pipeline([]),
    Pipeline([Float16()]),
    Pipeline([BFloat16()]),
    Pipeline([Int8()]),
    Pipeline([Int8(stochastic=False)]),
    Pipeline([Int8(chunk=3)]),
    Pipeline([TopK(0.1)]),
    Pipeline([TopK(0.3, error_feedback=False), Float16()]),
    Pipeline([TopK(0.2), Int8(chunk=2)]),
    Pipeline([RandomK(0.25)]),
    Pipeline([RandomK(0.5, error_feedback=False), BFloat16()]),
    Pipeline([RandomK(0.1), Int8(stochastic=False)]),
]
_COMPRESSED = [pipeline for pipeline in _PIPELINES if not pipeline.lossless]
_FINITE = st.floats(min_value=-(2.0**100), max_value=2.0**100, width=32)
_VECTORS = st.lists(_FINITE, min_size=1, max_size=48).map(lambda xs: torch.tensor(xs, dtype=torch.float32))


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _payload(codec_id: int, flags: int, n: int, body: bytes) -> bytes:
    return struct.pack(HEADER_FORMAT, MAGIC, 1, codec_id, flags, n, len(body)) + body


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        septet, value = value & 0x7F, value >> 7
        out.append(septet | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _sparse_indices(payload: bytes) -> list[int]:
    """Read a sparse payload's indices with a plain LEB128 reader, independent of the module's vectorised one."""
    (k,) = struct.unpack_from("<Q", payload, HEADER_BYTES)
    position, index, indices = HEADER_BYTES + 8, 0, []
    for i in range(k):
        value, shift = 0, 0
        while True:
            byte = payload[position]
            position += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        index = value if i == 0 else index + value
        indices.append(index)
    return indices


def _value_section_bytes(pipeline: Pipeline, m: int) -> int:
    encoder = pipeline.stages[-1] if pipeline.stages else None
    if isinstance(encoder, Float16 | BFloat16):
        return 2 * m
    if isinstance(encoder, Int8):
        if encoder.chunk is None:
            return 4 + m
        return 4 + 4 * math.ceil(m / encoder.chunk) + m
    return 4 * m


def _dense_int8_scales(payload: bytes, n: int) -> tuple[int, np.ndarray]:
    """Return (chunk width, scales) of a dense int8 payload."""
    if struct.unpack_from("<H", payload, 6)[0] & 2:
        (chunk,) = struct.unpack_from("<I", payload, HEADER_BYTES)
        count, offset = math.ceil(n / chunk), HEADER_BYTES + 4
    else:
        chunk, count, offset = max(n, 1), 1, HEADER_BYTES
    return chunk, np.frombuffer(payload, dtype="<f4", count=count, offset=offset)


def _peaks(x: torch.Tensor, chunk: int) -> np.ndarray:
    values = np.abs(x.numpy().astype(np.float64))
    return np.array([values[i : i + chunk].max() for i in range(0, values.size, chunk)])


# ------------------------------------------------------------------------------------------ pipeline
@pytest.mark.parametrize(
    "make",
    [
        lambda: TopK(0.0),
        lambda: TopK(1.5),
        lambda: TopK(float("nan")),
        lambda: RandomK(-0.1),
        lambda: Int8(chunk=0),
        lambda: Int8(chunk=2**32),
    ],
)
def test_stage_rejects_invalid_parameter(make: Callable[[], Stage]) -> None:
    """A ratio outside (0, 1] or a chunk below 1 (or beyond u32) is a ValueError."""
    with pytest.raises(ValueError, match=r"ratio|chunk"):
        make()


@pytest.mark.parametrize(
    "stages",
    [
        [Float16(), TopK(0.1)],
        [TopK(0.1), RandomK(0.1)],
        [Float16(), Int8()],
        [TopK(0.1), Int8(), BFloat16()],
        [Stage()],
    ],
)
def test_pipeline_rejects_invalid_composition(stages: list[Stage]) -> None:
    """Two sparsifiers, two value encoders, a sparsifier after an encoder or a bare Stage is a ValueError."""
    with pytest.raises(ValueError, match=r"stage|sparsifier|encoder"):
        Pipeline(stages)


def test_pipeline_rejects_non_stage() -> None:
    """An item that is not a Stage is a TypeError."""
    with pytest.raises(TypeError, match="Stage"):
        Pipeline(["topk"])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("pipeline", "error_feedback", "lossless"),
    [
        (Pipeline([]), False, True),
        (Pipeline([Int8()]), False, False),
        (Pipeline([TopK(0.1)]), True, False),
        (Pipeline([TopK(0.1, error_feedback=False), Float16()]), False, False),
        (Pipeline([RandomK(ratio=0.1), Int8(chunk=64)]), True, False),
    ],
)
def test_pipeline_properties(pipeline: Pipeline, error_feedback: bool, lossless: bool) -> None:
    """``error_feedback`` is a sparsifier with error feedback; ``lossless`` is no stages."""
    assert pipeline.error_feedback is error_feedback
    assert pipeline.lossless is lossless


def test_stages_accept_positional_and_keyword_arguments() -> None:
    """``TopK(0.1)`` and ``TopK(ratio=0.1)`` are the same stage, and pipelines of equal stages are equal."""
    assert Pipeline([TopK(0.1), Int8(8)]) == Pipeline([TopK(ratio=0.1), Int8(chunk=8)])


# -------------------------------------------------------------------------------------------- lossless
@PROPERTY
@given(_BITS)
def test_lossless_pipeline_round_trips_exactly(bits: list[int]) -> None:
    """The empty pipeline writes what ``encode`` writes, and decodes bit for bit, NaN payloads included."""
    x = _from_bits(bits)
    encoded = Pipeline([]).encode(x)
    assert encoded.payload == encode(x)
    assert encoded.residual is None
    assert _same_bits(encoded.sent, x)
    assert _same_bits(Pipeline([]).decode(encoded.payload, expected_elements=x.numel()), x)


@FAST
@given(pipeline=st.sampled_from(_PIPELINES), x=_VECTORS, seed=st.integers(0, 2**32))
def test_sent_is_exactly_what_the_receiver_decodes(pipeline: Pipeline, x: torch.Tensor, seed: int) -> None:
    """``Encoded.sent`` has the bits ``decode(payload)`` gives, for every pipeline."""
    encoded = pipeline.encode(x, generator=_generator(seed))
    assert _same_bits(decode(encoded.payload, expected_elements=x.numel()), encoded.sent)


def test_same_generator_state_gives_the_same_payload() -> None:
    """Random stages draw only from the given generator: equal seeds give equal payloads."""
    x = torch.randn(1000, generator=_generator(1))
    pipeline = Pipeline([RandomK(0.05), Int8(chunk=16)])
    assert pipeline.encode(x, generator=_generator(7)).payload == pipeline.encode(x, generator=_generator(7)).payload


@pytest.mark.parametrize("stage", [Int8(), RandomK(0.5)])
def test_random_stage_without_generator_is_rejected(stage: Stage) -> None:
    """A stage that draws random numbers raises ValueError when no generator is given."""
    with pytest.raises(ValueError, match="generator"):
        Pipeline([stage]).encode(_vector(10))
    with pytest.raises(ValueError, match="generator"):
        Pipeline([stage]).encode(torch.zeros(0))


def test_pipeline_encode_rejects_2d_tensor() -> None:
    """``Pipeline.encode`` of a 2-D tensor is a ValueError naming its shape."""
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        Pipeline([Float16()]).encode(torch.zeros(2, 3))


# ---------------------------------------------------------------------------------------- half floats
@PROPERTY
@given(st.lists(st.floats(min_value=-FLOAT16_MAX, max_value=FLOAT16_MAX, width=32), min_size=1, max_size=64))
def test_float16_error_within_documented_bound(xs: list[float]) -> None:
    """Float16 decodes within ``2^-11 |x| + 2^-25`` (relative for normals, absolute in the subnormal range)."""
    x = torch.tensor(xs, dtype=torch.float32)
    decoded = decode(Pipeline([Float16()]).encode(x).payload, expected_elements=x.numel()).double()
    assert ((decoded - x.double()).abs() <= 2**-11 * x.double().abs() + 2**-25).all()


@PROPERTY
@given(st.lists(st.floats(min_value=-BFLOAT16_MAX, max_value=BFLOAT16_MAX, width=32), min_size=1, max_size=64))
def test_bfloat16_error_within_documented_bound(xs: list[float]) -> None:
    """BFloat16 decodes within ``2^-8 |x| + 2^-134`` (relative for normals, absolute in the subnormal range)."""
    x = torch.tensor(xs, dtype=torch.float32)
    decoded = decode(Pipeline([BFloat16()]).encode(x).payload, expected_elements=x.numel()).double()
    assert ((decoded - x.double()).abs() <= 2**-8 * x.double().abs() + 2**-134).all()


@pytest.mark.parametrize(("stage", "bound"), [(Float16(), FLOAT16_MAX), (BFloat16(), BFLOAT16_MAX)])
def test_half_floats_saturate_finite_values_and_keep_non_finite(stage: Stage, bound: float) -> None:
    """Finite values beyond the range clamp to ±max; ±inf and NaN stay ±inf and NaN."""
    x = torch.tensor([3.4e38, -3.4e38, float("inf"), float("-inf"), float("nan"), 1.0])
    decoded = decode(Pipeline([stage]).encode(x).payload, expected_elements=6)
    assert decoded[:2].tolist() == [bound, -bound]
    assert decoded[2:4].tolist() == [float("inf"), float("-inf")]
    assert decoded[4].isnan()
    assert decoded[5] == 1.0


def test_bfloat16_body_is_upper_half_of_float32() -> None:
    """For values exact in bfloat16 the body is the upper 16 bits of each float32, little-endian."""
    x = torch.tensor([1.0, -2.5, 0.0, 3.0e-39, 1.5e38])
    x = x.to(torch.bfloat16).float()
    expected = (x.numpy().view("<u4") >> 16).astype("<u2").tobytes()
    assert Pipeline([BFloat16()]).encode(x).payload[HEADER_BYTES:] == expected


def test_float16_body_is_little_endian_binary16() -> None:
    """The Float16 body is the values as little-endian IEEE binary16."""
    x = torch.tensor([1.0, -2.5, 0.0, 65504.0, 2.0**-24])
    assert Pipeline([Float16()]).encode(x).payload[HEADER_BYTES:] == x.numpy().astype("<f2").tobytes()


# ---------------------------------------------------------------------------------------------- int8
_INT8_VECTORS = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=40).map(
    lambda xs: torch.tensor(xs, dtype=torch.float32)
)


@PROPERTY
@given(x=_INT8_VECTORS, chunk=st.sampled_from([None, 1, 3, 8, 100]), seed=st.integers(0, 2**32))
def test_int8_scale_is_smallest_float32_covering_the_peak(x: torch.Tensor, chunk: int | None, seed: int) -> None:
    """Each scale is the smallest float32 ``s`` with ``127 s >= max|x|`` over its chunk (0 for a chunk of zeros)."""
    payload = Pipeline([Int8(chunk=chunk)]).encode(x, generator=_generator(seed)).payload
    width, scales = _dense_int8_scales(payload, x.numel())
    peaks = _peaks(x, width)
    covering = scales.astype(np.float64) * 127 >= peaks
    below = np.nextafter(scales, np.float32(0)).astype(np.float64) * 127 < peaks
    assert covering.all()
    assert (below | (scales == 0)).all()
    assert ((scales == 0) == (peaks == 0)).all()


@PROPERTY
@given(x=_INT8_VECTORS, chunk=st.sampled_from([None, 1, 3, 8]), seed=st.integers(0, 2**32))
def test_int8_stochastic_error_below_one_scale(x: torch.Tensor, chunk: int | None, seed: int) -> None:
    """Stochastic int8 decodes within one scale of ``x``, per chunk."""
    payload = Pipeline([Int8(chunk=chunk)]).encode(x, generator=_generator(seed)).payload
    width, scales = _dense_int8_scales(payload, x.numel())
    per_value = np.repeat(scales.astype(np.float64), width)[: x.numel()]
    error = (decode(payload, expected_elements=x.numel()).double() - x.double()).abs().numpy()
    assert (error <= per_value * (1 + 2**-20)).all()


@PROPERTY
@given(x=_INT8_VECTORS, chunk=st.sampled_from([None, 1, 3, 8]))
def test_int8_deterministic_error_within_half_a_scale(x: torch.Tensor, chunk: int | None) -> None:
    """Round-half-to-even int8 decodes within half a scale of ``x``, per chunk."""
    payload = Pipeline([Int8(chunk=chunk, stochastic=False)]).encode(x).payload
    width, scales = _dense_int8_scales(payload, x.numel())
    per_value = np.repeat(scales.astype(np.float64), width)[: x.numel()]
    error = (decode(payload, expected_elements=x.numel()).double() - x.double()).abs().numpy()
    assert (error <= per_value * (0.5 + 2**-16)).all()


def test_int8_deterministic_rounds_half_to_even() -> None:
    """With scale 1 (peak 127), 0.5 rounds to 0, 1.5 and 2.5 to 2, -0.5 to 0."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5])
    decoded = decode(Pipeline([Int8(stochastic=False)]).encode(x).payload, expected_elements=5)
    assert decoded.tolist() == [127.0, 0.0, 2.0, 2.0, 0.0]


@pytest.mark.slow
def test_int8_stochastic_rounding_is_unbiased() -> None:
    """The mean of stochastic int8 decodes over 4000 generators is within 5 standard errors of ``x``."""
    draws = 4000
    x = torch.linspace(-1.0, 1.0, 41) * 0.9 + 0.003
    x[7] = 1.0  # the peak: scale = 1/127 (rounded up)
    pipeline = Pipeline([Int8()])
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for seed in range(draws):
        total += pipeline.decode(pipeline.encode(x, generator=_generator(seed)).payload, expected_elements=41).double()
    _, scales = _dense_int8_scales(pipeline.encode(x, generator=_generator(0)).payload, 41)
    scale = float(scales[0])
    ratio = x.double() / scale
    fraction = ratio - ratio.floor()
    standard_error = scale * torch.sqrt(fraction * (1 - fraction) / draws)
    assert ((total / draws - x.double()).abs() <= 5 * standard_error + 1e-6 * scale).all()


def test_int8_chunk_of_zeros_has_zero_scale() -> None:
    """A chunk of zeros gets scale 0 and decodes to zeros, whatever the other chunks hold."""
    x = torch.tensor([0.0, 0.0, 0.0, 5.0, -1.0, 2.0, 0.0])
    payload = Pipeline([Int8(chunk=3)]).encode(x, generator=_generator()).payload
    _, scales = _dense_int8_scales(payload, 7)
    assert scales[0] == 0.0
    assert decode(payload, expected_elements=7)[:3].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_int8_rejects_non_finite_values(bad: float) -> None:
    """Int8 cannot represent inf or NaN: encoding them is a ValueError."""
    with pytest.raises(ValueError, match="finite"):
        Pipeline([Int8()]).encode(torch.tensor([1.0, bad]), generator=_generator())


# ------------------------------------------------------------------------------------------ sparsifiers
@PROPERTY
@given(
    xs=st.lists(_FINITE, min_size=1, max_size=200, unique_by=abs),
    ratio=st.floats(min_value=0.001, max_value=1.0),
)
def test_top_k_keeps_exactly_the_k_largest_magnitudes(xs: list[float], ratio: float) -> None:
    """Top-k sends ``max(1, ceil(ratio n))`` indices, and no dropped value outweighs a kept one."""
    x = torch.tensor(xs, dtype=torch.float32)
    k = max(1, math.ceil(ratio * x.numel()))
    payload = Pipeline([TopK(ratio, error_feedback=False)]).encode(x).payload
    kept = _sparse_indices(payload)
    assert len(kept) == k
    dropped = sorted(set(range(x.numel())) - set(kept))
    if dropped:
        assert x[kept].abs().min() >= x[dropped].abs().max()


def test_top_k_ties_go_to_lower_indices() -> None:
    """Among equal magnitudes top-k keeps the lowest indices."""
    payload = Pipeline([TopK(0.3)]).encode(torch.ones(10)).payload
    assert _sparse_indices(payload) == [0, 1, 2]


def test_top_k_is_exact_when_the_threshold_sample_misleads() -> None:
    """Large values placed only on the sampled stride still give the exact top k (the fallback path)."""
    n, k = 100_000, 1000
    x = torch.rand(n, generator=_generator(3)) * 0.5
    x[0 : 400 * 6 : 6] = 10.0 + torch.arange(400, dtype=torch.float32)
    payload = Pipeline([TopK(k / n)]).encode(x).payload
    assert _sparse_indices(payload) == sorted(torch.topk(x.abs(), k).indices.tolist())


def test_top_k_treats_nan_as_largest() -> None:
    """A NaN is kept by top-k, so a non-finite update stays visibly non-finite."""
    x = torch.tensor([1.0, float("nan"), 3.0, -2.0])
    encoded = Pipeline([TopK(0.25)]).encode(x)
    assert _sparse_indices(encoded.payload) == [1]
    assert encoded.sent[1].isnan()


@PROPERTY
@given(n=st.integers(1, 3000), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 2**32))
def test_random_k_keeps_k_distinct_indices(n: int, ratio: float, seed: int) -> None:
    """Random-k sends k strictly increasing indices below n, with the values unscaled under error feedback."""
    x = torch.arange(1, n + 1, dtype=torch.float32)
    encoded = Pipeline([RandomK(ratio)]).encode(x, generator=_generator(seed))
    kept = _sparse_indices(encoded.payload)
    assert len(kept) == max(1, math.ceil(ratio * n))
    assert all(a < b for a, b in itertools.pairwise(kept))
    assert kept[-1] < n
    assert torch.equal(encoded.sent[kept], x[kept])


@pytest.mark.slow
def test_random_k_without_error_feedback_is_unbiased() -> None:
    """Without error feedback the kept values are scaled by n/k: the mean over 4000 draws is ``x``."""
    draws, n, k = 4000, 20, 5
    x = torch.linspace(-2.0, 3.0, n)
    pipeline = Pipeline([RandomK(k / n, error_feedback=False)])
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(draws):
        total += pipeline.encode(x, generator=_generator(seed)).sent.double()
    standard_error = x.double().abs() * math.sqrt((n / k - 1) / draws)
    assert ((total / draws - x.double()).abs() <= 5 * standard_error + 1e-9).all()


@pytest.mark.slow
def test_random_k_small_ratio_draws_indices_uniformly() -> None:
    """With k much smaller than n every region of indices is kept about equally often."""
    n, k, draws, bins = 1000, 10, 2000, 10
    pipeline = Pipeline([RandomK(k / n)])
    counts = np.zeros(bins)
    for seed in range(draws):
        kept = _sparse_indices(pipeline.encode(torch.ones(n), generator=_generator(seed)).payload)
        np.add.at(counts, np.array(kept) * bins // n, 1)
    expected = draws * k / bins
    assert (np.abs(counts - expected) <= 5 * math.sqrt(expected)).all()


# ------------------------------------------------------------------------------------- error feedback
@pytest.mark.parametrize(
    "pipeline",
    [Pipeline([TopK(0.05)]), Pipeline([RandomK(0.05)]), Pipeline([TopK(0.05), Int8(chunk=16)])],
    ids=["topk", "randomk", "topk-int8"],
)
def test_error_feedback_conserves_the_sum(pipeline: Pipeline) -> None:
    """Over 20 rounds, ``sum(sent) + final residual == sum(deltas)``: nothing is lost, only delayed."""
    generator = _generator(11)
    residual: torch.Tensor | None = None
    sent_total = torch.zeros(500, dtype=torch.float64)
    delta_total = torch.zeros(500, dtype=torch.float64)
    for _ in range(20):
        delta = torch.randn(500, generator=generator)
        encoded = pipeline.encode(delta, generator=generator, residual=residual)
        residual = encoded.residual
        sent_total += encoded.sent.double()
        delta_total += delta.double()
    assert residual is not None
    assert torch.allclose(sent_total + residual.double(), delta_total, rtol=1e-5, atol=1e-5)


@FAST
@given(x=_VECTORS, seed=st.integers(0, 2**32))
def test_residual_is_corrected_minus_sent(x: torch.Tensor, seed: int) -> None:
    """The new residual is ``(x + residual) - sent`` in float32, value quantisation error included."""
    previous = torch.randn(x.numel(), generator=_generator(seed))
    encoded = Pipeline([TopK(0.3), Int8(chunk=4)]).encode(x, generator=_generator(seed), residual=previous)
    assert encoded.residual is not None
    assert _same_bits(encoded.residual, (x + previous) - encoded.sent)


def test_no_error_feedback_returns_no_residual() -> None:
    """A pipeline without error feedback returns ``residual=None``."""
    assert Pipeline([TopK(0.5, error_feedback=False)]).encode(_vector(10)).residual is None


def test_residual_without_error_feedback_is_rejected() -> None:
    """Passing a residual to a pipeline that keeps none is a ValueError."""
    with pytest.raises(ValueError, match="error feedback"):
        Pipeline([Float16()]).encode(_vector(10), residual=torch.zeros(10))


def test_residual_of_wrong_length_is_rejected() -> None:
    """A residual of another length than the update is a ValueError."""
    with pytest.raises(ValueError, match="residual"):
        Pipeline([TopK(0.5)]).encode(_vector(10), residual=torch.zeros(9))


# ------------------------------------------------------------------------------------------------ sizes
def test_top_k_one_percent_payload_is_under_a_thirtieth_of_dense() -> None:
    """Top-k at 1% of 100,000 float32 values takes less than 1/30 of the dense payload."""
    x = torch.randn(100_000, generator=_generator())
    assert len(Pipeline([TopK(0.01)]).encode(x).payload) < len(encode(x)) / 30


@pytest.mark.parametrize(("chunk", "scale_bytes"), [(None, 4), (1000, 4 + 4 * 100)])
def test_int8_dense_payload_is_a_quarter_of_dense(chunk: int | None, scale_bytes: int) -> None:
    """Dense int8 of 100,000 values is n bytes plus the header, the scales and the chunk size."""
    x = torch.randn(100_000, generator=_generator())
    payload = Pipeline([Int8(chunk=chunk)]).encode(x, generator=_generator()).payload
    assert len(payload) == HEADER_BYTES + scale_bytes + 100_000
    assert len(payload) < len(encode(x)) / 4 + 512


@FAST
@given(pipeline=st.sampled_from(_PIPELINES), x=_VECTORS, seed=st.integers(0, 2**32))
def test_payload_length_is_header_plus_body_exactly(pipeline: Pipeline, x: torch.Tensor, seed: int) -> None:
    """``len(payload)`` is 24 + the body the format table describes, and the header's body_bytes says so."""
    payload = pipeline.encode(x, generator=_generator(seed)).payload
    n = x.numel()
    if pipeline.stages and isinstance(pipeline.stages[0], TopK | RandomK):
        kept = _sparse_indices(payload)
        deltas = [kept[0]] + [b - a for a, b in itertools.pairwise(kept)]
        body = 8 + sum(len(_varint(delta)) for delta in deltas) + _value_section_bytes(pipeline, len(kept))
    else:
        body = _value_section_bytes(pipeline, n)
    assert len(payload) == HEADER_BYTES + body
    assert struct.unpack_from("<Q", payload, 16) == (body,)


def test_compressed_header_fields() -> None:
    """Top-k + chunked int8 writes codec id 3 and flags sparse | int8-chunked."""
    payload = Pipeline([TopK(0.5), Int8(chunk=2)]).encode(_vector(8), generator=_generator()).payload
    assert struct.unpack_from(HEADER_FORMAT, payload)[1:5] == (1, 3, 0b11, 8)


@pytest.mark.parametrize(("stage", "codec_id"), [(Float16(), 1), (BFloat16(), 2), (Int8(), 3)])
def test_value_encoders_write_their_codec_id(stage: Stage, codec_id: int) -> None:
    """Float16, BFloat16 and Int8 write codec ids 1, 2 and 3 with no flags when dense."""
    payload = Pipeline([stage]).encode(_vector(4), generator=_generator()).payload
    assert (payload[5], struct.unpack_from("<H", payload, 6)[0]) == (codec_id, 0)


def test_empty_vector_round_trips_through_every_pipeline() -> None:
    """An empty vector encodes and decodes to an empty vector with every pipeline."""
    for pipeline in _PIPELINES:
        encoded = pipeline.encode(torch.zeros(0), generator=_generator())
        assert decode(encoded.payload, expected_elements=0).shape == (0,)


# -------------------------------------------------------------------------------------- malformed input
def _f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


@pytest.mark.parametrize(
    ("codec_id", "flags", "n", "body", "match"),
    [
        (0, 1, 4, struct.pack("<Q", 5), "kept values"),
        (0, 1, 4, struct.pack("<Q", 3) + b"\x01", "bytes follow"),
        (0, 1, 4, struct.pack("<Q", 2) + b"\x01\x00" + _f32(1, 2), "increasing"),
        (0, 1, 4, struct.pack("<Q", 2) + b"\x01\x03" + _f32(1, 2), "beyond"),
        (0, 1, 4, struct.pack("<Q", 1) + b"\x04" + _f32(1), "beyond"),
        (0, 1, 4, struct.pack("<Q", 1) + b"\x81\x00" + _f32(1), "overlong"),
        (0, 1, 4, struct.pack("<Q", 1) + b"\x80" * 10 + b"\x00" + _f32(1), "varint"),
        (0, 1, 4, struct.pack("<Q", 1) + b"\xff" * 9 + b"\x02" + _f32(1), "64 bits"),
        (0, 1, 4, struct.pack("<Q", 2) + b"\x01" + b"\xff" * 9 + b"\x01" + _f32(1, 2), "increasing"),
        (0, 1, 4, struct.pack("<Q", 1) + b"\x01" + _f32(1) + b"\x00", "bytes of values"),
        (0, 1, 4, struct.pack("<Q", 2) + b"\x81\x81", "ends before"),
        (0, 1, 4, b"\x00" * 7, "count"),
        (3, 2, 4, b"\x00\x00", "chunk size"),
        (3, 2, 4, struct.pack("<I", 0) + _f32(1) + b"\x01" * 4, "at least 1"),
        (3, 2, 4, struct.pack("<I", 2) + _f32(1) + b"\x01" * 4, "bytes of values"),
        (3, 0, 4, _f32(float("nan")) + b"\x01" * 4, "scale"),
        (3, 0, 4, _f32(float("inf")) + b"\x01" * 4, "scale"),
        (3, 0, 4, _f32(-1.0) + b"\x01" * 4, "scale"),
        (3, 0, 4, _f32(1.0) + b"\x01\x80\x01\x01", "-128"),
        (3, 1, 4, struct.pack("<Q", 1) + b"\x00" + _f32(1.0) + b"\x80", "-128"),
        (0, 2, 4, _f32(1, 2, 3, 4), "int8-chunked"),
        (1, 0, 4, _f32(1, 2, 3, 4), "float16 body"),
        (2, 0, 4, b"\x00" * 7, "bfloat16 body"),
    ],
)
def test_decode_rejects_malformed_body(codec_id: int, flags: int, n: int, body: bytes, match: str) -> None:
    """Bad counts, indices, varints, chunk sizes, scales, codes or lengths are each a DecodeError."""
    with pytest.raises(DecodeError, match=match):
        decode(_payload(codec_id, flags, n, body), expected_elements=n)


def test_decode_accepts_a_hand_written_sparse_payload() -> None:
    """A sparse float32 body written by hand from the format table decodes as documented."""
    body = struct.pack("<Q", 3) + _varint(1) + _varint(200) + _varint(1) + _f32(1.5, -2.0, 4.0)
    decoded = decode(_payload(0, 1, 300, body), expected_elements=300)
    assert decoded.nonzero().flatten().tolist() == [1, 201, 202]
    assert decoded[[1, 201, 202]].tolist() == [1.5, -2.0, 4.0]


_HUGE = [
    (0, 0, b""),
    (3, 2, struct.pack("<I", 1)),
    (0, 1, struct.pack("<Q", 1) + b"\x00" + _f32(1.0)),
    (3, 3, struct.pack("<Q", 1) + b"\x00" + struct.pack("<I", 1) + _f32(1.0) + b"\x01"),
]


def _decode_peak_bytes(payload: bytes, expected: int) -> int:
    """Return the peak bytes traced while ``decode`` rejects ``payload``."""
    tracemalloc.start()
    try:
        with pytest.raises(DecodeError):
            decode(payload, expected_elements=expected)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


@pytest.mark.parametrize(("codec_id", "flags", "body"), _HUGE)
def test_header_claiming_2_to_the_60_elements_is_rejected_without_allocating(
    codec_id: int, flags: int, body: bytes
) -> None:
    """A header claiming 2^60 elements for a 1000-element model is a DecodeError, allocating under 1 MB."""
    assert _decode_peak_bytes(_payload(codec_id, flags, 2**60, body), 1000) < 2**20


@pytest.mark.parametrize(("codec_id", "flags", "body"), _HUGE[:2])
def test_dense_header_of_2_to_the_60_elements_with_short_body_is_rejected_without_allocating(
    codec_id: int, flags: int, body: bytes
) -> None:
    """Even when 2^60 elements are expected, a dense body too short for them is rejected before any allocation."""
    assert _decode_peak_bytes(_payload(codec_id, flags, 2**60, body), 2**60) < 2**20


def test_sparse_vector_too_large_to_allocate_is_a_decode_error() -> None:
    """A valid sparse payload whose expected n cannot be allocated is a DecodeError, not a MemoryError."""
    with pytest.raises(DecodeError, match="allocate"):
        decode(_payload(*_HUGE[2][:2], 2**60, _HUGE[2][2]), expected_elements=2**60)


@pytest.mark.parametrize("pipeline", _COMPRESSED, ids=repr)
def test_every_truncation_of_compressed_payloads_is_rejected(pipeline: Pipeline) -> None:
    """Every prefix of a compressed payload is a DecodeError, also with the header's body length patched to match."""
    x = torch.randn(40, generator=_generator(5))
    payload = pipeline.encode(x, generator=_generator(5)).payload
    for length in range(len(payload)):
        with pytest.raises(DecodeError):
            decode(payload[:length], expected_elements=40)
        if length >= HEADER_BYTES:
            with pytest.raises(DecodeError):
                decode(_patched(payload[:length], 16, "<Q", length - HEADER_BYTES), expected_elements=40)


@PROPERTY
@given(pipeline=st.sampled_from(_COMPRESSED), x=_VECTORS, data=st.data())
def test_corrupted_compressed_payload_decodes_or_raises_decode_error(
    pipeline: Pipeline, x: torch.Tensor, data: st.DataObject
) -> None:
    """A compressed payload with one byte replaced raises DecodeError or decodes to n float32 values."""
    payload = bytearray(pipeline.encode(x, generator=_generator()).payload)
    index = data.draw(st.integers(min_value=0, max_value=len(payload) - 1))
    payload[index] = data.draw(st.integers(min_value=0, max_value=255))
    try:
        decoded = decode(bytes(payload), expected_elements=x.numel())
    except DecodeError:
        return
    _assert_valid_decode(bytes(payload), decoded, x.numel())


@PROPERTY
@given(
    codec_id=st.integers(0, 3),
    flags=st.integers(0, 3),
    n=st.integers(0, 12),
    body=st.binary(max_size=80),
)
def test_arbitrary_body_behind_a_valid_header_decodes_or_raises_decode_error(
    codec_id: int, flags: int, n: int, body: bytes
) -> None:
    """Random bodies behind a consistent header raise DecodeError or decode to n float32 values."""
    payload = _payload(codec_id, flags, n, body)
    try:
        decoded = decode(payload, expected_elements=n)
    except DecodeError:
        return
    _assert_valid_decode(payload, decoded, n)


def test_a_pipeline_says_whether_encoding_draws_random_numbers() -> None:
    """draws_random: RandomK and stochastic Int8 need a generator; the other stages do not."""
    assert not Pipeline().draws_random
    assert not Pipeline([TopK(0.1), Int8(stochastic=False)]).draws_random
    assert not Pipeline([Float16()]).draws_random
    assert Pipeline([RandomK(0.1)]).draws_random
    assert Pipeline([TopK(0.1), Int8()]).draws_random
    with pytest.raises(ValueError, match="generator"):
        Pipeline([Int8()]).encode(torch.ones(4))


@pytest.mark.parametrize("stages", [(), (Float16(),), (BFloat16(),)], ids=["float32", "float16", "bfloat16"])
def test_payloads_of_one_dense_form_decode_together_bit_for_bit(stages: tuple[Stage, ...]) -> None:
    """decode_stacked's rows are decode()'s vectors, bit for bit, written into ``out`` when one is given."""
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(37, generator=generator) * 10.0**k for k in range(-3, 4)]
    vectors.append(torch.tensor([math.inf, -math.inf, math.nan] + [0.0] * 34))
    payloads = [Pipeline(stages).encode(v).payload for v in vectors]
    stacked = decode_stacked(payloads, expected_elements=37)
    assert stacked is not None and stacked.shape == (len(payloads), 37) and stacked.dtype == torch.float32
    for row, payload in zip(stacked, payloads, strict=True):
        alone = decode(payload, expected_elements=37)
        assert torch.equal(row.view(torch.int32), alone.view(torch.int32))  # NaN payloads included
    out = torch.full((len(payloads), 37), 7.0)
    assert decode_stacked(payloads, expected_elements=37, out=out) is out
    assert torch.equal(out.view(torch.int32), stacked.view(torch.int32))


def test_payloads_not_all_of_one_dense_form_are_not_decoded_together() -> None:
    """None, and nothing decoded, for sparse or int8 payloads, a mix of forms, another length, a broken header or
    body, or no payload at all: decode() each one then names what is wrong."""
    dense = encode(torch.ones(8))
    generator = torch.Generator().manual_seed(0)
    int8 = Pipeline([Int8()]).encode(torch.ones(8), generator=generator).payload
    half = Pipeline([Float16()]).encode(torch.ones(8)).payload
    for batch in (
        [Pipeline([TopK(ratio=0.5)]).encode(torch.ones(8)).payload] * 2,
        [int8, int8],
        [dense, half],
        [dense, encode(torch.ones(9))],
        [dense, dense[:-1]],
        [dense, b"XXXX" + dense[4:]],
        [bytearray(dense), dense],
        [],
    ):
        assert decode_stacked(batch, expected_elements=8) is None
    assert decode_stacked([encode(torch.ones(9))] * 2, expected_elements=8) is None


def test_decode_stacked_refuses_an_out_of_another_shape() -> None:
    """``out`` must be a contiguous float32 CPU tensor with a row per payload."""
    with pytest.raises(ValueError, match="out must be"):
        decode_stacked([encode(torch.ones(4))] * 2, expected_elements=4, out=torch.empty(3, 4))


@given(st.lists(_BITS.filter(lambda bits: len(bits) == 6), min_size=1, max_size=5))
@PROPERTY
def test_rows_encode_together_as_each_alone(rows: list[list[int]]) -> None:
    """encode_rows gives each row's encode() payload, byte for byte (NaN payloads, -0.0 and subnormals included)."""
    stacked = torch.stack([_from_bits(bits) for bits in rows])
    assert encode_rows(stacked) == [encode(row) for row in stacked]
    assert Pipeline().encode_rows(stacked) == [Pipeline().encode(row).payload for row in stacked]


def test_rows_of_another_dtype_or_layout_encode_as_encode_does() -> None:
    """Float64 rows are narrowed and a transposed tensor's rows read in order, as encode() of each row does."""
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(4, 9, dtype=torch.float64, generator=generator)
    assert encode_rows(wide) == [encode(row) for row in wide]
    transposed = torch.randn(9, 4, generator=generator).t()
    assert not transposed.is_contiguous()
    assert encode_rows(transposed) == [encode(row) for row in transposed]
    assert encode_rows(torch.empty(0, 3)) == []


def test_only_a_lossless_pipeline_encodes_rows_together() -> None:
    """A pipeline with a stage returns None (each row is encoded with its own generator and residual then); rows
    must be 2-D."""
    rows = torch.ones(2, 8)
    assert Pipeline([Float16()]).encode_rows(rows) is None
    assert Pipeline([TopK(0.5)]).encode_rows(rows) is None
    with pytest.raises(ValueError, match="2-D"):
        encode_rows(torch.ones(8))


@FAST
@given(pipeline=st.sampled_from(_PIPELINES), x=_VECTORS, seed=st.integers(0, 2**32))
def test_payload_nbytes_is_the_lossless_payloads_length_and_unknown_otherwise(
    pipeline: Pipeline, x: torch.Tensor, seed: int
) -> None:
    """payload_nbytes is the length of what the lossless pipeline encodes, and None where the values decide it."""
    expected = len(pipeline.encode(x, generator=_generator(seed)).payload) if pipeline.lossless else None
    assert pipeline.payload_nbytes(x.numel()) == expected


def test_payload_nbytes_of_an_empty_vector_is_the_header() -> None:
    """The lossless payload of no values is its header alone."""
    assert Pipeline().payload_nbytes(0) == len(Pipeline().encode(torch.zeros(0)).payload) == HEADER.size
