"""Hostile input: arbitrary, truncated and mutated frames give typed errors only, within bounded memory."""

from __future__ import annotations

import tracemalloc

import attrs
import crc32c
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import (
    Activations,
    Encoding,
    Error,
    FrameDecoder,
    FrameEncoder,
    Limits,
    NamedTensor,
    Phase,
    ProtocolError,
    RemoteProtocolError,
    Span,
    StatusCode,
    TokenLogprob,
    Tokens,
    Usage,
    UsageRecord,
    wire,
)
from protocol._generated.noderuntime.seam import v1 as pb

from . import protocol_helpers as h

LIMITS = Limits(max_frame_bytes=64 << 10, max_tensor_bytes=256 << 10, max_chunks=64)
ENC = FrameEncoder(LIMITS)
SEEDS = [
    *ENC.encode(h.open_route()),
    *ENC.encode(h.tokens()),
    *ENC.encode(h.activations(rows=2, width=64)),
    *ENC.encode(h.activations(rows=1, width=96, encoding=Encoding.Q8)),
    *ENC.encode(h.activations(rows=3, width=32, encoding=Encoding.BF16)),
    *ENC.encode(Error(h.header(3, Phase.CANCEL), StatusCode.INTERNAL, "x")),
    *ENC.encode(Usage(h.header(4), (UsageRecord(b"{}", b"n" * 32, b"s" * 64),))),
    *ENC.encode(
        Tokens(
            h.header(5, Phase.DECODE, Span(3, 4)),
            (9,),
            logprobs=(TokenLogprob(9, -0.5, ((9, -0.5), (4, -1.5))),),
            prompt_logprobs=(TokenLogprob(2, -3.0),),
        )
    ),
    *ENC.encode(h.activations(rows=40, width=576)),  # chunked
]
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_all(frames: list[bytes]) -> None:
    decoder = FrameDecoder(LIMITS)
    for frame in frames:
        try:
            decoder.receive(frame)
        except ProtocolError as exc:
            assert isinstance(exc.code, StatusCode)
            assert exc.message
            # the codec's last-resort translation: a check we lack, a defect, not a typed refusal
            assert not exc.message.startswith("malformed frame:"), exc.message


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes(data: bytes) -> None:
    _decode_all([data])


@FUZZ
@given(seed=st.sampled_from(SEEDS), cut=st.integers(0, 1 << 16))
def test_truncated_frames(seed: bytes, cut: int) -> None:
    _decode_all([seed[: cut % max(1, len(seed))]])


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = []
    for _ in range(draw(st.integers(1, 4))):
        data = bytearray(draw(st.sampled_from(SEEDS)))
        for _ in range(draw(st.integers(1, 8))):
            op = draw(st.sampled_from(["flip", "set", "insert", "delete", "splice"]))
            pos = draw(st.integers(0, max(0, len(data) - 1)))
            if op == "flip" and data:
                data[pos] ^= 1 << draw(st.integers(0, 7))
            elif op == "set" and data:
                data[pos] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x7A]))
            elif op == "insert":
                data[pos:pos] = draw(st.binary(min_size=1, max_size=12))
            elif op == "delete":
                del data[pos : pos + draw(st.integers(1, 16))]
            elif op == "splice":
                other = draw(st.sampled_from(SEEDS))
                data[pos:] = other[draw(st.integers(0, len(other) - 1)) :]
        frames.append(bytes(data))
    return frames


@FUZZ
@given(mutated())
def test_mutated_frames(frames: list[bytes]) -> None:
    _decode_all(frames)


def _reframe(body: pb.Activations) -> bytes:
    """A well-formed frame (correct checksum) around a hostile body."""
    return bytes(pb.Frame(header=h.reference_header(h.header(1), crc32c.crc32c(bytes(body))), activations=body))


@FUZZ
@given(
    shape=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=6),
    total=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**64 - 1),
    count=st.integers(0, 2**32 - 1),
    index=st.integers(0, 2**32 - 1),
    encoding=st.integers(0, 9),
    payload=st.binary(max_size=512),
)
def test_lying_declarations_with_valid_checksums(
    shape: list[int], total: int, offset: int, count: int, index: int, encoding: int, payload: bytes
) -> None:
    tensor = pb.Tensor(
        name="hidden_states",
        shape=shape,
        encoding=pb.Encoding(encoding) if encoding < 5 else encoding,
        total_bytes=total,
        offset=offset,
        chunk_index=index,
        chunk_count=count,
        payload=payload,
    )
    _decode_all([_reframe(pb.Activations(tensors=[tensor]))])


@pytest.mark.parametrize("encoding", [Encoding.F32, Encoding.F16, Encoding.BF16, Encoding.Q8])
def test_non_finite_payloads_are_refused(encoding: Encoding) -> None:
    n = 64
    raw = {
        Encoding.F32: np.full(n, np.nan, "<f4").tobytes(),
        Encoding.F16: np.full(n, np.inf, "<f2").tobytes(),
        Encoding.BF16: np.full(n, 0x7FC0, "<u2").tobytes(),  # NaN
        Encoding.Q8: (np.full(1, np.nan, "<f2").tobytes() + bytes(32)) * 2,
    }[encoding]
    tensor = pb.Tensor(
        name="hidden_states",
        shape=[1, n],
        encoding=pb.Encoding(int(encoding)),
        total_bytes=len(raw),
        chunk_count=1,
        payload=raw,
    )
    with pytest.raises(RemoteProtocolError, match="NaN or Inf"):
        FrameDecoder(LIMITS).receive(_reframe(pb.Activations(tensors=[tensor])))


@settings(max_examples=150, deadline=None)
@given(mutated())
def test_memory_stays_within_the_configured_limits(frames: list[bytes]) -> None:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        _decode_all(frames)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= LIMITS.max_tensor_bytes + LIMITS.max_frame_bytes + (64 << 10)


def test_a_huge_declared_step_cannot_make_the_decoder_allocate() -> None:
    tensor = pb.Tensor(
        name="hidden_states",
        shape=[65536, 1024],
        encoding=pb.Encoding.F32,
        total_bytes=65536 * 1024 * 4,
        chunk_count=4,
        payload=b"\x00" * 1024,
    )
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError) as info:
            FrameDecoder(LIMITS).receive(_reframe(pb.Activations(tensors=[tensor])))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
    assert peak < 1 << 20


def test_valid_seed_frames_decode() -> None:
    decoder = FrameDecoder(LIMITS)
    results = [decoder.receive(f) for f in SEEDS]
    assert isinstance(results[-1], Activations)
    bad = attrs.evolve(h.activations(), tensors=(NamedTensor("", np.zeros((1, 4), np.float32)),))
    (frame,) = ENC.encode(bad)
    with pytest.raises(RemoteProtocolError, match="without a name"):
        FrameDecoder(LIMITS).receive(frame)


def _cold_frame(field: int, body: bytes) -> bytes:
    """A frame with a correct checksum around any body of a cold message (``field`` in Frame)."""
    header = bytes(h.reference_header(h.header(1), crc32c.crc32c(body)))
    return wire.len_field(1, header) + wire.len_field(field, body)


COLD_SEEDS = {
    2: bytes(pb.Frame.parse(ENC.encode(h.open_route())[0]).open_route),
    5: bytes(pb.Release(reason="done")),
    7: bytes(pb.Error(code=13, message="x", node_id=b"n" * 32)),
    8: bytes(pb.Credit(frames=4)),
    9: bytes(pb.Usage(records=[pb.UsageRecord(body=b"{}", node_id=b"n" * 32, signature=b"s" * 64)])),
    10: bytes(pb.Prefix(positions=48)),
}


@pytest.mark.parametrize(
    ("field", "body"),
    [
        (2, b"\x08\x01"),  # OpenRoute.hops as a varint
        (2, b"\x10\x05"),  # OpenRoute.sampling as a varint
        (2, bytes(pb.OpenRoute(hops=[pb.Hop(node_id=b"n")])) + b"\x0a\x02\x20\x07"),  # Hop.layers as a varint
        (2, bytes(pb.OpenRoute(hops=[pb.Hop(node_id=b"n")])) + b"\x0a\x02\x30\x07"),  # Hop.recipe as a varint
        (2, b"\x3d\x00\x00\x00\x00"),  # OpenRoute.ticket as a fixed32
        (9, b"\x08\x03"),  # Usage.records as a varint
        (8, b"\x0a\x01a"),  # Credit.frames as bytes
        (10, b"\x0a\x01a"),  # Prefix.positions as bytes
        (2, bytes(pb.OpenRoute(hops=[pb.Hop(node_id=b"n")])) + b"\x1a" + wire.varint(400_000) + b"\x01" * 400_000),
        (2, b"\x0a\x00" * 100_000),  # 100,000 empty hops
        (9, b"\x0a\x00" * 100_000),  # 100,000 empty usage records
        (7, b"\xf8\x01\x00" * 100_000),  # 100,000 unknown fields
    ],
)
def test_cold_bodies_of_the_wrong_shape_are_refused_before_they_are_built(field: int, body: bytes) -> None:
    """The generated parser takes a wrong wire type as whatever it reads, and builds every element first."""
    with pytest.raises(RemoteProtocolError) as refused:
        FrameDecoder(Limits()).receive(_cold_frame(field, body))
    assert "has wire type" in refused.value.message or "has more than" in refused.value.message, refused.value


@FUZZ
@given(st.sampled_from(sorted(COLD_SEEDS)), st.data())
def test_mutated_cold_bodies_with_valid_checksums(field: int, data: st.DataObject) -> None:
    body = bytearray(COLD_SEEDS[field])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body)))
        body[at : at + data.draw(st.integers(0, 3))] = data.draw(st.binary(max_size=4))
    _decode_all([_cold_frame(field, bytes(body))])
