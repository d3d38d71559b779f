"""The relayed seam's channel, sans-IO: Noise XX against an independent implementation, then the channel's rules.

``noiseprotocol`` (a separate implementation of the same spec) is the other side of
every handshake in the first tests: the same handshake hash, each side reading the
other's payloads and transport messages, whichever side begins.
"""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from noise.connection import Keypair, NoiseConnection

from noderuntime.access.identity import Identity, channel_keys, verify
from protocol import StatusCode
from protocol.channel import (
    MAGIC,
    RECORD,
    SLICE,
    AcceptorHandshake,
    Binding,
    ChannelClosed,
    ChannelError,
    ChannelKeys,
    DialerHandshake,
    SealedChannel,
    sealed_size,
)
from protocol.noise import MAX_MESSAGE, PROTOCOL_NAME, Handshake, NoiseError, Role, public_bytes


def _raw(key: X25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _theirs(initiator: bool, static: X25519PrivateKey, prologue: bytes) -> NoiseConnection:
    other = NoiseConnection.from_name(PROTOCOL_NAME)
    if initiator:
        other.set_as_initiator()
    else:
        other.set_as_responder()
    other.set_prologue(prologue)
    other.set_keypair_from_private_bytes(Keypair.STATIC, _raw(static))
    other.start_handshake()
    return other


@pytest.mark.parametrize("ours_begins", [True, False], ids=["ours-initiates", "theirs-initiates"])
def test_the_handshake_and_transport_agree_with_an_independent_implementation(ours_begins: bool) -> None:
    mine, yours = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    prologue = os.urandom(40)
    ours = Handshake(Role.INITIATOR if ours_begins else Role.RESPONDER, mine, prologue)
    theirs = _theirs(not ours_begins, yours, prologue)
    payloads = [os.urandom(n) for n in (0, 88, 96)]
    for turn, payload in enumerate(payloads):
        ours_writes = (turn % 2 == 0) == ours_begins
        if ours_writes:
            assert theirs.read_message(ours.write_message(payload)) == payload
        else:
            assert ours.read_message(theirs.write_message(payload)) == payload
    assert ours.done and theirs.handshake_finished
    assert ours.handshake_hash == theirs.get_handshake_hash()
    assert ours.remote_static == public_bytes(yours)
    send, receive = ours.split()
    for size in (0, 1, 2442, MAX_MESSAGE - 16):
        message = os.urandom(size)
        assert theirs.decrypt(send.encrypt_with_ad(b"", message)) == message
        assert receive.decrypt_with_ad(b"", theirs.encrypt(message)) == message


def test_a_different_prologue_fails_the_handshake() -> None:
    ours = Handshake(Role.INITIATOR, X25519PrivateKey.generate(), b"one")
    theirs = _theirs(False, X25519PrivateKey.generate(), b"two")
    theirs.read_message(ours.write_message())  # the first message has no key yet: it passes
    with pytest.raises(NoiseError):
        ours.read_message(theirs.write_message(b"payload"))


def test_messages_out_of_turn_are_refused() -> None:
    ours = Handshake(Role.RESPONDER, X25519PrivateKey.generate())
    with pytest.raises(NoiseError):
        ours.write_message()
    with pytest.raises(NoiseError):
        ours.read_message(b"short")


# --- the channel


def _keys() -> tuple[Identity, ChannelKeys]:
    identity = Identity.generate()
    return identity, channel_keys(identity)


def _pair(binding_for: bytes | None = None) -> tuple[SealedChannel, SealedChannel]:
    """(dialer's channel, acceptor's channel) after a full handshake."""
    _, dialer = _keys()
    _, acceptor = _keys()
    binding = Binding(os.urandom(16), 3, dialer.node_id, binding_for or acceptor.node_id)
    dial = DialerHandshake(dialer, binding, verify)
    accept = AcceptorHandshake(acceptor, verify)
    second = accept.read_first(dial.first())
    third = dial.read_second(second)
    theirs = accept.read_third(third)
    return dial.channel(), theirs


def test_a_handshake_authenticates_both_ends_and_binds_the_session() -> None:
    dialer, acceptor = _pair()
    assert dialer.peer == acceptor.binding.acceptor and acceptor.peer == dialer.binding.dialer
    assert dialer.binding == acceptor.binding


@pytest.mark.parametrize("size", [0, 1, 2442, SLICE - 1, SLICE, SLICE + 1, 3 * SLICE + 5, (4 << 20)])
def test_frames_of_every_size_pass_sealed_both_ways(size: int) -> None:
    dialer, acceptor = _pair()
    frame = os.urandom(size)
    message = dialer.seal(frame)
    assert len(message) == sealed_size(size)
    # the plaintext does not show in the message (a frame of a few random bytes could, by chance:
    # one byte is somewhere in a 40-byte ciphertext one time in seven)
    assert frame not in message or size < 16
    assert acceptor.open(message) == frame
    assert dialer.open(acceptor.seal(frame)) == frame


def _tampered(kind: str, messages: list[bytes]) -> list[bytes]:
    first, second, third = messages
    if kind == "flip":
        return [first, second[:10] + bytes([second[10] ^ 1]) + second[11:], third]
    if kind == "drop":
        return [first, third]
    if kind == "reorder":
        return [first, third, second]
    if kind == "replay":
        return [first, second, second]
    if kind == "inject":
        return [first, os.urandom(len(second)), second]
    if kind == "truncate":  # a multi-record message cut at a record boundary
        return [first, second[:RECORD], third]
    if kind == "extend":  # a record from another message appended
        return [first, second + third[:RECORD], third]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["flip", "drop", "reorder", "replay", "inject", "truncate", "extend"])
def test_any_change_on_the_way_is_refused_as_data_loss(kind: str) -> None:
    dialer, acceptor = _pair()
    frames = [os.urandom(100), os.urandom(2 * SLICE + 7), os.urandom(3 * SLICE)]
    received = []
    with pytest.raises(ChannelError) as refused:
        for message in _tampered(kind, [dialer.seal(f) for f in frames]):
            received.append(acceptor.open(message))
    assert refused.value.code == StatusCode.DATA_LOSS
    assert received == frames[: len(received)]  # what was accepted is what was sent


def test_a_close_record_ends_the_channel_with_its_status() -> None:
    dialer, acceptor = _pair()
    assert acceptor.open(dialer.seal(b"frame")) == b"frame"
    with pytest.raises(ChannelClosed) as closed:
        acceptor.open(dialer.seal_close(StatusCode.RESOURCE_EXHAUSTED, "node full"))
    assert (closed.value.code, closed.value.reason) == (StatusCode.RESOURCE_EXHAUSTED, "node full")
    with pytest.raises(ChannelError):
        dialer.seal(b"after the end")
    with pytest.raises(ChannelError):
        acceptor.open(b"anything")


def test_the_acceptor_must_be_the_node_the_binding_names() -> None:
    """A relay that pairs a dialer with another node: that node refuses, and cannot pass as the named one."""
    _, dialer = _keys()
    _, named = _keys()
    _, other = _keys()
    binding = Binding(os.urandom(16), 0, dialer.node_id, named.node_id)
    with pytest.raises(ChannelError) as refused:
        AcceptorHandshake(other, verify).read_first(DialerHandshake(dialer, binding, verify).first())
    assert refused.value.code == StatusCode.PERMISSION_DENIED
    # an accomplice that takes the named node's id without its key cannot sign its static key
    liar = ChannelKeys(named.node_id, other.static, other.proof)
    dial = DialerHandshake(dialer, binding, verify)
    second = AcceptorHandshake(liar, verify).read_first(dial.first())
    with pytest.raises(ChannelError) as refused:
        dial.read_second(second)
    assert refused.value.code == StatusCode.UNAUTHENTICATED


def test_a_rewritten_binding_fails_the_handshake() -> None:
    _, dialer = _keys()
    _, acceptor = _keys()
    binding = Binding(os.urandom(16), 0, dialer.node_id, acceptor.node_id)
    dial = DialerHandshake(dialer, binding, verify)
    first = bytearray(dial.first())
    first[len(MAGIC) + 32 + 3] ^= 1  # inside the session id, which the relay would like to swap
    accept = AcceptorHandshake(acceptor, verify)
    second = accept.read_first(bytes(first))
    with pytest.raises(ChannelError) as refused:
        dial.read_second(second)
    assert refused.value.code == StatusCode.UNAUTHENTICATED


def test_the_dialer_must_be_the_node_its_binding_names() -> None:
    _, dialer = _keys()
    _, acceptor = _keys()
    _, claimed = _keys()
    binding = Binding(os.urandom(16), 0, claimed.node_id, acceptor.node_id)
    # a dialer that claims another's id in its binding cannot prove it
    impostor = ChannelKeys(claimed.node_id, dialer.static, dialer.proof)
    dial = DialerHandshake(impostor, binding, verify)
    accept = AcceptorHandshake(acceptor, verify)
    third = dial.read_second(accept.read_first(dial.first()))
    with pytest.raises(ChannelError) as refused:
        accept.read_third(third)
    assert refused.value.code == StatusCode.UNAUTHENTICATED


def test_a_plaintext_peer_and_another_version_are_told_what_they_lack() -> None:
    _, acceptor = _keys()
    with pytest.raises(ChannelError) as plaintext:
        AcceptorHandshake(acceptor, verify).read_first(b"\x0a\x10some protobuf frame")
    assert plaintext.value.code == StatusCode.FAILED_PRECONDITION and "only sealed" in str(plaintext.value)
    with pytest.raises(ChannelError) as newer:
        AcceptorHandshake(acceptor, verify).read_first(MAGIC[:3] + b"\x02" + os.urandom(120))
    assert newer.value.code == StatusCode.FAILED_PRECONDITION and "version 2" in str(newer.value)


@pytest.mark.parametrize("size", [0, 10, 31, 32, 100, 200, 5000])
def test_garbage_in_place_of_a_handshake_is_a_typed_error(size: int) -> None:
    _, keys = _keys()
    accept = AcceptorHandshake(keys, verify)
    with pytest.raises(ChannelError):
        accept.read_first(MAGIC + os.urandom(size))
    binding = Binding(os.urandom(16), 0, keys.node_id, os.urandom(32))
    dial = DialerHandshake(keys, binding, verify)
    dial.first()
    with pytest.raises(ChannelError):
        dial.read_second(os.urandom(size))


# points of small order (and a non-canonical one) that no X25519 exchange may use
SMALL_ORDER_POINTS = {
    "zero": bytes(32),
    "one": b"\x01" + bytes(31),
    "order-8": bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    "p-minus-1": bytes.fromhex("ec" + "ff" * 30 + "7f"),
}


@pytest.mark.parametrize("point", SMALL_ORDER_POINTS.values(), ids=SMALL_ORDER_POINTS.keys())
def test_a_first_message_with_a_small_order_ephemeral_key_is_a_typed_error(point: bytes) -> None:
    """The acceptor meets the key only in its answer's DH: that refusal is a ChannelError too, not a crash."""
    _, dialer = _keys()
    _, acceptor = _keys()
    first = bytearray(
        DialerHandshake(dialer, Binding(os.urandom(16), 0, dialer.node_id, acceptor.node_id), verify).first()
    )
    first[len(MAGIC) : len(MAGIC) + 32] = point
    with pytest.raises(ChannelError) as refused:
        AcceptorHandshake(acceptor, verify).read_first(bytes(first))
    assert refused.value.code == StatusCode.INVALID_ARGUMENT and "X25519" in str(refused.value)
