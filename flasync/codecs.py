"""Wire format of updates and models: real bytes, no pickle.

Every payload is a fixed 24-byte little-endian header followed by a body::

    offset  size  field
    0       4     magic            b"FLSU"
    4       1     format version   1
    5       1     codec id         0 = dense float32
    6       2     flags            0 (reserved)
    8       8     num_elements     length of the decoded flat vector (uint64)
    16      8     body_bytes       length of the body that follows (uint64)
    24      ...   body             codec-specific; dense float32 = num_elements little-endian float32

``len(payload)`` is the size that is accounted as upload or download bytes. :func:`decode` validates magic,
version, codec, lengths and the expected number of elements before it reads a single value, so truncated,
oversized or foreign bytes are rejected with :class:`~flasync.errors.DecodeError`.
"""

from __future__ import annotations

import struct
from typing import Protocol

import numpy as np
import torch

from flasync.errors import DecodeError

__all__ = ["HEADER", "MAGIC", "Codec", "DenseFloat32", "decode", "encode"]

MAGIC = b"FLSU"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBHQQ")


class Codec(Protocol):
    """Turn a flat float32 vector into bytes and back."""

    codec_id: int

    def encode_body(self, flat: torch.Tensor) -> bytes:
        """Encode the body for ``flat`` (1-D float32, CPU)."""
        ...

    def decode_body(self, body: memoryview, num_elements: int) -> torch.Tensor:
        """Decode a body already checked against the header."""
        ...


class DenseFloat32:
    """Lossless: the raw little-endian float32 values."""

    codec_id = 0

    def encode_body(self, flat: torch.Tensor) -> bytes:
        """Return the values' bytes."""
        array = flat.detach().to("cpu", torch.float32).contiguous().numpy()
        return array.astype("<f4", copy=False).tobytes()

    def decode_body(self, body: memoryview, num_elements: int) -> torch.Tensor:
        """Return a new tensor holding the values."""
        if len(body) != 4 * num_elements:
            raise DecodeError(f"dense float32 body has {len(body)} bytes, expected {4 * num_elements}")
        array = np.frombuffer(body, dtype="<f4", count=num_elements).astype(np.float32, copy=True)
        return torch.from_numpy(array)


_CODECS: dict[int, Codec] = {DenseFloat32.codec_id: DenseFloat32()}


def encode(flat: torch.Tensor, codec: Codec | None = None) -> bytes:
    """Encode a flat vector into a self-describing payload.

    Args:
        flat: 1-D tensor of ``num_elements`` values.
        codec: Body codec (dense float32 by default).

    Returns:
        Header plus body; its length is the size on the wire.
    """
    if flat.dim() != 1:
        raise ValueError(f"expected a flat 1-D tensor, got shape {tuple(flat.shape)}")
    codec = codec or _CODECS[0]
    body = codec.encode_body(flat)
    return HEADER.pack(MAGIC, FORMAT_VERSION, codec.codec_id, 0, flat.numel(), len(body)) + body


def decode(payload: bytes | bytearray | memoryview, *, expected_elements: int) -> torch.Tensor:
    """Decode and validate a payload produced by :func:`encode`.

    Args:
        payload: The received bytes.
        expected_elements: Length the decoded vector must have (the model's parameter count).

    Returns:
        A new 1-D float32 tensor.

    Raises:
        DecodeError: If the bytes are truncated, oversized, of another format, version or codec, or of the
            wrong length.
    """
    view = memoryview(payload).cast("B")
    if len(view) < HEADER.size:
        raise DecodeError(f"payload of {len(view)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, codec_id, flags, num_elements, body_bytes = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise DecodeError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise DecodeError(f"unsupported format version {version} (this flasync reads {FORMAT_VERSION})")
    if flags != 0:
        raise DecodeError(f"unknown flags {flags:#06x}")
    codec = _CODECS.get(codec_id)
    if codec is None:
        raise DecodeError(f"unknown codec id {codec_id}")
    if num_elements != expected_elements:
        raise DecodeError(f"update has {num_elements} elements, the model has {expected_elements}")
    if body_bytes != len(view) - HEADER.size:
        raise DecodeError(f"header announces a {body_bytes}-byte body but {len(view) - HEADER.size} bytes follow")
    return codec.decode_body(view[HEADER.size :], num_elements)
