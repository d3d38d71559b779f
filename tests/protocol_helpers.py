"""Builders of valid protocol events, and the betterproto2 reference encoding of them."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from protocol import (
    SCHEMA_MAJOR,
    Activations,
    Direction,
    Encoding,
    Header,
    Hop,
    Identity,
    NamedTensor,
    OpenRoute,
    Phase,
    RemoteProtocolError,
    Sampling,
    SeamEndpoint,
    Span,
    Tokens,
)
from protocol._generated.noderuntime.seam import v1 as pb

ARTIFACT = bytes(range(32))
RECIPE = b"recipe01"


def identity(shard: Span = Span(0, 15), epoch: int = 1, session: bytes | None = None) -> Identity:
    return Identity("req-1", session or bytes(16), epoch, ARTIFACT, RECIPE, shard)


def header(
    step: int = 0, phase: Phase = Phase.DECODE, positions: Span = Span(), cache: int = 0, ident: Identity | None = None
) -> Header:
    return Header(ident or identity(), phase, step, positions, cache)


def activations(
    rows: int = 1,
    width: int = 576,
    step: int = 1,
    start: int = 0,
    encoding: Encoding = Encoding.F32,
    seed: int = 0,
    ident: Identity | None = None,
) -> Activations:
    array = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    h = header(step, Phase.PREFILL if rows > 1 else Phase.DECODE, Span(start, start + rows), start, ident)
    return Activations(h, (NamedTensor("hidden_states", array, encoding),))


def open_route(ident: Identity | None = None) -> OpenRoute:
    hops = (Hop(b"\x01" * 32, Span(0, 15), "127.0.0.1:7001"), Hop(b"\x02" * 32, Span(15, 30), "", "ws://relay:1"))
    return OpenRoute(
        header(0, Phase.PREFILL, ident=ident),
        hops,
        Sampling(temperature=0.5, top_k=40, seed=9),
        (1, 2, 3, 400),
        32,
        (2,),
        1_900_000_000_000,
        b"ticket",
    )


def tokens(step: int = 1, ident: Identity | None = None) -> Tokens:
    return Tokens(header(step, Phase.DECODE, Span(10, 11), ident=ident), (42,), False, "")


def older_peers_refusal(sampling: Sampling, minor: int) -> RemoteProtocolError | None:
    """What a head says of the first Tokens of a tail speaking schema ``SCHEMA_MAJOR.minor``, in a session
    opened with ``sampling``: its refusal, or None where it takes them."""
    upstream = SeamEndpoint(identity(Span(0, 15)), Direction.DOWNSTREAM, peer_shard=Span(15, 30))
    upstream.send(OpenRoute(upstream.header(Phase.PREFILL), (), sampling, (1, 2), 4, (), 0, b""))
    reply = Tokens(Header(identity(Span(15, 30)), Phase.DECODE, 0, Span(), 0, SCHEMA_MAJOR, minor), (7,))
    try:
        taken = upstream.receive(reply)
    except RemoteProtocolError as refusal:
        return refusal
    assert taken is reply
    return None


def reference_header(h: Header, crc: int) -> Any:
    i = h.identity
    return pb.Header(
        schema_major=h.schema_major,
        schema_minor=h.schema_minor,
        request_id=i.request_id,
        session_id=i.session_id,
        epoch=i.epoch,
        artifact_fingerprint=i.artifact_fingerprint,
        recipe_fingerprint=i.recipe_fingerprint,
        shard=pb.Span(i.shard.start, i.shard.end),
        phase=pb.Phase(int(h.phase)),
        positions=pb.Span(h.positions.start, h.positions.end),
        step_id=h.step_id,
        cache_expectation=h.cache_expectation,
        payload_crc32c=crc,
    )


def random_bytes(n: int) -> bytes:
    return os.urandom(n)
