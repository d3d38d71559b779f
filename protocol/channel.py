"""The end-to-end channel of every seam, sans-IO: a Noise XX handshake pinned to node keys, then sealed records.

Whatever carries a seam's messages (a gRPC stream, or a relay that pairs two websocket
connections and forwards between them) must learn nothing of what crosses it and change
nothing unseen. So the two ends of every seam (node to node, or gateway to head) first
run a Noise XX handshake (:mod:`protocol.noise`) inside it, one handshake message per
message of the stream underneath:

1. dialer → acceptor: ``MAGIC``, then Noise message 1, whose (hashed, unencrypted)
   payload is the :class:`Binding`: session id, epoch, the dialer's node id and the
   node id it means to reach.
2. acceptor → dialer: Noise message 2; its encrypted payload is the acceptor's node id
   and its Ed25519 signature over its Noise static key (:data:`STATIC_KEY_DOMAIN`).
3. dialer → acceptor: Noise message 3, the dialer's node id and signature alike.

Each side checks the other's signature and that the key is the one it expects: the
dialer, the node the route plan names; the acceptor, the dialer the binding names
(and later, at ``OpenRoute``, that the ticket puts that dialer before it). Every
handshake message enters the handshake hash, so a path that alters the binding, swaps
a key or splices two handshakes fails the handshake. Afterwards each seam frame is one
message of sealed records; a path that flips, drops, reorders, replays or injects a
byte makes the next record fail to open (:class:`ChannelError`), and the session ends.
What a relay or a tap still sees is said in ``docs/security.md``.

Records: a frame is cut into slices of at most :data:`SLICE` bytes; each slice is
sealed with a one-byte kind in front (more follows / last slice / close), so the
message holds full-size records and one shorter last one and needs no lengths. A
close record carries a status code and a reason: a seam's end is authenticated too,
and a bare end of the stream (a relay's websocket close, a gRPC status) reads as a cut,
never as a clean end.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import attrs
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from protocol.errors import StatusCode
from protocol.noise import MAX_MESSAGE, TAGLEN, CipherState, Handshake, NoiseError, Role

# the first bytes a dialer sends: "noderuntime relay seam" (a name from when only relayed seams
# were sealed; direct ones are too now), format version 1. A peer that
# speaks another version (or plaintext frames) is told so, not misread
MAGIC = b"NRS\x01"
PROLOGUE = b"noderuntime-relay-seam-v1"
STATIC_KEY_DOMAIN = b"noderuntime-relay-seam-static-key-v1"
NODE_ID = 32
SIGNATURE = 64

RECORD = MAX_MESSAGE  # a full record: the largest message Noise allows
SLICE = RECORD - TAGLEN - 1  # the plaintext a full record carries after its kind byte
_MORE, _LAST, _CLOSE = 0, 1, 2
MAX_REASON = 512

# a signature check: (node id, domain, message, signature) -> whether it verifies
Verify = Callable[[bytes, bytes, bytes, bytes], bool]


def sealed_size(frame_bytes: int) -> int:
    """The size of the message that carries a frame of ``frame_bytes``: one tag and kind byte per record."""
    records = max(1, -(-frame_bytes // SLICE))
    return frame_bytes + records * (TAGLEN + 1)


class ChannelError(Exception):
    """The channel failed: a handshake that did not verify, a record that did not open.

    ``code`` is the status the session ends with.
    """

    def __init__(self, message: str, code: StatusCode) -> None:
        super().__init__(message)
        self.code = code


class ChannelClosed(Exception):
    """The peer closed the channel with a sealed close record: ``code`` (OK for a clean end) and ``reason``."""

    def __init__(self, code: StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


@attrs.frozen
class Binding:
    """What a relayed seam is for; both sides' handshake hashes cover it."""

    session_id: bytes
    epoch: int
    dialer: bytes  # node id (Ed25519 public key) of the side that dials through the relay
    acceptor: bytes  # node id of the side it dials

    _FORMAT = struct.Struct(">16sQ32s32s")

    def encode(self) -> bytes:
        """The fixed 88-byte form."""
        return self._FORMAT.pack(self.session_id, self.epoch, self.dialer, self.acceptor)

    @classmethod
    def decode(cls, data: bytes) -> Binding:
        """Read one; :class:`ChannelError` if ``data`` is not exactly one."""
        if len(data) != cls._FORMAT.size:
            raise ChannelError("malformed seam binding in the handshake", StatusCode.INVALID_ARGUMENT)
        session_id, epoch, dialer, acceptor = cls._FORMAT.unpack(data)
        return cls(session_id, epoch, dialer, acceptor)


@attrs.frozen(eq=False)
class ChannelKeys:
    """One side's keys: its node id, a Noise static key, and its node key's signature over that static key.

    Made once per process (:func:`noderuntime.access.identity.channel_keys`); the static key is never
    written anywhere.
    """

    node_id: bytes
    static: X25519PrivateKey
    proof: bytes  # the node key's signature over the static public key, domain STATIC_KEY_DOMAIN

    def payload(self) -> bytes:
        """What this side's handshake message carries: its node id and the proof."""
        return self.node_id + self.proof


def _check_peer(payload: bytes, remote_static: bytes | None, expected: bytes, verify: Verify, who: str) -> bytes:
    if len(payload) != NODE_ID + SIGNATURE or remote_static is None:
        raise ChannelError(f"malformed identity from {who} in the handshake", StatusCode.INVALID_ARGUMENT)
    node_id, proof = payload[:NODE_ID], payload[NODE_ID:]
    if not verify(node_id, STATIC_KEY_DOMAIN, remote_static, proof):
        raise ChannelError(
            f"{who} sent a handshake key its node key did not sign: not the node it claims to be",
            StatusCode.UNAUTHENTICATED,
        )
    if node_id != expected:
        raise ChannelError(
            f"{who} is node {node_id.hex()[:16]}, not the expected {expected.hex()[:16]}",
            StatusCode.UNAUTHENTICATED,
        )
    return node_id


class DialerHandshake:
    """The dialling side: ``first()``, then ``read_second(message)`` which returns the third message."""

    def __init__(self, keys: ChannelKeys, binding: Binding, verify: Verify) -> None:
        if binding.dialer != keys.node_id:
            raise ValueError("the binding must name this side as the dialer")
        self.binding = binding
        self._keys = keys
        self._verify = verify
        self._noise = Handshake(Role.INITIATOR, keys.static, PROLOGUE)

    def first(self) -> bytes:
        """Message 1: the magic and the binding."""
        return MAGIC + self._noise.write_message(self.binding.encode())

    def read_second(self, message: bytes) -> bytes:
        """Check the acceptor's message 2; returns message 3. :class:`ChannelError` if it is not the named node."""
        try:
            payload = self._noise.read_message(message)
        except NoiseError as exc:
            raise ChannelError(f"the handshake's answer did not verify: {exc}", StatusCode.UNAUTHENTICATED) from None
        who = "the node it dials"
        _check_peer(payload, self._noise.remote_static, self.binding.acceptor, self._verify, who)
        return self._noise.write_message(self._keys.payload())

    def channel(self) -> SealedChannel:
        """The channel, once message 3 is written."""
        send, receive = self._noise.split()
        return SealedChannel(send, receive, peer=self.binding.acceptor, binding=self.binding)


class AcceptorHandshake:
    """The accepting side: ``read_first(message)`` returns message 2; ``read_third(message)`` ends it."""

    def __init__(self, keys: ChannelKeys, verify: Verify) -> None:
        self._keys = keys
        self._verify = verify
        self._noise = Handshake(Role.RESPONDER, keys.static, PROLOGUE)
        self.binding: Binding | None = None

    def read_first(self, message: bytes) -> bytes:
        """Read the dialer's message 1 and its binding; returns message 2.

        A message without :data:`MAGIC` is a peer that does not speak this channel
        (plaintext seam frames, another version): refused, never read as frames.
        """
        if not message.startswith(MAGIC):
            if message[:3] == MAGIC[:3]:
                raise ChannelError(
                    f"the dialer speaks seam version {message[3]}; this node speaks {MAGIC[3]}",
                    StatusCode.FAILED_PRECONDITION,
                )
            raise ChannelError(
                "the dialer did not open a sealed seam; this node accepts seams only sealed end to end (seam "
                f"version {MAGIC[3]}): upgrade the dialing side, or start both ends with --insecure-plaintext-seams",
                StatusCode.FAILED_PRECONDITION,
            )
        try:
            payload = self._noise.read_message(message[len(MAGIC) :])
        except NoiseError as exc:
            raise ChannelError(f"malformed handshake: {exc}", StatusCode.INVALID_ARGUMENT) from None
        binding = Binding.decode(payload)
        if binding.acceptor != self._keys.node_id:
            raise ChannelError(
                "the seam was meant for another node (a relay paired it wrongly, or its address was given for "
                "another node's)",
                StatusCode.PERMISSION_DENIED,
            )
        self.binding = binding
        try:
            # the answer's first DH takes the dialer's ephemeral key: one of the few points no DH
            # may use (all zeros, say) is found only here, and is the dialer's fault like the rest
            return self._noise.write_message(self._keys.payload())
        except NoiseError as exc:
            raise ChannelError(f"malformed handshake: {exc}", StatusCode.INVALID_ARGUMENT) from None

    def read_third(self, message: bytes) -> SealedChannel:
        """Check the dialer's message 3: it must be the node the binding names."""
        if self.binding is None:
            raise ChannelError("the handshake's third message came before its first", StatusCode.INVALID_ARGUMENT)
        try:
            payload = self._noise.read_message(message)
        except NoiseError as exc:
            raise ChannelError(f"the dialer's handshake did not verify: {exc}", StatusCode.UNAUTHENTICATED) from None
        _check_peer(payload, self._noise.remote_static, self.binding.dialer, self._verify, "the dialer")
        send, receive = self._noise.split()
        return SealedChannel(send, receive, peer=self.binding.dialer, binding=self.binding)


class SealedChannel:
    """Both directions' cipher states after the handshake: seal frames into messages and open them."""

    def __init__(self, send: CipherState, receive: CipherState, *, peer: bytes, binding: Binding) -> None:
        self._send = send
        self._receive = receive
        self.peer = peer  # the other side's node id, authenticated by the handshake
        self.binding = binding
        self.closed = False  # a close record went out or came in

    def seal(self, frame: bytes) -> bytes:
        """One message carrying ``frame``: full records, then the last one."""
        if self.closed:
            raise ChannelError("the channel is closed", StatusCode.FAILED_PRECONDITION)
        view = memoryview(frame)
        encrypt = self._send.encrypt_with_ad
        records = [encrypt(b"", b"\x00" + view[i : i + SLICE]) for i in range(0, len(view) - SLICE, SLICE)]
        records.append(encrypt(b"", b"\x01" + view[len(records) * SLICE :]))
        return records[0] if len(records) == 1 else b"".join(records)

    def seal_close(self, code: StatusCode, reason: str) -> bytes:
        """The message that ends the channel, with ``code`` (OK: a clean end) and ``reason``."""
        if self.closed:
            raise ChannelError("the channel is closed", StatusCode.FAILED_PRECONDITION)
        self.closed = True
        text = reason.encode()[:MAX_REASON]
        return self._send.encrypt_with_ad(b"", bytes((_CLOSE, int(code))) + text)

    def open(self, message: bytes) -> bytes:
        """The frame ``message`` carries.

        :class:`ChannelClosed` for a close record; :class:`ChannelError` (DATA_LOSS) for
        anything that does not open in order: the relay, or someone on the path, touched it.
        """
        if self.closed:
            raise ChannelError("a message came after the channel closed", StatusCode.DATA_LOSS)
        if not message:
            raise ChannelError("an empty message on a sealed seam", StatusCode.DATA_LOSS)
        decrypt = self._receive.decrypt_with_ad
        parts = []
        view = memoryview(message)
        for start in range(0, len(view), RECORD):
            try:
                plain = decrypt(b"", view[start : start + RECORD])
            except NoiseError:
                raise ChannelError(
                    "a relayed message failed authentication: it was altered, dropped, reordered, replayed or "
                    "injected on the way",
                    StatusCode.DATA_LOSS,
                ) from None
            if not plain:
                raise ChannelError("a sealed record without its kind", StatusCode.DATA_LOSS)
            kind, last = plain[0], start + RECORD >= len(view)
            if kind == _CLOSE and start == 0 and last and len(plain) >= 2:
                self.closed = True
                raise ChannelClosed(StatusCode.coerce(plain[1]), plain[2:].decode("utf-8", "replace"))
            if kind != (_LAST if last else _MORE):
                raise ChannelError("a sealed message whose records do not end where it ends", StatusCode.DATA_LOSS)
            parts.append(plain[1:])
        return parts[0] if len(parts) == 1 else b"".join(parts)
