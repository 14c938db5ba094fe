"""Tests of the fixed-point encoding into Z_{2^bits} (flasync.secure.ring)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flasync.secure.ring import FixedPoint, pack, ring_sum, unpack


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([16, 24, 32, 48, 64]),
    group=st.integers(min_value=1, max_value=40),
    clip=st.floats(min_value=0.01, max_value=8.0),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_sum_of_a_full_group_decodes_within_the_quantization_bound(
    bits: int, group: int, clip: float, seed: int
) -> None:
    """The decoded ring sum of group_size encodings is the plain sum within group_size * step / 2, even at the clip."""
    if ((1 << (bits - 1)) - 1) // (group * clip) < 1:
        return
    code = FixedPoint(bits, clip, group)
    generator = torch.Generator().manual_seed(seed)
    values = (torch.rand(group, 7, generator=generator, dtype=torch.float64) * 2 - 1) * clip
    values[0, 0] = clip  # extreme values must not overflow either
    values[-1, 1] = -clip
    total = ring_sum([code.encode(row) for row in values], bits)
    error = (code.decode(total) - values.sum(0)).abs().max().item()
    assert error <= group * code.step / 2 + 1e-9 * clip * group


def test_values_beyond_the_range_are_clipped() -> None:
    """An encoded value outside [-clip, clip] decodes to the nearest end of the range."""
    code = FixedPoint(32, 0.5, 4)
    decoded = code.decode(code.encode(torch.tensor([3.0, -7.0, 0.25])))
    assert decoded.tolist() == pytest.approx([0.5, -0.5, 0.25], abs=code.step)


def test_bits_too_few_for_the_group_are_refused() -> None:
    """A ring that cannot hold group_size values at the clipping range with a step of at most 1 is refused."""
    with pytest.raises(ValueError, match="cannot sum"):
        FixedPoint(8, 10.0, 100)


def test_pack_round_trips_and_takes_ceil_bits_over_8_bytes() -> None:
    """pack writes ceil(bits / 8) bytes an element and unpack reads the same vector back."""
    vector = np.array([0, 1, (1 << 20) - 1, 12345], dtype=np.uint64)
    data = pack(vector, 20)
    assert len(data) == 4 * 3
    assert np.array_equal(unpack(data, 20), vector)


def test_unpack_refuses_a_partial_element() -> None:
    """A payload that is not a whole number of elements is refused."""
    with pytest.raises(ValueError, match="whole number"):
        unpack(b"\x00" * 5, 32)
