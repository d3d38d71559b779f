"""Reassembly of chunked steps: bounded, and refusing gaps, duplicates, overlaps and lies."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

from protocol import Activations, FrameDecoder, FrameEncoder, Limits, RemoteProtocolError, StatusCode
from protocol._generated.noderuntime.seam import v1 as pb

from . import protocol_helpers as h

LIMITS = Limits(max_frame_bytes=16 << 10)


def _chunk_frame(
    step: int = 1,
    name: str = "hidden_states",
    shape: tuple[int, ...] = (4, 576),
    offset: int = 0,
    length: int = 4096,
    index: int = 0,
    count: int = 3,
    total: int | None = None,
    tensor_count: int = 1,
    encoding: int = 1,
) -> bytes:
    total = 4 * int(np.prod(shape)) if total is None else total
    tensor = pb.Tensor(
        name=name,
        shape=list(shape),
        encoding=pb.Encoding(encoding),
        total_bytes=total,
        offset=offset,
        chunk_index=index,
        chunk_count=count,
        payload=bytes(length),
    )
    body = pb.Activations(tensors=[tensor], tensor_count=tensor_count)
    header = h.header(step, positions=h.Span(0, 4))
    return bytes(pb.Frame(header=h.reference_header(header, crc32c.crc32c(bytes(body))), activations=body))


def _refuse(frames: list[bytes], match: str, code: StatusCode = StatusCode.INVALID_ARGUMENT) -> None:
    decoder = FrameDecoder(LIMITS)
    with pytest.raises(RemoteProtocolError, match=match) as info:
        for frame in frames:
            decoder.receive(frame)
    assert info.value.code == code
    assert decoder.pending_bytes == 0  # nothing is held after an error


def test_in_order_chunks_complete() -> None:
    total = 4 * 4 * 576
    frames = [
        _chunk_frame(offset=o, length=min(4096, total - o), index=i, count=3) for i, o in enumerate([0, 4096, 8192])
    ]
    decoder = FrameDecoder(LIMITS)
    assert decoder.receive(frames[0]) is None and decoder.receive(frames[1]) is None
    assert decoder.pending_bytes == 8192
    event = decoder.receive(frames[2])
    assert isinstance(event, Activations) and event.tensor("hidden_states").shape == (4, 576)


def test_gap_is_refused() -> None:
    _refuse(
        [
            _chunk_frame(offset=0, index=0),
            _chunk_frame(offset=4096, index=1),
            _chunk_frame(offset=9000, length=100, index=2),
        ],
        "gap",
    )


def test_duplicate_chunk_is_refused() -> None:
    _refuse([_chunk_frame(offset=0, index=0), _chunk_frame(offset=0, index=0)], "sent twice")


def test_overlap_is_refused() -> None:
    _refuse([_chunk_frame(offset=0, index=0), _chunk_frame(offset=2048, index=1)], "overlaps")


def test_mismatched_shape_between_chunks_is_refused() -> None:
    _refuse(
        [_chunk_frame(offset=0, index=0), _chunk_frame(offset=4096, index=1, shape=(2, 1152))],
        "disagrees with the first chunk",
    )


def test_chunk_past_the_end_is_refused() -> None:
    _refuse([_chunk_frame(offset=8192, length=4096, index=2, shape=(2, 576))], "ends past")


def test_lying_total_is_refused() -> None:
    _refuse([_chunk_frame(total=999)], "declares 999 bytes")


def test_oversized_declared_shape_is_refused_before_allocating() -> None:
    _refuse([_chunk_frame(shape=(1 << 20, 1 << 12), total=4 << 32)], "exceeds", StatusCode.RESOURCE_EXHAUSTED)


def test_too_many_chunks_is_refused() -> None:
    _refuse([_chunk_frame(count=LIMITS.max_chunks + 1)], "chunk 0 of")


def test_interleaved_steps_are_refused() -> None:
    _refuse([_chunk_frame(step=1, offset=0, index=0), _chunk_frame(step=2, offset=4096, index=1)], "interleaved")


def test_another_frame_type_inside_a_chunked_step_is_refused() -> None:
    (tokens,) = FrameEncoder().encode(h.tokens(step=2))
    _refuse([_chunk_frame(offset=0, index=0), tokens], "left incomplete")


def test_more_tensors_than_declared_are_refused() -> None:
    _refuse(
        [_chunk_frame(name="a", count=2, tensor_count=1), _chunk_frame(name="b", count=2, tensor_count=1)],
        "more tensors than",
    )


def test_multi_tensor_steps_round_trip() -> None:
    from protocol import NamedTensor

    base = h.activations(rows=8, width=576)
    extra = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
    event = Activations(base.header, (*base.tensors, NamedTensor("position_bias", extra)))
    decoder = FrameDecoder(LIMITS)
    results = [decoder.receive(f) for f in FrameEncoder(LIMITS).encode(event)]
    final = results[-1]
    assert isinstance(final, Activations)
    assert [t.name for t in final.tensors] == ["hidden_states", "position_bias"]
    assert np.array_equal(final.tensor("position_bias"), extra)
