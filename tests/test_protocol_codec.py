"""The frame codec: byte-identity with the generated code, round trips, any valid encoding."""

from __future__ import annotations

import random

import attrs
import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    Activations,
    Cancel,
    Credit,
    Encoding,
    Error,
    FrameDecoder,
    FrameEncoder,
    Header,
    Limits,
    LocalProtocolError,
    NamedTensor,
    Phase,
    Prefix,
    Release,
    RemoteProtocolError,
    Sampling,
    Span,
    StatusCode,
    TokenLogprob,
    Tokens,
    Usage,
    UsageRecord,
    route_recipe,
)
from protocol import generate as generate_module
from protocol._generated.noderuntime.seam import v1 as pb

from . import protocol_helpers as h


def test_committed_generated_code_is_fresh() -> None:
    assert generate_module.stale() == []


def _reference_activations(event: Activations) -> bytes:
    tensors = []
    for t in event.tensors:
        from protocol import encodings

        payload = encodings.encode(t.array, t.encoding)
        tensors.append(
            pb.Tensor(
                name=t.name,
                shape=list(t.array.shape),
                encoding=pb.Encoding(int(t.encoding)),
                total_bytes=len(payload),
                chunk_count=1,
                payload=payload,
            )
        )
    body = pb.Activations(tensors=tensors, tensor_count=len(tensors), draft=list(event.draft), follows=event.follows)
    crc = crc32c.crc32c(bytes(body))
    return bytes(pb.Frame(header=h.reference_header(event.header, crc), activations=body))


headers = st.builds(
    h.header,
    step=st.integers(0, 2**64 - 1),
    phase=st.sampled_from(list(Phase)),
    positions=st.builds(Span, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1)),
    cache=st.integers(0, 2**32 - 1),
)


@settings(max_examples=200, deadline=None)
@given(
    header=headers,
    rows=st.integers(1, 8),
    width=st.integers(1, 64),
    encoding=st.sampled_from(list(Encoding)),
    seed=st.integers(0, 1000),
)
def test_activations_frames_are_byte_identical_to_generated_code(
    header: Header, rows: int, width: int, encoding: Encoding, seed: int
) -> None:
    array = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    event = Activations(header, (NamedTensor("hidden_states", array, encoding),))
    (frame,) = FrameEncoder().encode(event)
    assert frame == _reference_activations(event)
    decoded = FrameDecoder().receive(frame)
    assert isinstance(decoded, Activations) and decoded.header == header
    assert decoded.tensor("hidden_states").shape == (rows, width)
    if encoding == Encoding.F32:
        assert np.array_equal(decoded.tensor("hidden_states"), array)


@settings(max_examples=100, deadline=None)
@given(
    header=headers,
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=50),
    finished=st.booleans(),
    reason=st.text(max_size=20),
)
def test_tokens_frames_are_byte_identical_to_generated_code(
    header: Header, token_ids: list[int], finished: bool, reason: str
) -> None:
    event = Tokens(header, tuple(token_ids), finished, reason)
    (frame,) = FrameEncoder().encode(event)
    body = pb.Tokens(token_ids=token_ids, finished=finished, finish_reason=reason)
    crc = crc32c.crc32c(bytes(body))
    assert frame == bytes(pb.Frame(header=h.reference_header(header, crc), tokens=body))
    assert FrameDecoder().receive(frame) == event


logprob_entries = st.builds(
    TokenLogprob,
    st.integers(0, 2**32 - 1),
    st.floats(-1e9, 0.0, width=32),
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.floats(-1e9, 0.0, width=32)), max_size=20).map(tuple),
)


@settings(max_examples=100, deadline=None)
@given(header=headers, data=st.data(), prompt=st.lists(logprob_entries, max_size=8))
def test_tokens_frames_with_logprobs_are_byte_identical_to_generated_code(
    header: Header, data: st.DataObject, prompt: list[TokenLogprob]
) -> None:
    entries = data.draw(st.lists(logprob_entries, min_size=1, max_size=4))
    event = Tokens(header, tuple(e.token for e in entries), False, "", tuple(entries), tuple(prompt))

    def message(e: TokenLogprob) -> pb.TokenLogprob:
        return pb.TokenLogprob(
            token=e.token, logprob=e.logprob, top_tokens=[t for t, _ in e.top], top_logprobs=[p for _, p in e.top]
        )

    (frame,) = FrameEncoder().encode(event)
    body = pb.Tokens(
        token_ids=[e.token for e in entries],
        logprobs=[message(e) for e in entries],
        prompt_logprobs=[message(e) for e in prompt],
    )
    crc = crc32c.crc32c(bytes(body))
    assert frame == bytes(pb.Frame(header=h.reference_header(header, crc), tokens=body))
    assert FrameDecoder().receive(frame) == event


@pytest.mark.parametrize(
    ("entries", "token_count", "problem"),
    [
        ([pb.TokenLogprob(token=1, logprob=0.5)], 1, "finite number <= 0"),
        ([pb.TokenLogprob(token=1, logprob=float("nan"))], 1, "finite number <= 0"),
        ([pb.TokenLogprob(token=1, logprob=-1.0, top_tokens=[1, 2], top_logprobs=[-1.0])], 1, "pair each token"),
        (
            [pb.TokenLogprob(token=1, logprob=-1.0, top_tokens=list(range(21)), top_logprobs=[-1.0] * 21)],
            1,
            "more than 20 top",
        ),
        ([pb.TokenLogprob(token=1, logprob=-1.0)] * 2, 1, "one each, or none"),
    ],
)
def test_bad_logprobs_are_typed_rejections(entries: list[pb.TokenLogprob], token_count: int, problem: str) -> None:
    body = pb.Tokens(token_ids=list(range(token_count)), logprobs=entries)
    head = h.reference_header(h.tokens().header, crc32c.crc32c(bytes(body)))
    with pytest.raises(RemoteProtocolError, match=problem):
        FrameDecoder().receive(bytes(pb.Frame(header=head, tokens=body)))


@pytest.mark.parametrize(
    "event",
    [
        h.open_route(),
        h.tokens(),
        Release(h.header(5, Phase.RELEASE), "done"),
        Cancel(h.header(5, Phase.CANCEL), "client gone"),
        Error(h.header(5, Phase.CANCEL), StatusCode.RESOURCE_EXHAUSTED, "full", b"\x07" * 32),
        Credit(h.header(3), 4),
        Prefix(h.header(1), 48),
        Usage(h.header(9, Phase.RELEASE), (UsageRecord(b'{"tokens": 3}', b"\x01" * 32, b"\x02" * 64),)),
    ],
    ids=lambda e: type(e).__name__,
)
def test_every_event_round_trips(event: object) -> None:
    (frame,) = FrameEncoder().encode(event)  # type: ignore[arg-type]
    assert FrameDecoder().receive(frame) == event


def test_any_valid_encoding_is_read_fields_reordered_unpacked_and_unknown() -> None:
    event = h.tokens()
    body = pb.Tokens(token_ids=[7, 300, 70000], finished=True, finish_reason="stop")
    body_bytes = bytes(body)
    # unpacked repeated field, fields in reverse order, plus an unknown field 99
    unpacked = (
        b"".join(bytes([0x08]) + _varint(v) for v in [7, 300, 70000])
        + bytes(pb.Tokens(finish_reason="stop", finished=True))
        + _varint(99 << 3)
        + _varint(5)
    )
    crc = crc32c.crc32c(unpacked)
    head = bytes(h.reference_header(event.header, crc))
    frame = bytes([0x22]) + _varint(len(unpacked)) + unpacked + bytes([0x0A]) + _varint(len(head)) + head
    decoded = FrameDecoder().receive(frame)
    assert decoded == Tokens(event.header, (7, 300, 70000), True, "stop")
    assert body_bytes  # the packed form is what we write


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def test_checksum_mismatch_is_data_loss() -> None:
    (frame,) = FrameEncoder().encode(h.activations())
    damaged = bytearray(frame)
    damaged[-3] ^= 0x40
    with pytest.raises(RemoteProtocolError) as info:
        FrameDecoder().receive(bytes(damaged))
    assert info.value.code == StatusCode.DATA_LOSS


def test_large_steps_are_chunked_and_reassembled() -> None:
    limits = Limits(max_frame_bytes=64 << 10)
    event = h.activations(rows=100, width=576, step=1)
    frames = FrameEncoder(limits).encode(event)
    assert len(frames) == 4 and all(len(f) <= limits.max_frame_bytes for f in frames)
    decoder = FrameDecoder(limits)
    results = [decoder.receive(f) for f in frames]
    assert results[:-1] == [None] * 3
    final = results[-1]
    assert isinstance(final, Activations)
    assert np.array_equal(final.tensor("hidden_states"), event.tensor("hidden_states"))
    # chunks may arrive in any order
    shuffled = frames[:]
    random.Random(3).shuffle(shuffled)
    results = [decoder.receive(f) for f in shuffled]
    assert isinstance(results[-1], Activations)


def test_a_frame_over_the_limit_is_refused_on_both_sides() -> None:
    limits = Limits(max_frame_bytes=4096)
    event = Tokens(h.header(1), tuple(range(5000)))
    with pytest.raises(LocalProtocolError) as info:
        FrameEncoder(limits).encode(event)
    assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
    (frame,) = FrameEncoder().encode(event)
    with pytest.raises(RemoteProtocolError) as remote:
        FrameDecoder(limits).receive(frame)
    assert remote.value.code == StatusCode.RESOURCE_EXHAUSTED


def test_a_penalty_window_longer_than_a_prompt_may_be_is_refused() -> None:
    """The tail's sampler allocates the window: 2**31 tokens would be 8 GiB."""
    limits = Limits()
    fits = attrs.evolve(h.open_route(), sampling=Sampling(penalty_last_n=limits.max_tokens, repeat_penalty=1.5))
    (frame,) = FrameEncoder().encode(fits)
    assert FrameDecoder(limits).receive(frame) == fits
    huge = attrs.evolve(fits, sampling=Sampling(penalty_last_n=2**31 - 1, repeat_penalty=1.5))
    (frame,) = FrameEncoder().encode(huge)
    with pytest.raises(RemoteProtocolError) as refused:
        FrameDecoder(limits).receive(frame)
    assert refused.value.code == StatusCode.OUT_OF_RANGE and "penalty_last_n" in str(refused.value)


def test_a_grammar_crosses_the_seam_within_its_own_bound() -> None:
    """A JSON schema's grammar is far longer than other strings, and still bounded."""
    limits = Limits()
    grammar = "root ::= " + " | ".join(f'"{i}"' for i in range(9000))  # about 70 KiB
    fits = attrs.evolve(h.open_route(), sampling=Sampling(grammar=grammar, logit_bias=((3, -100.0), (9, 2.5))))
    (frame,) = FrameEncoder().encode(fits)
    assert FrameDecoder(limits).receive(frame) == fits
    with pytest.raises(RemoteProtocolError) as refused:
        FrameDecoder(attrs.evolve(limits, max_grammar_bytes=len(grammar) - 1)).receive(frame)
    assert refused.value.code == StatusCode.RESOURCE_EXHAUSTED and "grammar" in str(refused.value)


def test_a_plan_across_devices_names_every_hops_recipe_and_the_session_names_them_together() -> None:
    cpu, gpu = b"cpu-rcp1", b"gpu-rcp1"
    plain = h.open_route()
    mixed_hops = tuple(attrs.evolve(hop, recipe_fingerprint=r) for hop, r in zip(plain.hops, (cpu, gpu), strict=True))
    ident = attrs.evolve(h.identity(), recipe_fingerprint=route_recipe([cpu, gpu]))
    mixed = attrs.evolve(h.open_route(ident), hops=mixed_hops)
    (frame,) = FrameEncoder().encode(mixed)
    assert FrameDecoder().receive(frame) == mixed
    # one recipe on every hop is that recipe; the order of a mix counts
    assert route_recipe([cpu, cpu]) == cpu and route_recipe([cpu, gpu]) != route_recipe([gpu, cpu])
    assert len(route_recipe([cpu, gpu])) == 8
    too_long = b"x" * (Limits().max_string_bytes + 1)
    for bad, code, says in (
        (
            attrs.evolve(mixed, hops=(mixed_hops[0], plain.hops[1])),
            StatusCode.INVALID_ARGUMENT,
            "some hops, not of all",
        ),
        (attrs.evolve(mixed, header=h.header(0, Phase.PREFILL)), StatusCode.FAILED_PRECONDITION, "another recipe"),
        (
            attrs.evolve(
                mixed,
                hops=(
                    mixed_hops[0],
                    attrs.evolve(mixed_hops[1], recipe_fingerprint=too_long),
                ),
            ),
            StatusCode.INVALID_ARGUMENT,
            "too long",
        ),
    ):
        (frame,) = FrameEncoder().encode(bad)
        with pytest.raises(RemoteProtocolError) as refused:
            FrameDecoder().receive(frame)
        assert refused.value.code == code and says in str(refused.value)


def test_a_logit_bias_out_of_range_is_refused() -> None:
    bias = attrs.evolve(h.open_route(), sampling=Sampling(logit_bias=((3, 1e9),)))
    (frame,) = FrameEncoder().encode(bias)
    with pytest.raises(RemoteProtocolError) as refused:
        FrameDecoder().receive(frame)
    assert "logit_bias" in str(refused.value)


def test_lossy_encodings_refuse_non_finite_values() -> None:
    event = h.activations(encoding=Encoding.F16)
    bad = Activations(
        event.header, (NamedTensor("hidden_states", np.array([[np.nan, 1.0]], np.float32), Encoding.F16),)
    )
    with pytest.raises(LocalProtocolError):
        FrameEncoder().encode(bad)
    # an f32 NaN can be encoded but is refused on receipt: hidden states are finite
    nan32 = Activations(event.header, (NamedTensor("hidden_states", np.array([[np.inf, 1.0]], np.float32)),))
    (frame,) = FrameEncoder().encode(nan32)
    with pytest.raises(RemoteProtocolError, match="NaN or Inf"):
        FrameDecoder().receive(frame)


def test_a_window_crosses_the_seam_with_its_drafts_and_its_verdict() -> None:
    """Speculative decoding (1.6): drafts ride the Activations, the verdict the Tokens; both
    byte for byte as the generated code writes them."""
    window = Activations(h.header(4, Phase.DECODE, Span(9, 13)), h.activations(rows=4).tensors, (5, 6, 7))
    (frame,) = FrameEncoder().encode(window)
    assert frame == _reference_activations(window)
    decoded = FrameDecoder().receive(frame)
    assert isinstance(decoded, Activations) and decoded.draft == (5, 6, 7) and decoded.header == window.header
    verdict = Tokens(h.header(5, Phase.DECODE, Span(10, 13)), (5, 6, 8), window=8, drafted=3, accepted=2)
    (frame,) = FrameEncoder().encode(verdict)
    body = pb.Tokens(token_ids=[5, 6, 8], window=8, drafted=3, accepted=2)
    assert frame == bytes(pb.Frame(header=h.reference_header(verdict.header, crc32c.crc32c(bytes(body))), tokens=body))
    assert FrameDecoder().receive(frame) == verdict
    opening = attrs.evolve(h.open_route(), speculate=8)
    (frame,) = FrameEncoder().encode(opening)
    assert FrameDecoder().receive(frame) == opening


def test_a_window_that_follows_another_and_the_routes_bound_on_them_cross_the_seam() -> None:
    """Windows in flight (1.7): the flag rides the Activations (every chunk), the bound the
    Tokens; byte for byte as the generated code writes them."""
    follows = Activations(h.header(4, Phase.DECODE, Span(9, 12)), h.activations(rows=3).tensors, (5, 6, 7), True)
    (frame,) = FrameEncoder().encode(follows)
    assert frame == _reference_activations(follows)
    decoded = FrameDecoder().receive(frame)
    assert isinstance(decoded, Activations) and decoded.follows and decoded.draft == (5, 6, 7)
    limits = Limits(max_frame_bytes=4096)  # chunked: each frame says it, and they must agree
    big = attrs.evolve(follows, tensors=h.activations(rows=3, width=1024).tensors)
    frames = FrameEncoder(limits).encode(big)
    assert len(frames) > 1
    decoder = FrameDecoder(limits)
    results = [decoder.receive(f) for f in frames]
    assert isinstance(results[-1], Activations) and results[-1].follows
    bound = Tokens(h.header(5, Phase.DECODE, Span(10, 11)), (5,), window=8, ahead=3)
    (frame,) = FrameEncoder().encode(bound)
    body = pb.Tokens(token_ids=[5], window=8, ahead=3)
    assert frame == bytes(pb.Frame(header=h.reference_header(bound.header, crc32c.crc32c(bytes(body))), tokens=body))
    assert FrameDecoder().receive(frame) == bound


@pytest.mark.parametrize(
    ("event", "problem"),
    [
        (attrs.evolve(h.open_route(), speculate=65), "at most 64"),
        (attrs.evolve(h.open_route(), speculate=4, audit=True, prompt_length=2, audit_from=1), "drafts nothing"),
        (Tokens(h.header(5), (1, 2, 3), drafted=4, accepted=1), "kept 1 of 4"),
        (Tokens(h.header(5), (1,), drafted=2, accepted=3), "kept 3 of 2"),
        (Tokens(h.header(5), (1,), window=1 << 20), "at most 64"),
        (Tokens(h.header(5), (1,), window=8, ahead=1 << 20), "at most 8 windows"),
    ],
    ids=[
        "speculate-huge",
        "audit-speculates",
        "more-tokens-than-kept",
        "kept-more-than-drafted",
        "window-huge",
        "ahead-huge",
    ],
)
def test_a_window_beyond_its_bounds_is_a_typed_refusal(event: object, problem: str) -> None:
    (frame,) = FrameEncoder().encode(event)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError) as refused:
        FrameDecoder().receive(frame)
    assert problem in str(refused.value)


def test_too_many_drafts_are_refused_before_they_are_held() -> None:
    limits = Limits(max_window=4)
    window = Activations(h.header(4, Phase.DECODE, Span(9, 15)), h.activations(rows=6).tensors, (1, 2, 3, 4, 5))
    with pytest.raises(LocalProtocolError):
        FrameEncoder(limits).encode(window)
    (frame,) = FrameEncoder().encode(window)
    with pytest.raises(RemoteProtocolError) as refused:
        FrameDecoder(limits).receive(frame)
    assert "drafted tokens" in str(refused.value)
