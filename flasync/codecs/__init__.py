"""Wire format of updates and models: real bytes, no pickle, optionally compressed.

Every payload is a fixed 24-byte little-endian header followed by a body::

    offset  size  field
    0       4     magic            b"FLSU"
    4       1     format version   1
    5       1     codec id         value encoding: 0 = float32, 1 = float16, 2 = bfloat16, 3 = int8
    6       2     flags            bit 0 = sparse, bit 1 = int8 chunked; any other bit set is rejected
    8       8     num_elements     length n of the decoded flat vector (uint64)
    16      8     body_bytes       length of the body that follows (uint64)
    24      ...   body             see below

A *value section* holds m values (m = n when dense, m = k when sparse) in the codec's encoding::

    codec      value section                                              bytes
    float32    m little-endian IEEE binary32                              4 m
    float16    m little-endian IEEE binary16                              2 m
    bfloat16   m little-endian u16: the upper 16 bits of the binary32     2 m
    int8       [u32 chunk size c, only if chunked]                        4 (chunked only)
               float32 scales: ceil(m / c) if chunked, else exactly 1     4 * scales
               m int8 codes q in [-127, 127]; value = scale * q           m

The body is the value section of all n values when dense. When sparse (flags bit 0) it is::

    u64 k                      number of kept values, k <= n
    k LEB128 unsigned varints  the kept indices, strictly increasing, delta-encoded (the first one absolute);
                               each varint is canonical (no trailing 0x00 byte) and at most 10 bytes
    value section              the k kept values, in index order (int8 scales are computed over the k values)

Decoded, the indices not sent are 0. ``len(payload)`` is the size that is accounted as upload or download bytes.
:func:`decode` validates magic, version, flags, codec, the element count against the expected one and every length
before it reads a single value, so truncated, oversized, corrupted or foreign bytes raise
:class:`~flasync.core.errors.DecodeError`; the only buffer sized from the header is the n-element output, and n must
equal the caller's ``expected_elements``.

:func:`encode` writes the lossless dense float32 payload. A :class:`Pipeline` of :class:`Stage` objects writes the
compressed ones: at most one sparsifier (:class:`TopK`, :class:`RandomK`) first, then at most one value encoder
(:class:`Float16`, :class:`BFloat16`, :class:`Int8`). A sparsifier may keep *error feedback* (Seide et al. 2014,
"1-bit stochastic gradient descent ..."; Stich, Cordonnier and Jaggi 2018, "Sparsified SGD with memory"; Lin et al.
2018, "Deep Gradient Compression"): with residual e_t and compressor C,

    p_t = x_t + e_t,    sent_t = C(p_t),    e_{t+1} = p_t - sent_t

so that sum_t sent_t + e_T = sum_t x_t: nothing a client computed is lost, only delayed.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import ClassVar, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from flasync.core.errors import DecodeError

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "MAGIC",
    "BFloat16",
    "CodecId",
    "Encoded",
    "Flag",
    "Float16",
    "Int8",
    "NonZero",
    "Pipeline",
    "RandomK",
    "Stage",
    "TopK",
    "decode",
    "decode_stacked",
    "encode",
    "encode_rows",
]

MAGIC = b"FLSU"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBHQQ")

_LITTLE_ENDIAN = sys.byteorder == "little"  # float32 arrays are the wire's "<f4" as they are
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_MAX_VARINT_BYTES = 10
_FLOAT16_MAX = 65504.0
_BFLOAT16_MAX = float.fromhex("0x1.fep127")  # 0x7F7F: the largest finite bfloat16
_INT8_LEVELS = 127
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT8_OVERFLOW_SCALE = _FLOAT32_MAX / 128  # below this, 127 s cannot round past the largest float32

_F32: TypeAlias = npt.NDArray[np.float32]
_I64: TypeAlias = npt.NDArray[np.int64]
_Buffer: TypeAlias = bytes | memoryview
_Scalar = TypeVar("_Scalar", bound=np.generic)


class CodecId(IntEnum):
    """Value encoding named by the header's codec id byte."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    INT8 = 3


class Flag(IntFlag):
    """Bits of the header's flags field."""

    SPARSE = 1
    INT8_CHUNKED = 2


_KNOWN_FLAGS = int(Flag.SPARSE | Flag.INT8_CHUNKED)
_SPARSE, _INT8_CHUNKED = int(Flag.SPARSE), int(Flag.INT8_CHUNKED)  # plain ints: enum operators cost per upload
_CODECS = {int(codec): codec for codec in CodecId}


# ------------------------------------------------------------------------------------------------ stages
@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One step of a :class:`Pipeline`: a sparsifier or a value encoder (use the concrete subclasses)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _ValueEncoder(Stage):
    """A stage that chooses how the (kept) values are written: the payload's codec id."""

    codec_id: ClassVar[CodecId]


@dataclass(frozen=True, slots=True)
class Float16(_ValueEncoder):
    """Write values as IEEE binary16 (Micikevicius et al. 2018, "Mixed precision training").

    Rounding is to nearest, ties to even: ``|x_hat - x| <= 2^-11 |x|`` for normal values (``2^-14 <= |x| <=
    65504``), and ``|x_hat - x| <= 2^-25`` below, where binary16 is subnormal (values under ``2^-25`` become
    ``±0``). Finite values beyond the range saturate to ``±65504``; ``±inf`` and NaN pass as ``±inf`` and NaN,
    so a diverged update still reads as non-finite.
    """

    codec_id: ClassVar[CodecId] = CodecId.FLOAT16


@dataclass(frozen=True, slots=True)
class BFloat16(_ValueEncoder):
    """Write values as bfloat16, the upper half of binary32 (Kalamkar et al. 2019, "A study of BFLOAT16 ...").

    Rounding is to nearest, ties to even: ``|x_hat - x| <= 2^-8 |x|`` for normal values, ``<= 2^-134`` in the
    subnormal range. Finite values beyond the largest bfloat16 (``≈ 3.3895e38``) saturate to it; ``±inf`` and NaN
    pass as ``±inf`` and NaN.
    """

    codec_id: ClassVar[CodecId] = CodecId.BFLOAT16


@dataclass(frozen=True, slots=True)
class Int8(_ValueEncoder):
    """Write values as int8 codes with a float32 scale per tensor or per chunk of ``chunk`` values.

    The scale of a chunk is ``s = max|x| / 127`` (rounded up to a float32 so that ``|x| / s <= 127``; a chunk of
    zeros has ``s = 0``). With ``stochastic`` rounding (Gupta et al. 2015, "Deep learning with limited numerical
    precision"; Alistarh et al. 2017, "QSGD") ``q = floor(x / s + u)``, ``u ~ U[0, 1)`` from the generator, so
    ``E[s q] = x`` and ``|s q - x| < s``; otherwise ``q = round_half_even(x / s)`` and ``|s q - x| <= s / 2``.
    Codes are clamped to ``[-127, 127]``; a decoded ``s q`` beyond the largest float32 (possible only when
    ``max|x|`` is within an ulp of it) saturates to it. Per-chunk scales (Dettmers et al. 2022, "8-bit optimizers
    via block-wise quantization") bound the error by the chunk's own magnitude, at ``4 / chunk`` extra bytes per
    value. Int8 cannot represent ``inf`` or NaN: encoding them raises ``ValueError``.

    Args:
        chunk: Values per scale; ``None`` for one scale over the whole vector.
        stochastic: Unbiased stochastic rounding (needs a generator) rather than round-half-to-even.
    """

    codec_id: ClassVar[CodecId] = CodecId.INT8
    chunk: int | None = None
    stochastic: bool = True

    def __post_init__(self) -> None:
        if self.chunk is not None and (
            isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 1 <= self.chunk < 2**32
        ):
            raise ValueError(f"Int8 chunk must be None or an integer in [1, 2**32 - 1], got {self.chunk!r}")


@dataclass(frozen=True, slots=True)
class _Sparsifier(Stage):
    """A stage that keeps ``k = max(1, ceil(ratio * n))`` of the n values and sends their indices."""

    ratio: float
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, int | float) or not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"{type(self).__name__} ratio must be a number in (0, 1], got {self.ratio!r}")

    def kept(self, num_elements: int) -> int:
        """Return how many of ``num_elements`` values are kept (0 only for an empty vector)."""
        return 0 if num_elements == 0 else min(num_elements, max(1, math.ceil(self.ratio * num_elements)))


@dataclass(frozen=True, slots=True)
class TopK(_Sparsifier):
    """Keep the k values of largest magnitude (Aji and Heafield 2017; Stich et al. 2018; Lin et al. 2018).

    Top-k is biased, so it is meant to run with error feedback (the default). Ties at the k-th magnitude go to the
    lower indices; NaN counts as the largest magnitude, so a non-finite update stays non-finite.

    Args:
        ratio: Fraction of values kept, in ``(0, 1]``; ``k = max(1, ceil(ratio * n))``.
        error_feedback: Carry what was not sent into the next round's residual.
    """


@dataclass(frozen=True, slots=True)
class RandomK(_Sparsifier):
    """Keep k indices drawn uniformly without replacement (Stich et al. 2018; Wangni et al. 2018).

    Without error feedback the kept values are scaled by ``n / k``, which makes the estimate unbiased
    (``E[sent] = x``); with error feedback they are sent unscaled and the rest goes into the residual.

    Args:
        ratio: Fraction of values kept, in ``(0, 1]``; ``k = max(1, ceil(ratio * n))``.
        error_feedback: Carry what was not sent into the next round's residual.
    """


@dataclass(frozen=True, slots=True)
class NonZero(_Sparsifier):
    """Send the nonzero values and their indices, or the dense vector where that is smaller: lossless.

    What a pruned model's weights and updates are sent with (``model.prune``): their pruned entries are exact
    zeros, which the sparse form leaves out. The indices are delta-encoded varints, about one byte each at a
    density of 1/5, so the sparse form costs about ``5 k`` bytes for ``k`` nonzeros against ``4 n`` dense; where
    ``5 k >= 4 n`` the payload is the dense one.
    """

    ratio: float = 1.0
    error_feedback: bool = False


# ------------------------------------------------------------------------------------------------ pipeline
@dataclass(frozen=True, slots=True, kw_only=True)
class Encoded:
    """The result of :meth:`Pipeline.encode`.

    Attributes:
        payload: The bytes on the wire.
        residual: The new error-feedback residual ``p - sent`` (1-D float32), or ``None`` without error feedback.
        decoded: What the receiver decodes, when the encoder computed it (None: :attr:`sent` decodes the payload).
    """

    payload: bytes
    residual: torch.Tensor | None
    decoded: torch.Tensor | None = field(default=None, repr=False)

    @property
    def sent(self) -> torch.Tensor:
        """The dense float32 vector the receiver decodes from ``payload`` (bit for bit; a new tensor)."""
        if self.decoded is not None:
            return self.decoded
        return decode(self.payload, expected_elements=HEADER.unpack_from(self.payload)[4])


class Pipeline:
    """A validated sequence of compression stages: ``[sparsifier][value encoder]``, both optional.

    The empty pipeline is lossless dense float32, byte for byte what :func:`encode` writes.

    Args:
        stages: At most one sparsifier (:class:`TopK`, :class:`RandomK`), first if present, and at most one value
            encoder (:class:`Float16`, :class:`BFloat16`, :class:`Int8`), last if present.

    Raises:
        ValueError: If the stages are not in that shape.
        TypeError: If an item is not a :class:`Stage`.
    """

    __slots__ = ("_draws_random", "_sparsifier", "_stages", "_values")

    def __init__(self, stages: Sequence[Stage] = ()) -> None:
        stages = tuple(stages)
        for stage in stages:
            if not isinstance(stage, Stage):
                raise TypeError(f"pipeline stages must be Stage objects, got {stage!r}")
            if not isinstance(stage, _Sparsifier | _ValueEncoder):
                raise ValueError(
                    f"{stage!r} is not a concrete stage; use TopK, RandomK, NonZero, Float16, BFloat16 or Int8"
                )
        sparsifiers = [i for i, stage in enumerate(stages) if isinstance(stage, _Sparsifier)]
        encoders = [i for i, stage in enumerate(stages) if isinstance(stage, _ValueEncoder)]
        if len(sparsifiers) > 1:
            raise ValueError(f"a pipeline has at most one sparsifier (TopK or RandomK), got {len(sparsifiers)}")
        if sparsifiers and sparsifiers[0] != 0:
            raise ValueError(f"the sparsifier {stages[sparsifiers[0]]!r} must be the first stage")
        if len(encoders) > 1:
            raise ValueError(f"a pipeline has at most one value encoder (Float16, BFloat16, Int8), got {len(encoders)}")
        if encoders and encoders[0] != len(stages) - 1:
            raise ValueError(f"the value encoder {stages[encoders[0]]!r} must be the last stage")
        self._stages = stages
        first, last = (stages[0], stages[-1]) if stages else (None, None)
        self._sparsifier = first if isinstance(first, _Sparsifier) else None
        self._values = last if isinstance(last, _ValueEncoder) else None
        self._draws_random = any(isinstance(s, RandomK) or (isinstance(s, Int8) and s.stochastic) for s in stages)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages, in order."""
        return self._stages

    @property
    def error_feedback(self) -> bool:
        """Whether a sparsifier with error feedback is present (and :attr:`Encoded.residual` is returned)."""
        return self._sparsifier is not None and self._sparsifier.error_feedback

    @property
    def draws_random(self) -> bool:
        """Whether a stage draws random numbers (:class:`RandomK`, stochastic :class:`Int8`): ``encode`` then needs a
        generator."""
        return self._draws_random

    @property
    def lossless(self) -> bool:
        """Whether the pipeline has no stages: dense float32, bit-exact."""
        return not self._stages

    def payload_nbytes(self, num_elements: int) -> int | None:
        """Return the length of the payload :meth:`encode` writes for ``num_elements`` values (without a residual)
        when it is known without encoding them: the lossless pipeline's, a header and four bytes a value; None for
        any other pipeline, whose payload's length depends on the values.
        """
        return HEADER.size + 4 * num_elements if not self._stages else None

    def __repr__(self) -> str:
        return f"Pipeline({list(self._stages)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self._stages == other._stages

    def __hash__(self) -> int:
        return hash(self._stages)

    def encode(
        self,
        flat: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        residual: torch.Tensor | None = None,
    ) -> Encoded:
        """Compress ``flat`` (plus the residual, with error feedback) into a payload.

        Args:
            flat: 1-D tensor of n values (any float dtype or device; encoded as float32 on the CPU).
            generator: CPU generator for :class:`RandomK` and stochastic :class:`Int8`; required by them.
            residual: The client's previous residual (n values), ``None`` for zeros. Only with error feedback.

        Returns:
            The payload, the dense vector it decodes to, and the new residual ``flat + residual - sent``.

        Raises:
            ValueError: If ``flat`` is not 1-D, ``residual`` has another length or is given without error
                feedback, a random stage has no generator, or an :class:`Int8` stage meets ``inf`` or NaN.
        """
        if not self._stages and residual is None:  # lossless: the bytes of encode(); sent is what they decode to
            return Encoded(payload=encode(flat), residual=None)
        # Overflow to inf (and inf - inf = NaN) follows IEEE arithmetic; the server rejects non-finite updates.
        with np.errstate(over="ignore", invalid="ignore"):
            return self._encode(flat, generator, residual)

    def _encode(self, flat: torch.Tensor, generator: torch.Generator | None, residual: torch.Tensor | None) -> Encoded:
        if generator is None:
            for stage in self._stages:
                if isinstance(stage, RandomK) or (isinstance(stage, Int8) and stage.stochastic):
                    _need(generator, stage)
        values = _as_flat_float32(flat, "flat")
        n = values.size
        if residual is not None:
            if not self.error_feedback:
                raise ValueError(f"{self!r} keeps no error feedback; pass residual=None")
            previous = _as_flat_float32(residual, "residual")
            if previous.size != n:
                raise ValueError(f"residual has {previous.size} elements, the update has {n}")
            corrected = values + previous
        else:
            corrected = values
        flags = 0
        indices: _I64 | None = None
        kept = corrected
        if isinstance(self._sparsifier, NonZero):
            nonzero = np.flatnonzero(corrected).astype(np.int64)
            if 5 * nonzero.size < 4 * n:
                indices, kept = nonzero, corrected[nonzero]
                flags |= Flag.SPARSE
        elif self._sparsifier is not None:
            indices = _select(self._sparsifier, corrected, generator)
            kept = corrected[indices]
            if isinstance(self._sparsifier, RandomK) and not self._sparsifier.error_feedback and indices.size:
                kept *= np.float32(n / indices.size)
            flags |= Flag.SPARSE
        codec_id, value_flags, value_parts, kept_sent = _encode_values(self._values, kept, generator)
        flags |= value_flags
        if indices is None:
            sent = kept_sent if kept_sent is not values else values.copy()
            parts = value_parts
        else:
            sent = np.zeros(n, dtype=np.float32)
            sent[indices] = kept_sent
            parts = [_U64.pack(indices.size), _encode_varints(indices), *value_parts]
        header = HEADER.pack(MAGIC, FORMAT_VERSION, codec_id, flags, n, sum(memoryview(part).nbytes for part in parts))
        payload = b"".join((header, *parts))
        new_residual = torch.from_numpy(corrected - sent) if self.error_feedback else None
        return Encoded(payload=payload, residual=new_residual, decoded=torch.from_numpy(sent))

    def decode(self, payload: bytes | bytearray | memoryview, *, expected_elements: int) -> torch.Tensor:
        """Decode any valid payload, whichever pipeline wrote it; the same as :func:`decode`."""
        return decode(payload, expected_elements=expected_elements)

    def encode_rows(self, rows: torch.Tensor) -> list[bytes] | None:
        """Encode each row of ``rows`` as :meth:`encode` would without a residual, when this pipeline is lossless
        (:func:`encode_rows`); None for any other pipeline (encode each row then)."""
        return encode_rows(rows) if not self._stages else None

    def decode_stacked(
        self, payloads: Sequence[bytes], *, expected_elements: int, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Decode payloads of one dense form together; the same as :func:`decode_stacked`."""
        return decode_stacked(payloads, expected_elements=expected_elements, out=out)


# ------------------------------------------------------------------------------------------- entry points
def encode(flat: torch.Tensor) -> bytes:
    """Encode a flat vector into a self-describing, lossless dense float32 payload.

    Args:
        flat: 1-D tensor of ``num_elements`` values.

    Returns:
        Header plus body; its length is the size on the wire.

    Raises:
        ValueError: If ``flat`` is not 1-D.
    """
    values = _as_flat_float32(flat, "flat")
    if not _LITTLE_ENDIAN:
        values = values.astype("<f4")
    header = HEADER.pack(MAGIC, FORMAT_VERSION, CodecId.FLOAT32, 0, values.size, values.nbytes)
    return b"".join((header, values.data))


def encode_rows(rows: torch.Tensor) -> list[bytes]:
    """Encode each row of a 2-D tensor as :func:`encode` encodes it alone, byte for byte.

    The rows share one header and are read as one array: a cohort's deltas are encoded in one pass instead of a
    header, an array and a few calls per row.

    Args:
        rows: ``(K, num_elements)`` tensor of any float dtype or device.

    Returns:
        ``K`` payloads, in row order.

    Raises:
        ValueError: If ``rows`` is not 2-D.
    """
    if rows.dim() != 2:
        raise ValueError(f"expected 'rows' to be a 2-D tensor, got shape {tuple(rows.shape)}")
    values = _as_flat_float32(rows.reshape(-1), "rows").reshape(rows.shape)
    if not _LITTLE_ENDIAN:
        values = values.astype("<f4")
    count = int(rows.shape[1])
    header = HEADER.pack(MAGIC, FORMAT_VERSION, CodecId.FLOAT32, 0, count, 4 * count)
    body = np.ascontiguousarray(values).reshape(-1).view(np.uint8).data
    width = 4 * count
    return [b"".join((header, body[k * width : (k + 1) * width])) for k in range(int(rows.shape[0]))]


def decode(payload: bytes | bytearray | memoryview, *, expected_elements: int) -> torch.Tensor:
    """Decode and validate a payload produced by :func:`encode` or :meth:`Pipeline.encode`.

    Args:
        payload: The received bytes.
        expected_elements: Length the decoded vector must have (the model's parameter count).

    Returns:
        A new 1-D float32 tensor of ``expected_elements`` values.

    Raises:
        DecodeError: If the bytes are truncated, oversized, of another format, version, codec or flags, of the
            wrong length, or their sparse indices, varints, chunk size, scales or codes are malformed.
    """
    try:
        view = memoryview(payload).cast("B")
    except TypeError:
        raise DecodeError("payload is not a contiguous run of bytes") from None
    if len(view) < HEADER.size:
        raise DecodeError(f"payload of {len(view)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, codec_byte, flags, num_elements, body_bytes = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DecodeError(f"unsupported format version {version} (this flasync reads {FORMAT_VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise DecodeError(f"unknown flags {flags:#06x} (known: sparse 0x0001, int8 chunked 0x0002)")
    codec_id = _CODECS.get(codec_byte)
    if codec_id is None:
        raise DecodeError(f"unknown codec id {codec_byte}")
    chunked = bool(flags & _INT8_CHUNKED)
    if chunked and codec_id is not CodecId.INT8:
        raise DecodeError(f"the int8-chunked flag is set on a {codec_id.name.lower()} codec payload")
    if num_elements != expected_elements:
        raise DecodeError(f"update has {num_elements} elements, the model has {expected_elements}")
    if body_bytes != len(view) - HEADER.size:
        raise DecodeError(f"header announces a {body_bytes}-byte body but {len(view) - HEADER.size} bytes follow")
    body = view[HEADER.size :]
    if not flags & _SPARSE:
        return torch.from_numpy(_decode_values(codec_id, chunked, body, num_elements, "dense"))
    return torch.from_numpy(_decode_sparse(codec_id, chunked, body, num_elements))


_DENSE_WIDTHS = {CodecId.FLOAT32: 4, CodecId.FLOAT16: 2, CodecId.BFLOAT16: 2}


def decode_stacked(
    payloads: Sequence[bytes], *, expected_elements: int, out: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Decode payloads that share one dense form at once, as the rows of a new ``(K, expected_elements)`` tensor.

    Row ``k`` equals :func:`decode` of ``payloads[k]``, bit for bit: the same float32 values, and float16 or
    bfloat16 widened the same way. Only a batch whose payloads are all ``bytes`` with one and the same header - dense
    (not sparse) float32, float16 or bfloat16 values of ``expected_elements``, the body as long as the header says -
    is decoded here: one header check, each body copied into its row of one tensor and one widening for them all,
    instead of a header, a copy and a tensor per payload. For any other batch (another codec, a mix of forms, a
    malformed payload) it returns None and decodes nothing: :func:`decode` each payload then, which names what is
    wrong with it.

    Args:
        payloads: The received bytes, in order.
        expected_elements: Length every decoded vector must have (the model's parameter count).
        out: Where to write the rows (a contiguous float32 CPU tensor of shape ``(len(payloads),
            expected_elements)``), e.g. a buffer a receiver reuses: a fresh tensor of a megabyte or more costs its
            pages' first touch on every batch, often more than the decoding. None: a new tensor.

    Returns:
        A float32 tensor of shape ``(len(payloads), expected_elements)`` (``out`` where given), or None.

    Raises:
        ValueError: If ``out`` is not of that shape, dtype and device, or not contiguous.
    """
    if out is not None and (
        out.shape != (len(payloads), expected_elements)
        or out.dtype != torch.float32
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous float32 CPU tensor of shape ({len(payloads)}, {expected_elements}), "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if not payloads or not isinstance(payloads[0], bytes) or len(payloads[0]) < HEADER.size:
        return None
    head = payloads[0][: HEADER.size]
    magic, version, codec_byte, flags, num_elements, body_bytes = HEADER.unpack(head)
    codec_id = _CODECS.get(codec_byte)
    width = _DENSE_WIDTHS.get(codec_id) if codec_id is not None else None
    if (
        magic != MAGIC
        or version != FORMAT_VERSION
        or flags != 0
        or width is None
        or num_elements != expected_elements
        or body_bytes != width * num_elements
    ):
        return None
    size = HEADER.size + body_bytes
    for payload in payloads:
        if not isinstance(payload, bytes) or len(payload) != size or not payload.startswith(head):
            return None
    # A copy of each body into its row: joining the payloads first costs more than the copies (a fresh large buffer).
    stacked = torch.empty((len(payloads), num_elements), dtype=torch.float32) if out is None else out
    rows = stacked.numpy()
    if codec_id is CodecId.FLOAT32 and _LITTLE_ENDIAN:  # the bodies' bytes are the rows' bytes: copy them as bytes
        into, row_bytes, at = rows.data.cast("B"), body_bytes, 0
        for payload in payloads:
            into[at : at + row_bytes] = memoryview(payload)[HEADER.size :]
            at += row_bytes
        return stacked
    if codec_id is CodecId.FLOAT32:
        for k, payload in enumerate(payloads):
            rows[k] = np.frombuffer(payload, dtype="<f4", count=num_elements, offset=HEADER.size)
        return stacked
    assert codec_id is not None
    halves = np.empty((len(payloads), num_elements), dtype=np.uint16)
    for k, payload in enumerate(payloads):
        halves[k] = np.frombuffer(payload, dtype="<u2", count=num_elements, offset=HEADER.size)
    rows[...] = _halves_to_float32(codec_id, halves)
    return stacked


# ------------------------------------------------------------------------------------------------ helpers
def _as_flat_float32(tensor: torch.Tensor, name: str) -> _F32:
    """Return the values of a 1-D tensor as a float32 NumPy array (which may share its memory: read only)."""
    if tensor.dim() != 1:
        raise ValueError(f"expected {name!r} to be a 1-D tensor, got shape {tuple(tensor.shape)}")
    array: _F32
    if tensor.dtype is torch.float32 and tensor.is_cpu and not tensor.requires_grad and tensor.is_contiguous():
        array = tensor.numpy()  # the common case (a trained delta), without four tensor calls
    else:
        array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
    return array


def _need(generator: torch.Generator | None, stage: Stage) -> torch.Generator:
    if generator is None:
        raise ValueError(f"{stage!r} draws random numbers: pass generator= (a CPU torch.Generator)")
    return generator


def _select(sparsifier: _Sparsifier, values: _F32, generator: torch.Generator | None) -> _I64:
    """Return the sorted indices the sparsifier keeps."""
    n = values.size
    k = sparsifier.kept(n)
    if k == n:
        return np.arange(n, dtype=np.int64)
    if isinstance(sparsifier, TopK):
        return _top_k(values, k)
    return _random_k(n, k, _need(generator, sparsifier))


def _top_k(values: _F32, k: int) -> _I64:
    """Return the sorted indices of the k largest magnitudes (NaN largest; ties to the lower index), O(n).

    As in Deep Gradient Compression (Lin et al. 2018) a threshold is first estimated on a strided sample, with a
    2x margin; the exact selection then runs on the few candidates above it. If fewer than k values pass (an
    unrepresentative sample) it falls back to a selection over all values, so the result is always exact.
    """
    n = values.size
    magnitudes = np.abs(values)
    nan = np.isnan(magnitudes)
    if nan.any():
        magnitudes[nan] = np.inf
    candidates: _I64 | None = None
    if 16 * k < n:
        sample = magnitudes[:: n // (16 * k)]
        rank = min(sample.size, 2 * k * sample.size // n + 32)
        estimate = np.partition(sample, sample.size - rank)[sample.size - rank]
        candidates = np.flatnonzero(magnitudes >= estimate)
        if candidates.size < k:
            candidates = None
    if candidates is None:
        candidates = np.arange(n, dtype=np.int64)
    else:
        magnitudes = magnitudes[candidates]
    threshold = np.partition(magnitudes, magnitudes.size - k)[magnitudes.size - k]
    above = candidates[magnitudes > threshold]
    tied = candidates[magnitudes == threshold][: k - above.size]
    return np.sort(np.concatenate((above, tied))).astype(np.int64, copy=False)


def _random_k(n: int, k: int, generator: torch.Generator) -> _I64:
    """Return k sorted indices drawn uniformly without replacement from ``range(n)``.

    For small k the cost is O(k log k), not O(n): i.i.d. draws are collected until k distinct ones are found; their
    distinct set is, given its size, uniform by symmetry, and a uniform k-subset of it is a uniform k-subset.
    """
    if 4 * k > n:
        chosen = torch.randperm(n, generator=generator)[:k]
    else:
        distinct = torch.empty(0, dtype=torch.int64)
        while distinct.numel() < k:
            draws = torch.randint(n, (k + k // 4 + 16,), generator=generator)
            distinct = torch.unique(torch.cat((distinct, draws)))
        chosen = distinct[torch.randperm(distinct.numel(), generator=generator)[:k]]
    result: _I64 = np.sort(chosen.numpy())
    return result


def _encode_values(
    stage: _ValueEncoder | None, values: _F32, generator: torch.Generator | None
) -> tuple[CodecId, int, list[_Buffer], _F32]:
    """Return the codec id, flags, value-section parts and the float32 values the receiver will decode."""
    if stage is None:
        return CodecId.FLOAT32, 0, [values.astype("<f4", copy=False).data], values
    if isinstance(stage, Float16 | BFloat16):
        bound = _FLOAT16_MAX if isinstance(stage, Float16) else _BFLOAT16_MAX
        dtype = torch.float16 if isinstance(stage, Float16) else torch.bfloat16
        saturated = np.clip(values, -bound, bound)
        infinite = np.isinf(values)
        if infinite.any():
            np.copyto(saturated, values, where=infinite)
        halves = torch.from_numpy(saturated).to(dtype).view(torch.int16).numpy().view("<u2")
        return stage.codec_id, 0, [halves.data], _halves_to_float32(stage.codec_id, halves)
    assert isinstance(stage, Int8)  # the pipeline admits no other value encoder
    return _encode_int8(stage, values, generator)


def _halves_to_float32(codec_id: CodecId, halves: npt.NDArray[np.uint16]) -> _F32:
    """Widen float16 or bfloat16 bit patterns to a new float32 array (exactly)."""
    if codec_id is CodecId.FLOAT16:
        # torch converts binary16 several times faster than NumPy does (and wants a writable array).
        if not halves.flags.writeable:
            halves = halves.copy()
        widened: _F32 = torch.from_numpy(halves.view(np.int16)).view(torch.float16).float().numpy()
        return widened
    return (halves.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _chunk_grid(m: int, chunk: int | None) -> tuple[int, int]:
    """Return (number of chunks, chunk width) for m values; one chunk of width ``<= max(m, 1)`` when it covers all."""
    if chunk is None:
        return 1, max(m, 1)
    return -(-m // chunk), min(chunk, max(m, 1))


def _as_grid(array: npt.NDArray[_Scalar], num_chunks: int, width: int) -> npt.NDArray[_Scalar]:
    """View (or zero-pad and reshape) a 1-D array as ``(num_chunks, width)``; padding is below one chunk."""
    total = num_chunks * width
    if total == array.size:
        return array.reshape(num_chunks, width)
    padded = np.zeros(total, dtype=array.dtype)
    padded[: array.size] = array
    return padded.reshape(num_chunks, width)


def _encode_int8(
    stage: Int8, values: _F32, generator: torch.Generator | None
) -> tuple[CodecId, int, list[_Buffer], _F32]:
    m = values.size
    num_chunks, width = _chunk_grid(m, stage.chunk)
    grid = _as_grid(values, num_chunks, width)
    # Two reductions instead of a full |x| temporary (temporaries of n floats dominate the cost).
    peaks = np.maximum(grid.max(axis=1, initial=0.0), -grid.min(axis=1, initial=0.0))
    if not np.isfinite(peaks).all():
        raise ValueError("Int8 cannot encode inf or NaN values (the update is not finite)")
    scales = (peaks / np.float32(_INT8_LEVELS)).astype(np.float32)
    # Round each scale up to a float32 with 127 s >= max|x|, so that |x| / s <= 127 and no code needs clamping.
    short = scales.astype(np.float64) * _INT8_LEVELS < peaks
    scales[short] = np.nextafter(scales[short], np.float32(np.inf))
    ratios = grid / np.where(scales > 0, scales, np.float32(1))[:, None]
    if stage.stochastic:
        # floor(r + u) has the law of floor(r) + [u < r - floor(r)], which avoids rounding the sum r + u.
        noise = torch.rand(grid.shape, generator=_need(generator, stage)).numpy()
        rounded = np.floor(ratios)
        np.subtract(ratios, rounded, out=ratios)
        np.less(noise, ratios, out=noise.view(np.int32))  # noise is dead: reuse its buffer for the 0/1 carry
        rounded += noise.view(np.int32)
    else:
        rounded = np.rint(ratios, out=ratios)
    np.clip(rounded, -_INT8_LEVELS, _INT8_LEVELS, out=rounded)
    codes = rounded.astype(np.int8).reshape(-1)[:m]
    parts: list[_Buffer] = [scales.astype("<f4", copy=False).data, codes.data]
    flags = 0
    if stage.chunk is not None:
        parts.insert(0, _U32.pack(stage.chunk))
        flags = Flag.INT8_CHUNKED
    return CodecId.INT8, flags, parts, _dequantise(codes, scales, width)


def _dequantise(codes: npt.NDArray[np.int8], scales: _F32, width: int) -> _F32:
    """Return ``scale * q`` in float32: the one formula both the encoder's ``sent`` and the decoder use."""
    grid = _as_grid(codes, scales.size, width).astype(np.float32)
    with np.errstate(over="ignore"):
        grid *= scales[:, None]
    if scales.size and scales.max() > _INT8_OVERFLOW_SCALE:
        # 127 s may round past the largest float32 when max|x| is within an ulp of it: saturate, never inf.
        np.clip(grid, -_FLOAT32_MAX, _FLOAT32_MAX, out=grid)
    result: _F32 = grid.reshape(-1)[: codes.size]
    return result


def _decode_values(codec_id: CodecId, chunked: bool, section: memoryview, m: int, where: str) -> _F32:
    """Decode a value section of exactly m values (validated first), returning a new float32 array."""
    if codec_id is not CodecId.INT8:
        width = 4 if codec_id is CodecId.FLOAT32 else 2
        if len(section) != width * m:
            raise DecodeError(
                f"{where} {codec_id.name.lower()} body has {len(section)} bytes of values, expected {width * m}"
            )
        if codec_id is CodecId.FLOAT32:
            return np.frombuffer(section, dtype="<f4", count=m).astype(np.float32, copy=True)
        return _halves_to_float32(codec_id, np.frombuffer(section, dtype="<u2", count=m))
    offset = 0
    chunk: int | None = None
    if chunked:
        if len(section) < _U32.size:
            raise DecodeError(f"{where} int8 body of {len(section)} bytes has no room for its 4-byte chunk size")
        (chunk,) = _U32.unpack_from(section)
        if chunk < 1:
            raise DecodeError(f"{where} int8 body announces a chunk size of {chunk}, which must be at least 1")
        offset = _U32.size
    num_chunks, width = _chunk_grid(m, chunk)
    expected = offset + 4 * num_chunks + m
    if len(section) != expected:
        raise DecodeError(
            f"{where} int8 body has {len(section)} bytes of values, expected {expected} "
            f"for {m} codes and {num_chunks} scales"
        )
    scales = np.frombuffer(section, dtype="<f4", count=num_chunks, offset=offset).astype(np.float32)
    if not (np.isfinite(scales) & (scales >= 0)).all():
        raise DecodeError(f"{where} int8 body has a negative or non-finite scale")
    codes = np.frombuffer(section, dtype=np.int8, count=m, offset=offset + 4 * num_chunks)
    if (codes == -128).any():
        raise DecodeError(f"{where} int8 body has the code -128, outside [-127, 127]")
    return _dequantise(codes, scales, width)


def _decode_sparse(codec_id: CodecId, chunked: bool, body: memoryview, n: int) -> _F32:
    if len(body) < _U64.size:
        raise DecodeError(f"sparse body of {len(body)} bytes has no room for its 8-byte count")
    (k,) = _U64.unpack_from(body)
    rest = body[_U64.size :]
    if k > n:
        raise DecodeError(f"sparse body announces {k} kept values out of {n} elements")
    if k > len(rest):
        raise DecodeError(f"sparse body announces {k} indices but only {len(rest)} bytes follow the count")
    indices, used = _decode_varints(rest, k, n)
    values = _decode_values(codec_id, chunked, rest[used:], k, "sparse")
    try:
        dense = np.zeros(n, dtype=np.float32)
    except MemoryError:
        raise DecodeError(f"cannot allocate the {n}-element decoded vector") from None
    dense[indices] = values
    return dense


def _encode_varints(indices: _I64) -> bytes:
    """Write strictly increasing indices as LEB128 deltas (the first absolute), vectorised over byte positions."""
    deltas = np.diff(indices, prepend=0).astype(np.uint64)
    sizes = np.ones(deltas.size, dtype=np.int64)
    for position in range(1, _MAX_VARINT_BYTES):
        sizes += deltas >= np.uint64(1 << (7 * position))
    starts = np.cumsum(sizes) - sizes
    out = np.empty(int(sizes.sum()), dtype=np.uint8)
    for position in range(int(sizes.max(initial=0))):
        has = sizes > position
        septet = (deltas[has] >> np.uint64(7 * position)) & np.uint64(0x7F)
        more = np.where(sizes[has] > position + 1, np.uint64(0x80), np.uint64(0))
        out[starts[has] + position] = (septet | more).astype(np.uint8)
    return out.tobytes()


def _decode_varints(buffer: memoryview, k: int, n: int) -> tuple[_I64, int]:
    """Read k LEB128 index deltas from the start of ``buffer``; return the indices and the bytes they used.

    Vectorised: the terminating bytes (high bit clear) delimit the varints, and each varint's septets are summed
    with ``np.add.reduceat``. Only the first ``10 k`` bytes are looked at.
    """
    if k == 0:
        return np.empty(0, dtype=np.int64), 0
    region = np.frombuffer(buffer, dtype=np.uint8, count=min(len(buffer), _MAX_VARINT_BYTES * k))
    ends = np.flatnonzero(region < 0x80)
    if ends.size < k:
        raise DecodeError(f"sparse body ends before its {k} varint indices do")
    ends = ends[:k]
    starts = np.empty(k, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    sizes = ends - starts + 1
    last = region[ends]
    if sizes.max() > _MAX_VARINT_BYTES:
        raise DecodeError(f"sparse body has a varint index longer than {_MAX_VARINT_BYTES} bytes")
    if ((sizes > 1) & (last == 0)).any():
        raise DecodeError("sparse body has an overlong varint index (a trailing zero byte)")
    if ((sizes == _MAX_VARINT_BYTES) & (last > 1)).any():
        raise DecodeError("sparse body has a varint index beyond 64 bits")
    used = int(ends[-1]) + 1
    septets = (region[:used] & np.uint8(0x7F)).astype(np.uint64)
    shifts = (7 * (np.arange(used, dtype=np.int64) - np.repeat(starts, sizes))).astype(np.uint64)
    deltas = np.add.reduceat(septets << shifts, starts)
    # uint64 wrap-around can only make an index smaller than the one before it, so this check also catches it.
    indices = np.cumsum(deltas, dtype=np.uint64)
    if not (indices[1:] > indices[:-1]).all():
        raise DecodeError("sparse body's indices are not strictly increasing")
    if int(indices[-1]) >= n:
        raise DecodeError(f"sparse body has index {int(indices[-1])}, beyond the {n} elements")
    return indices.astype(np.int64), used
