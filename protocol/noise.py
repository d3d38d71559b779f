"""The Noise protocol framework (revision 34), pattern XX, sans-IO: ``Noise_XX_25519_AESGCM_SHA256``.

Only what the relayed seam needs: the XX handshake (each side's static key sent
encrypted, both authenticated, forward secret) and the two cipher states it splits
into. The spec's names are kept so a reader can check each step against it
(https://noiseprotocol.org/noise.html, §5 and §7); ``tests/test_noise.py`` checks it
against an independent implementation message for message.

AES-GCM, not ChaCha20-Poly1305: inside a node's event loop, where the relay, the
websocket and the seam's own code keep the caches busy between messages, a relayed
decode round trip cost 50–90 µs more sealed with ChaCha20-Poly1305 and 5–10 µs more
with AES-GCM than unsealed (``benchmarks.relay_channels``); CPUs with AES instructions
are the ones nodes run on.

::

    XX:
      -> e
      <- e, ee, s, es
      -> s, se
"""

from __future__ import annotations

import enum
import hashlib
import hmac

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

PROTOCOL_NAME = b"Noise_XX_25519_AESGCM_SHA256"
DHLEN = 32
HASHLEN = 32
TAGLEN = 16
# the spec's bound on any Noise message, handshake or transport
MAX_MESSAGE = 65535
# n = 2**64 - 1 is reserved by the spec: a cipher state stops before it
MAX_NONCE = 2**64 - 1

_PATTERN = (("e",), ("e", "ee", "s", "es"), ("s", "se"))


class NoiseError(Exception):
    """A handshake or transport message did not authenticate, was malformed, or came out of turn."""


def public_bytes(key: X25519PrivateKey) -> bytes:
    """The raw 32-byte public key of ``key``."""
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _dh(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # a low-order point gives an all-zero secret, which cryptography refuses
        raise NoiseError("the peer sent an invalid X25519 public key") from None


def _hkdf2(chaining_key: bytes, key_material: bytes) -> tuple[bytes, bytes]:
    temp = hmac.digest(chaining_key, key_material, "sha256")
    first = hmac.digest(temp, b"\x01", "sha256")
    return first, hmac.digest(temp, first + b"\x02", "sha256")


class CipherState:
    """A key and a nonce counter (§5.1); without a key it passes plaintext through."""

    __slots__ = ("_aead", "n")

    def __init__(self, key: bytes | None = None) -> None:
        self._aead = AESGCM(key) if key is not None else None
        self.n = 0

    def has_key(self) -> bool:
        """Whether a key is set."""
        return self._aead is not None

    def _nonce(self) -> bytes:
        if self.n >= MAX_NONCE:
            raise NoiseError("this cipher state has used every nonce")
        # AESGCM: 32 bits of zeros, then the counter as 64 bits big-endian (§12.4)
        return b"\0\0\0\0" + self.n.to_bytes(8, "big")

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes | memoryview) -> bytes:
        """The ciphertext (plaintext and a 16-byte tag) under the next nonce."""
        if self._aead is None:
            return bytes(plaintext)
        ciphertext = self._aead.encrypt(self._nonce(), plaintext, ad)
        self.n += 1
        return ciphertext

    def decrypt_with_ad(self, ad: bytes, ciphertext: bytes | memoryview) -> bytes:
        """The plaintext; :class:`NoiseError` when the tag does not verify (the nonce stays put)."""
        if self._aead is None:
            return bytes(ciphertext)
        try:
            plaintext = self._aead.decrypt(self._nonce(), ciphertext, ad)
        except InvalidTag:
            raise NoiseError("a message failed authentication") from None
        self.n += 1
        return plaintext


class _SymmetricState:
    """The chaining key, the handshake hash and the handshake's cipher state (§5.2)."""

    def __init__(self) -> None:
        name = PROTOCOL_NAME
        self.h = name.ljust(HASHLEN, b"\0") if len(name) <= HASHLEN else hashlib.sha256(name).digest()
        self.ck = self.h
        self.cipher = CipherState()

    def mix_key(self, key_material: bytes) -> None:
        self.ck, temp = _hkdf2(self.ck, key_material)
        self.cipher = CipherState(temp)

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.sha256(self.h + data).digest()

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ciphertext = self.cipher.encrypt_with_ad(self.h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        plaintext = self.cipher.decrypt_with_ad(self.h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        first, second = _hkdf2(self.ck, b"")
        return CipherState(first), CipherState(second)


class Role(enum.Enum):
    """Which side of the handshake: the initiator writes the first message."""

    INITIATOR = "initiator"
    RESPONDER = "responder"


class Handshake:
    """One side of an XX handshake (§5.3): write and read its three messages in turn, then :meth:`split`.

    ``static`` is this side's static key, ``prologue`` what both sides must agree on
    beforehand; ``ephemeral`` is for tests that replay known vectors (fresh otherwise).
    """

    def __init__(
        self,
        role: Role,
        static: X25519PrivateKey,
        prologue: bytes = b"",
        *,
        ephemeral: X25519PrivateKey | None = None,
    ) -> None:
        self.role = role
        self._s = static
        self._e = ephemeral
        self._re: bytes | None = None
        self.remote_static: bytes | None = None  # the peer's static public key, once read
        self._state = _SymmetricState()
        self._state.mix_hash(prologue)
        self._turn = 0

    @property
    def done(self) -> bool:
        """Whether all three messages have passed."""
        return self._turn == len(_PATTERN)

    @property
    def handshake_hash(self) -> bytes:
        """``h``: after the handshake, a digest of everything both sides saw (channel binding)."""
        return self._state.h

    def _writes(self) -> bool:
        # the initiator writes messages 0 and 2, the responder message 1
        return (self._turn % 2 == 0) == (self.role is Role.INITIATOR)

    def write_message(self, payload: bytes = b"") -> bytes:
        """The next handshake message, carrying ``payload`` (encrypted from the second message on)."""
        if self.done or not self._writes():
            raise NoiseError("it is not this side's turn to write a handshake message")
        state = self._state
        out = bytearray()
        for token in _PATTERN[self._turn]:
            if token == "e":
                if self._e is None:
                    self._e = X25519PrivateKey.generate()
                e = public_bytes(self._e)
                out += e
                state.mix_hash(e)
            elif token == "s":
                out += state.encrypt_and_hash(public_bytes(self._s))
            else:
                state.mix_key(self._dh_token(token))
        out += state.encrypt_and_hash(payload)
        if len(out) > MAX_MESSAGE:
            raise NoiseError("handshake payload too large")
        self._turn += 1
        return bytes(out)

    def read_message(self, message: bytes) -> bytes:
        """The payload of the peer's next handshake message; :class:`NoiseError` if it does not verify."""
        if self.done or self._writes():
            raise NoiseError("a handshake message came out of turn")
        if len(message) > MAX_MESSAGE:
            raise NoiseError("handshake message too large")
        state = self._state
        view = memoryview(message)
        for token in _PATTERN[self._turn]:
            if token == "e":
                if len(view) < DHLEN:
                    raise NoiseError("handshake message too short")
                self._re = bytes(view[:DHLEN])
                view = view[DHLEN:]
                state.mix_hash(self._re)
            elif token == "s":
                size = DHLEN + (TAGLEN if state.cipher.has_key() else 0)
                if len(view) < size:
                    raise NoiseError("handshake message too short")
                self.remote_static = state.decrypt_and_hash(bytes(view[:size]))
                view = view[size:]
            else:
                state.mix_key(self._dh_token(token))
        payload = state.decrypt_and_hash(bytes(view))
        self._turn += 1
        return payload

    def _dh_token(self, token: str) -> bytes:
        """The DH a token names: "es" is (initiator's e, responder's s), and so on."""
        initiator = self.role is Role.INITIATOR
        mine_static = token[0 if initiator else 1] == "s"
        theirs_static = token[1 if initiator else 0] == "s"
        mine = self._s if mine_static else self._e
        theirs = self.remote_static if theirs_static else self._re
        if mine is None or theirs is None:  # the pattern makes this impossible; a defect if it happens
            raise AssertionError(f"no key for the {token!r} token")
        return _dh(mine, theirs)

    def split(self) -> tuple[CipherState, CipherState]:
        """(the cipher this side sends with, the one it receives with), once the handshake is done."""
        if not self.done:
            raise NoiseError("the handshake is not finished")
        first, second = self._state.split()  # the first encrypts what the initiator sends
        return (first, second) if self.role is Role.INITIATOR else (second, first)
