"""Tests of key agreement, authenticated encryption and mask expansion (flasync.secure.keys)."""

from __future__ import annotations

import numpy as np
import pytest

from flasync.secure.keys import DecryptionError, KeyPair, SeededRandom, agree, decrypt, encrypt, expand_mask


def test_both_ends_agree_on_one_key_bound_to_purpose_and_salt() -> None:
    """X25519 + HKDF gives both ends the same key; another info or salt gives another key."""
    rng = SeededRandom(3)
    a, b = KeyPair.generate(rng), KeyPair.generate(rng)
    key = agree(a.private, b.public, info=b"mask", salt=b"round-1")
    assert key == agree(b.private, a.public, info=b"mask", salt=b"round-1")
    assert key != agree(a.private, b.public, info=b"share", salt=b"round-1")
    assert key != agree(a.private, b.public, info=b"mask", salt=b"round-2")


def test_a_ciphertext_opens_only_with_its_key_and_associated_data() -> None:
    """AES-GCM refuses an altered ciphertext, another key and another recipient's associated data."""
    rng = SeededRandom(4)
    key, other = rng.bytes(32), rng.bytes(32)
    message = encrypt(key, b"share", b"to:2", rng)
    assert decrypt(key, message, b"to:2") == b"share"
    altered = message[:-1] + bytes([message[-1] ^ 1])
    for bad_key, bad_message, associated in (
        (other, message, b"to:2"),
        (key, altered, b"to:2"),
        (key, message, b"to:3"),
    ):
        with pytest.raises(DecryptionError):
            decrypt(bad_key, bad_message, associated)


def test_masks_repeat_from_a_seed_and_stay_in_the_ring() -> None:
    """The same seed expands to the same mask; every element is below 2^bits; another seed differs."""
    seed = SeededRandom(5).bytes(32)
    mask = expand_mask(seed, 1000, 20)
    assert np.array_equal(mask, expand_mask(seed, 1000, 20))
    assert int(mask.max()) < 1 << 20
    assert not np.array_equal(mask, expand_mask(bytes(32), 1000, 20))


def test_seeded_sources_repeat_and_differ_by_seed() -> None:
    """A seeded source gives the same keys for the same seed and others for another seed."""
    assert KeyPair.generate(SeededRandom(7)) == KeyPair.generate(SeededRandom(7))
    assert KeyPair.generate(SeededRandom(7)) != KeyPair.generate(SeededRandom(8))
