"""Key agreement, key derivation, authenticated encryption and the mask generator, from the ``cryptography`` package.

* X25519 Diffie-Hellman gives two clients a shared secret from one's private and the other's public key;
* HKDF-SHA256 derives from it a 32-byte key bound to a purpose (``info``) and the round (``salt``);
* AES-256-GCM encrypts the Shamir shares one client sends another through the server (the server relays, cannot
  read or alter them);
* AES-256-CTR with a zero nonce is the pseudo-random generator that expands a 32-byte seed into a mask vector.

All randomness comes from an injected :class:`RandomSource`: :class:`SystemRandom` (the operating system's
generator) in deployment, :class:`SeededRandom` where runs must repeat bit for bit (simulation in virtual time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from flasync.secure.ring import RingVector, ring_mask

__all__ = [
    "AEAD_OVERHEAD_BYTES",
    "KEY_BYTES",
    "DecryptionError",
    "KeyPair",
    "RandomSource",
    "SeededRandom",
    "SystemRandom",
    "agree",
    "decrypt",
    "encrypt",
    "expand_mask",
]

KEY_BYTES = 32
"""Bytes of an X25519 key, a derived key and a mask seed."""

_NONCE_BYTES = 12
AEAD_OVERHEAD_BYTES = _NONCE_BYTES + 16
"""Bytes AES-GCM adds to a plaintext: the nonce sent with it and the authentication tag."""


class RandomSource(Protocol):
    """Where secure aggregation's random bytes come from (keys, seeds, share polynomials, nonces)."""

    def bytes(self, n: int) -> bytes:
        """Return ``n`` random bytes."""
        ...


class SystemRandom:
    """The operating system's cryptographic generator (``os.urandom``): for deployment."""

    def bytes(self, n: int) -> bytes:
        """Return ``n`` bytes from ``os.urandom``."""
        return os.urandom(n)


class SeededRandom:
    """A seeded generator (numpy's PCG64): the same seed gives the same keys, so a simulation repeats bit for bit.

    Args:
        seed: The generator's seed (derive one per client and round from the run's seed).
    """

    def __init__(self, seed: int | tuple[int, ...]) -> None:
        """Seed the generator."""
        self._generator = np.random.default_rng(seed)

    def bytes(self, n: int) -> bytes:
        """Return ``n`` bytes of the seeded stream."""
        return self._generator.bytes(n)


class DecryptionError(ValueError):
    """A ciphertext does not authenticate under the key and associated data: it was altered or misaddressed."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """An X25519 key pair: the private key as raw bytes and the public key as raw bytes (32 each)."""

    private: bytes
    public: bytes

    @classmethod
    def generate(cls, rng: RandomSource) -> KeyPair:
        """Draw a key pair from ``rng``."""
        private = X25519PrivateKey.from_private_bytes(rng.bytes(KEY_BYTES))
        return cls(
            private=private.private_bytes_raw(),
            public=private.public_key().public_bytes_raw(),
        )


def agree(private: bytes, peer_public: bytes, *, info: bytes, salt: bytes) -> bytes:
    """Return a 32-byte key both ends derive: HKDF-SHA256 of the X25519 shared secret.

    Args:
        private: This end's raw private key.
        peer_public: The other end's raw public key.
        info: The key's purpose (e.g. ``b"flasync-secagg-mask"``), so one shared secret gives unrelated keys.
        salt: Binds the key to one round or buffer (e.g. its id), so keys never repeat across rounds.
    """
    shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(shared)


def encrypt(key: bytes, plaintext: bytes, associated: bytes, rng: RandomSource) -> bytes:
    """Encrypt and authenticate ``plaintext`` with AES-256-GCM; return nonce + ciphertext + tag.

    Args:
        key: 32-byte key from :func:`agree`.
        plaintext: What to hide.
        associated: Authenticated but not encrypted (sender, recipient, round), so a relayed message cannot be
            replayed to another recipient or round.
        rng: Draws the nonce.
    """
    nonce = rng.bytes(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, message: bytes, associated: bytes) -> bytes:
    """Return the plaintext of :func:`encrypt`'s ``message``.

    Raises:
        DecryptionError: The message does not authenticate.
    """
    try:
        return AESGCM(key).decrypt(message[:_NONCE_BYTES], message[_NONCE_BYTES:], associated)
    except InvalidTag as error:
        raise DecryptionError("a share does not authenticate: altered, or not meant for this client") from error


def expand_mask(seed: bytes, length: int, bits: int) -> RingVector:
    """Expand a 32-byte ``seed`` into ``length`` uniform elements of Z_{2^bits} with AES-256-CTR.

    The keystream of AES-CTR under a uniformly random key is indistinguishable from uniform bytes; eight bytes
    give one element, reduced modulo ``2^bits`` (uniform, since ``2^bits`` divides ``2^64``).
    """
    encryptor = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(8 * length)) + encryptor.finalize()
    return np.bitwise_and(np.frombuffer(stream, dtype="<u8").astype(np.uint64), ring_mask(bits))
