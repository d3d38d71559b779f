"""The seam state machine: one transition table, identity, step order, cache expectation."""

from __future__ import annotations

import attrs
import pytest

from protocol import (
    Activations,
    Cancel,
    Credit,
    Direction,
    Error,
    LocalProtocolError,
    Phase,
    Prefix,
    Release,
    RemoteProtocolError,
    SeamEndpoint,
    Span,
    State,
    StatusCode,
    Tokens,
    Usage,
    error_event,
)
from protocol.seam import TRANSITIONS

from . import protocol_helpers as h

HEAD = h.identity(Span(0, 15))
TAIL = h.identity(Span(15, 30))


def pair() -> tuple[SeamEndpoint, SeamEndpoint]:
    """The head's endpoint toward the tail, and the tail's toward the head."""
    return (
        SeamEndpoint(HEAD, Direction.DOWNSTREAM, peer_shard=TAIL.shard),
        SeamEndpoint(TAIL, Direction.UPSTREAM, peer_shard=HEAD.shard),
    )


def test_a_whole_session_passes() -> None:
    head, tail = pair()
    open_route = attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL))
    assert tail.receive(head.send(open_route)) is open_route
    step = Activations(head.header(Phase.PREFILL, Span(0, 5)), h.activations(rows=5).tensors)
    assert tail.receive(head.send(step)) is step
    assert tail.kv_length == head.kv_length == 5
    for position in range(5, 8):
        token = Tokens(tail.header(Phase.DECODE, Span(position, position + 1)), (42,))
        assert head.receive(tail.send(token)) is token
        step = Activations(head.header(Phase.DECODE, Span(position, position + 1)), h.activations().tensors)
        assert tail.receive(head.send(step)) is step
    release = Release(head.header(Phase.RELEASE), "stop")
    tail.receive(head.send(release))
    usage = Usage(tail.header(Phase.RELEASE), ())
    head.receive(tail.send(usage))
    assert head.closed and tail.closed


def test_every_transition_outside_the_table_is_an_error() -> None:
    events = {
        "OpenRoute": lambda hd: attrs.evolve(h.open_route(HEAD), header=hd),
        "Activations": lambda hd: Activations(attrs.evolve(hd, positions=Span(0, 1)), h.activations().tensors),
        "Tokens": lambda hd: Tokens(hd, (1,)),
        "Release": lambda hd: Release(hd),
        "Cancel": lambda hd: Cancel(hd),
        "Error": lambda hd: Error(hd, StatusCode.INTERNAL, "x"),
        "Credit": lambda hd: Credit(hd, 1),
        "Usage": lambda hd: Usage(hd, ()),
        "Prefix": lambda hd: Prefix(hd, 0),
    }
    for direction, table in TRANSITIONS.items():
        for state in State:
            for name, make in events.items():
                receiver = SeamEndpoint(
                    HEAD, Direction.UPSTREAM if direction is Direction.DOWNSTREAM else Direction.DOWNSTREAM
                )
                receiver._in.state = state
                receiver._in.last_step = 0 if state is not State.IDLE else -1
                receiver._offer = 16  # a Prefix answers an offer
                event = make(h.header(receiver._in.last_step + 1, ident=HEAD))
                allowed = (state, type(event)) in table
                if allowed:
                    assert receiver.receive(event) is event, (direction, state, name)
                    assert receiver.inbound_state is table[(state, type(event))]
                else:
                    with pytest.raises(RemoteProtocolError) as info:
                        receiver.receive(event)
                    assert info.value.code == StatusCode.FAILED_PRECONDITION, (direction, state, name)


def test_a_prefix_comes_first_within_the_offer_and_sets_where_activations_start() -> None:
    head, tail = pair()
    offered = attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL), prefix_offer=32)
    tail.receive(head.send(offered))
    for positions in (33, -1):
        with pytest.raises(LocalProtocolError, match="offered"):
            tail.send(Prefix(tail.header(Phase.PREFILL), positions))
    prefix = Prefix(tail.header(Phase.PREFILL), 16)
    assert head.receive(tail.send(prefix)) is prefix
    # the session's Activations start where the prefix ends, on both sides
    with pytest.raises(LocalProtocolError, match="continue from 16"):
        head.send(Activations(head.header(Phase.PREFILL, Span(0, 4)), h.activations(rows=4).tensors))
    step = Activations(head.header(Phase.PREFILL, Span(16, 20)), h.activations(rows=4).tensors)
    assert tail.receive(head.send(step)) is step
    # only first: a second Prefix is out of order
    with pytest.raises(LocalProtocolError):
        tail.send(Prefix(tail.header(Phase.PREFILL), 16))


def test_a_prefix_nobody_offered_or_beyond_the_offer_is_refused() -> None:
    head, tail = pair()
    tail.receive(head.send(attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL))))
    with pytest.raises(RemoteProtocolError, match="0 were offered") as info:
        head.receive(Prefix(tail.header(Phase.PREFILL), 0))
    assert info.value.code == StatusCode.FAILED_PRECONDITION
    head, tail = pair()
    tail.receive(head.send(attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL), prefix_offer=8)))
    with pytest.raises(RemoteProtocolError, match="9 positions where 8"):
        head.receive(Prefix(tail.header(Phase.PREFILL), 9))


def test_duplicate_of_last_step_is_ignored_gap_and_regression_are_errors() -> None:
    head, tail = pair()
    open_route = attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL))
    tail.receive(head.send(open_route))
    assert tail.receive(open_route) is None  # a retry
    step1 = Activations(head.header(Phase.PREFILL, Span(0, 2)), h.activations(rows=2).tensors)
    head.send(step1)
    tail.receive(step1)
    assert tail.receive(step1) is None
    with pytest.raises(RemoteProtocolError, match="must increase") as info:
        tail.receive(open_route)
    assert info.value.code == StatusCode.OUT_OF_RANGE
    gap = Activations(attrs.evolve(head.header(Phase.DECODE, Span(2, 3)), step_id=5), h.activations().tensors)
    with pytest.raises(RemoteProtocolError, match="missing"):
        tail.receive(gap)


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"epoch": 2}, StatusCode.ABORTED),
        ({"artifact_fingerprint": b"\x09" * 32}, StatusCode.FAILED_PRECONDITION),
        ({"recipe_fingerprint": b"other"}, StatusCode.FAILED_PRECONDITION),
        ({"session_id": b"\x01" * 16}, StatusCode.INVALID_ARGUMENT),
        ({"shard": Span(0, 10)}, StatusCode.FAILED_PRECONDITION),
    ],
)
def test_wrong_identity_is_refused(change: dict[str, object], code: StatusCode) -> None:
    _, tail = pair()
    liar = attrs.evolve(HEAD, **change)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError) as info:
        tail.receive(attrs.evolve(h.open_route(liar), header=h.header(0, Phase.PREFILL, ident=liar)))
    assert info.value.code == code


def test_unknown_schema_major_is_unimplemented() -> None:
    _, tail = pair()
    event = attrs.evolve(
        h.open_route(HEAD), header=attrs.evolve(h.header(0, Phase.PREFILL, ident=HEAD), schema_major=2)
    )
    with pytest.raises(RemoteProtocolError) as info:
        tail.receive(event)
    assert info.value.code == StatusCode.UNIMPLEMENTED


def test_newer_minor_version_is_accepted() -> None:
    _, tail = pair()
    event = attrs.evolve(
        h.open_route(HEAD), header=attrs.evolve(h.header(0, Phase.PREFILL, ident=HEAD), schema_minor=7)
    )
    assert tail.receive(event) is event


def test_cache_expectation_mismatch_is_refused() -> None:
    head, tail = pair()
    tail.receive(head.send(attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL))))
    skewed = Activations(
        attrs.evolve(head.header(Phase.PREFILL, Span(0, 3)), cache_expectation=7), h.activations(rows=3).tensors
    )
    with pytest.raises(RemoteProtocolError, match="cache expectation 7") as info:
        tail.receive(skewed)
    assert info.value.code == StatusCode.FAILED_PRECONDITION
    jumped = Activations(head.header(Phase.PREFILL, Span(4, 6)), h.activations(rows=2).tensors)
    with pytest.raises(RemoteProtocolError, match="do not continue"):
        tail.receive(jumped)


def test_local_mistakes_are_local_errors() -> None:
    head, _ = pair()
    with pytest.raises(LocalProtocolError, match="not allowed"):
        head.send(Activations(head.header(Phase.PREFILL, Span(0, 1)), h.activations().tensors))
    head.send(attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL)))
    with pytest.raises(LocalProtocolError, match="step 7 sent after step 0"):
        head.send(Release(attrs.evolve(head.header(Phase.RELEASE), step_id=7)))


def test_error_event_closes_the_peer() -> None:
    head, tail = pair()
    tail.receive(head.send(attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL))))
    failure = RemoteProtocolError("bad", StatusCode.DATA_LOSS)
    event = error_event(tail, failure, b"\x05" * 32)
    assert head.receive(tail.send(event)) is event
    assert event.code == StatusCode.DATA_LOSS and head.inbound_state is State.CLOSED


def _decoding(head: SeamEndpoint, tail: SeamEndpoint, prompt: int = 5) -> None:
    open_route = attrs.evolve(h.open_route(HEAD), header=head.header(Phase.PREFILL), speculate=4)
    tail.receive(head.send(open_route))
    tail.receive(
        head.send(Activations(head.header(Phase.PREFILL, Span(0, prompt)), h.activations(rows=prompt).tensors))
    )
    head.receive(tail.send(Tokens(tail.header(Phase.DECODE, Span(prompt, prompt + 1)), (42,))))


def test_a_windows_tokens_tell_both_ends_where_the_next_step_starts() -> None:
    """A window of rows 5..9 whose tail kept one draft: tokens for 6 and 7, the next step at 7."""
    head, tail = pair()
    _decoding(head, tail)
    window = Activations(head.header(Phase.DECODE, Span(5, 10)), h.activations(rows=5).tensors, (1, 2, 3, 4))
    tail.receive(head.send(window))
    assert head.kv_length == tail.kv_length == 10 and head.final == tail.final == 6
    head.receive(tail.send(Tokens(tail.header(Phase.DECODE, Span(6, 8)), (1, 9), drafted=4, accepted=1)))
    assert head.final == tail.final == 7
    step = Activations(head.header(Phase.DECODE, Span(7, 8)), h.activations().tensors)
    assert step.header.cache_expectation == 7  # a step that goes back expects its start
    assert tail.receive(head.send(step)) is step
    assert head.kv_length == tail.kv_length == head.final == tail.final == 8


def test_tokens_cannot_take_back_more_than_the_last_windows_drafts() -> None:
    """A tail that names an earlier end than its window's first row moves nothing: the rows
    before a window were kept by earlier tokens, and stay so."""
    head, tail = pair()
    _decoding(head, tail)
    window = Activations(head.header(Phase.DECODE, Span(5, 8)), h.activations(rows=3).tensors, (1, 2))
    tail.receive(head.send(window))
    head.receive(tail.send(Tokens(tail.header(Phase.DECODE, Span(2, 3)), (1,))))  # claims position 2
    assert head.kv_length == tail.kv_length == 8 and head.final == tail.final == 6
    with pytest.raises(LocalProtocolError):  # nor may the head go back before the window's first row
        head.send(Activations(head.header(Phase.DECODE, Span(5, 6)), h.activations().tensors))
    # and a plain step's tokens never move it
    head2, tail2 = pair()
    _decoding(head2, tail2)
    tail2.receive(head2.send(Activations(head2.header(Phase.DECODE, Span(5, 6)), h.activations().tensors)))
    head2.receive(tail2.send(Tokens(tail2.header(Phase.DECODE, Span(3, 4)), (1,))))
    assert head2.kv_length == 6
    with pytest.raises(RemoteProtocolError) as refused:  # a head that went back anyway is refused
        tail2.receive(attrs.evolve(
            Activations(head2.header(Phase.DECODE, Span(6, 7)), h.activations().tensors),
            header=attrs.evolve(head2.header(Phase.DECODE, Span(3, 4)), cache_expectation=3),
        ))  # fmt: skip
    assert refused.value.code == StatusCode.FAILED_PRECONDITION


def _windows_in_flight(head: SeamEndpoint) -> tuple[Activations, Activations]:
    """A window of rows 5..8 (two drafts), and one that follows it at 8..10 (a guess, a draft)."""
    first = Activations(head.header(Phase.DECODE, Span(5, 8)), h.activations(rows=3).tensors, (1, 2))
    head.send(first)
    follows = Activations(head.header(Phase.DECODE, Span(8, 10)), h.activations(rows=2).tensors, (3, 4), True)
    head.send(follows)
    return first, follows


@pytest.mark.parametrize("tokens_first", [False, True], ids=["windows-then-tokens", "tokens-between"])
def test_windows_in_flight_agree_at_both_ends_whichever_way_the_tokens_cross_them(tokens_first: bool) -> None:
    """The tail's tokens for the first window may reach the head's end after it sent the second
    and the tail's end before that second arrives: both ends still hold the same KV, and the
    step that goes back after a rejection is accepted by both."""
    head, tail = pair()
    _decoding(head, tail)
    first, follows = _windows_in_flight(head)
    tail.receive(first)
    kept_one = Tokens(tail.header(Phase.DECODE, Span(6, 8)), (1, 7), drafted=2, accepted=1)
    if tokens_first:
        tail.send(kept_one)
        tail.receive(follows)
    else:
        tail.receive(follows)
        tail.send(kept_one)
    head.receive(kept_one)
    assert head.kv_length == tail.kv_length == 10 and head.final == tail.final == 7
    back = Activations(head.header(Phase.DECODE, Span(7, 8)), h.activations().tensors)
    assert tail.receive(head.send(back)) is back


def _both_in_flight() -> tuple[SeamEndpoint, SeamEndpoint]:
    head, tail = pair()
    _decoding(head, tail)
    for window in _windows_in_flight(head):
        tail.receive(window)
    return head, tail


def test_a_window_that_follows_makes_nothing_final_until_its_tokens() -> None:
    head, tail = _both_in_flight()
    assert head.final == tail.final == 6  # the first window's first row
    all_kept = Tokens(tail.header(Phase.DECODE, Span(6, 9)), (1, 2, 3), drafted=2, accepted=2)
    head.receive(tail.send(all_kept))
    assert head.final == tail.final == 8
    # the guess was the draw: the second window was live, and its tokens end further on
    head.receive(tail.send(Tokens(tail.header(Phase.DECODE, Span(9, 11)), (4, 5), drafted=2, accepted=2)))
    assert head.final == tail.final == 10
    step = Activations(head.header(Phase.DECODE, Span(10, 11)), h.activations().tensors)
    assert tail.receive(head.send(step)) is step


def test_a_step_may_not_go_back_past_what_is_final_nor_skip_ahead() -> None:
    head, tail = _both_in_flight()
    for span in (Span(5, 6), Span(11, 12)):  # before the first window's first row; beyond the KV
        forged = Activations(attrs.evolve(head.header(Phase.DECODE, span), cache_expectation=span.start),
                             h.activations().tensors)  # fmt: skip
        with pytest.raises(RemoteProtocolError) as refused:
            tail.receive(forged)
        assert refused.value.code == StatusCode.FAILED_PRECONDITION
