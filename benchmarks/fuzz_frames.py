"""Fuzz the frame decoder (random, truncated, mutated and lying frames) and the relayed seam's channel.

    python -m benchmarks.fuzz_frames [--quick] [--inputs N] [--out PATH]

Every input goes to a fresh decoder (and, in a second pass, mutated sequences go to
one decoder so reassembly state is exercised). The report counts inputs tried,
events decoded, rejections by error type and status code, and crashes: any
exception that is not a ProtocolError. The run fails (exit 1) on any crash.

The channel of relayed seams (:mod:`protocol.channel`) gets a fifth as many inputs:
each of its three handshake messages and its sealed messages, random or mutated from
valid ones, to a side waiting for exactly that (a changed first message, which no key
covers yet, then has its answer read by the dialer). Anything but a ChannelError (or a
ChannelClosed, for a close record) is a crash, and a changed message that still
passes is a defect: the channel exists to refuse it.
"""

from __future__ import annotations

import collections
import os
import random
import time
import traceback
from typing import Any

import attrs
import numpy as np

from benchmarks import _common

NAME = "fuzz_frames"


def _seeds() -> list[bytes]:
    from protocol import (
        Activations,
        Cancel,
        Credit,
        Encoding,
        Error,
        FrameEncoder,
        Header,
        Hop,
        Identity,
        Limits,
        NamedTensor,
        OpenRoute,
        Phase,
        Release,
        Sampling,
        Span,
        StatusCode,
        TokenLogprob,
        Tokens,
        Usage,
        UsageRecord,
        route_recipe,
    )

    ident = Identity("req", os.urandom(16), 3, os.urandom(32), os.urandom(8), Span(0, 15))

    def header(step: int, phase: Phase = Phase.DECODE, positions: Span = Span()) -> Header:
        return Header(ident, phase, step, positions, positions.start)

    enc = FrameEncoder(Limits(max_frame_bytes=64 << 10))
    rng = np.random.default_rng(0)
    frames = []
    hops = (Hop(b"a" * 32, Span(0, 15), "10.0.0.1:7000"), Hop(b"b" * 32, Span(15, 30), "", "ws://relay/x"))
    frames += enc.encode(
        OpenRoute(
            header(0, Phase.PREFILL), hops, Sampling(0.5, 40, 0.9, 0.05, 7), (1, 2, 3), 16, (2,), 123456, b"t" * 96
        )
    )
    # a plan across devices: every hop names its recipe, the session their digest
    recipes = (os.urandom(8), os.urandom(8))
    mixed = tuple(attrs.evolve(hop, recipe_fingerprint=r) for hop, r in zip(hops, recipes, strict=True))
    across = Header(attrs.evolve(ident, recipe_fingerprint=route_recipe(recipes)), Phase.PREFILL, 0, Span(), 0)
    frames += enc.encode(OpenRoute(across, mixed, Sampling(), (1, 2, 3), 16))
    for encoding in Encoding:
        rows = int(rng.integers(1, 4))
        array = rng.standard_normal((rows, 96)).astype(np.float32)
        frames += enc.encode(
            Activations(header(1, Phase.PREFILL, Span(0, rows)), (NamedTensor("hidden_states", array, encoding),))
        )
    big = rng.standard_normal((40, 576)).astype(np.float32)
    frames += enc.encode(Activations(header(2, Phase.PREFILL, Span(0, 40)), (NamedTensor("hidden_states", big),)))
    frames += enc.encode(Tokens(header(3), (42, 300, 70000), True, "stop"))
    best = ((42, -0.25), (7, -2.0), (300, -3.5))
    logprobs = (TokenLogprob(42, -0.25, best), TokenLogprob(300, -3.5, best), TokenLogprob(70000, -9.0))
    frames += enc.encode(Tokens(header(3), (42, 300, 70000), False, "", logprobs, (TokenLogprob(5, -1.0, best),)))
    sampling = Sampling(0.0, grammar='root ::= "a"', logit_bias=((3, -100.0),), logprobs=True, top_logprobs=5)
    frames += enc.encode(OpenRoute(header(0, Phase.PREFILL), hops, sampling, (1, 2, 3), 16))
    frames += enc.encode(Release(header(4, Phase.RELEASE), "done"))
    frames += enc.encode(Cancel(header(4, Phase.CANCEL), "gone"))
    frames += enc.encode(Error(header(4, Phase.CANCEL), StatusCode.UNAVAILABLE, "down", b"n" * 32))
    frames += enc.encode(Credit(header(5), 8))
    frames += enc.encode(Usage(header(6), (UsageRecord(b'{"a":1}', b"n" * 32, b"s" * 64),)))
    return frames


def _mutate(rng: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(6)
        pos = rng.randrange(max(1, len(buf)))
        if op == 0 and buf:
            buf[pos] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[pos] = rng.choice((0, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A, 0x7A))
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 12))
        elif op == 3:
            del buf[pos : pos + rng.randint(1, 16)]
        elif op == 4:
            other = rng.choice(seeds)
            buf[pos:] = other[rng.randrange(len(other)) :]
        else:  # a varint that claims a huge length
            buf[pos:pos] = bytes([0xFF] * rng.randint(1, 9)) + b"\x01"
    return bytes(buf)


def _lying(rng: random.Random) -> bytes:
    import crc32c

    from protocol._generated.noderuntime.seam import v1 as pb

    tensor = pb.Tensor(
        name=rng.choice(["hidden_states", "", "x" * 300]),
        shape=[rng.choice([0, 1, 2, 576, 2**31, 2**32 - 1]) for _ in range(rng.randint(0, 6))],
        encoding=rng.randint(0, 6),  # type: ignore[arg-type]  # out-of-range enums on purpose
        byte_order=rng.randint(0, 2),  # type: ignore[arg-type]
        total_bytes=rng.choice([0, 1, 2304, 2**40, 2**64 - 1]),
        offset=rng.choice([0, 1, 2**63]),
        chunk_index=rng.randint(0, 3),
        chunk_count=rng.choice([0, 1, 2, 10**6]),
        payload=rng.randbytes(rng.choice([0, 16, 2304])),
    )
    body = pb.Activations(tensors=[tensor], tensor_count=rng.randint(0, 10))
    header = pb.Header(schema_major=1, step_id=1, payload_crc32c=crc32c.crc32c(bytes(body)))
    return bytes(pb.Frame(header=header, activations=body))


def _fuzz_channel(rng: random.Random, count: int) -> dict[str, Any]:
    """The relayed seam's handshake and record layer, each side fed what it waits for, broken."""
    from noderuntime.access.identity import Identity, channel_keys, verify
    from protocol.channel import (
        AcceptorHandshake,
        Binding,
        ChannelClosed,
        ChannelError,
        DialerHandshake,
        SealedChannel,
    )
    from protocol.errors import StatusCode

    dialer_keys, acceptor_keys = channel_keys(Identity.generate()), channel_keys(Identity.generate())
    binding = Binding(os.urandom(16), 0, dialer_keys.node_id, acceptor_keys.node_id)
    seeds = _seeds()
    outcomes: collections.Counter[str] = collections.Counter()
    crashes: list[dict[str, Any]] = []

    def fresh() -> tuple[DialerHandshake, AcceptorHandshake, bytes, bytes, bytes]:
        dial, accept = DialerHandshake(dialer_keys, binding, verify), AcceptorHandshake(acceptor_keys, verify)
        first = dial.first()
        second = accept.read_first(first)
        return dial, accept, first, second, dial.read_second(second)

    def broken(valid: bytes) -> bytes:
        if rng.random() < 0.2:
            return rng.randbytes(rng.choice([0, 1, 31, 32, 100, len(valid), 70000]))
        return _mutate(rng, valid, seeds)

    def sealed_message(channel: SealedChannel) -> bytes:
        choice = rng.randrange(3)
        if choice == 0:
            return channel.seal(rng.choice(seeds))
        if choice == 1:
            return channel.seal(rng.randbytes(rng.choice([0, 65518, 65519, 140000])))
        return channel.seal_close(StatusCode.coerce(rng.randrange(17)), "bye")

    for i in range(count):
        stage = ("first", "second", "third", "sealed")[i % 4]
        valid = b""
        try:
            dial, accept, first, second, third = fresh()
            if stage == "first":
                # the first message carries no key yet: a change passes here and must fail the
                # dialer's check of the answer it gets
                valid, data = first, broken(first)
                answer = AcceptorHandshake(acceptor_keys, verify).read_first(data)
                if data != valid:
                    dial.read_second(answer)
            elif stage == "second":
                again = DialerHandshake(dialer_keys, binding, verify)
                valid = second = AcceptorHandshake(acceptor_keys, verify).read_first(again.first())
                data = broken(second)
                again.read_second(data)
            elif stage == "third":
                valid, data = third, broken(third)
                accept.read_third(data)
            else:
                receiving = accept.read_third(third)
                valid = sealed_message(dial.channel())
                data = broken(valid)
                receiving.open(data)
            # a message the mutation left as it was is no finding; a changed one that passed is
            outcomes["accepted unchanged" if data == valid else "ACCEPTED CHANGED"] += 1
        except ChannelError as exc:
            outcomes[f"ChannelError:{exc.code.name}"] += 1
        except ChannelClosed:
            outcomes["ChannelClosed" if data == valid else "ACCEPTED CHANGED"] += 1
        except Exception as exc:  # noqa: BLE001 - counting crashes is the point
            outcomes["CRASH"] += 1
            if len(crashes) < 20:
                crashes.append({"stage": stage, "error": repr(exc), "trace": traceback.format_exc()})
    return {
        "inputs": count,
        "outcomes": dict(sorted(outcomes.items())),
        "crashes": outcomes["CRASH"],
        "defects": outcomes["CRASH"] + outcomes["ACCEPTED CHANGED"],
        "crash_samples": crashes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = _common.parser(NAME, __doc__ or "")
    parser.add_argument("--inputs", type=int, default=None, help="inputs to try (default 120000, quick 5000)")
    args = parser.parse_args(argv)
    from protocol import FrameDecoder, Limits, ProtocolError

    total = args.inputs or (5000 if args.quick else 120_000)
    limits = Limits(max_frame_bytes=64 << 10, max_tensor_bytes=1 << 20, max_chunks=64)
    seeds = _seeds()
    rng = random.Random(20261130)
    outcomes: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    crashes: list[dict[str, Any]] = []
    unchecked_samples: list[str] = []
    started = time.perf_counter()
    sequence_decoder = FrameDecoder(limits)
    for i in range(total):
        kind = ("random", "truncated", "mutated", "lying", "sequence")[i % 5]
        if kind == "random":
            data = rng.randbytes(rng.randint(0, 2048))
        elif kind == "truncated":
            seed = rng.choice(seeds)
            data = seed[: rng.randrange(len(seed))]
        elif kind == "mutated":
            data = _mutate(rng, rng.choice(seeds), seeds)
        elif kind == "lying":
            data = _lying(rng)
        else:
            data = _mutate(rng, rng.choice(seeds), seeds) if rng.random() < 0.5 else rng.choice(seeds)
        kinds[kind] += 1
        decoder = sequence_decoder if kind == "sequence" else FrameDecoder(limits)
        try:
            event = decoder.receive(data)
            outcomes["decoded" if event is not None else "chunk_buffered"] += 1
        except ProtocolError as exc:
            # errors the codec's own checks did not name, but its last-resort translation caught
            unchecked = " (unchecked)" if exc.message.startswith("malformed frame:") else ""
            outcomes[f"{type(exc).__name__}:{exc.code.name}{unchecked}"] += 1
            if unchecked and len(unchecked_samples) < 10:
                unchecked_samples.append(exc.message)
        except Exception as exc:  # noqa: BLE001 - counting crashes is the point
            outcomes["CRASH"] += 1
            if len(crashes) < 20:
                crashes.append({"input_hex": data[:256].hex(), "error": repr(exc), "trace": traceback.format_exc()})
    seconds = time.perf_counter() - started
    channel_started = time.perf_counter()
    channel = _fuzz_channel(rng, max(40, total // 5))
    channel["seconds"] = time.perf_counter() - channel_started
    figures = {
        "inputs": total,
        "inputs_by_kind": dict(kinds),
        "outcomes": dict(sorted(outcomes.items())),
        "crashes": outcomes["CRASH"],
        # a crash, or a rejection only the codec's catch-all made: a check the codec lacks
        "defects": outcomes["CRASH"]
        + sum(n for k, n in outcomes.items() if k.endswith("(unchecked)"))
        + channel["defects"],
        "crash_samples": crashes,
        "unchecked_samples": unchecked_samples,
        "seconds": seconds,
        "inputs_per_second": total / seconds,
        "channel": channel,
        "limits": {
            "max_frame_bytes": limits.max_frame_bytes,
            "max_tensor_bytes": limits.max_tensor_bytes,
            "max_chunks": limits.max_chunks,
        },
    }
    path = _common.out_path(NAME, args)
    _common.write(path, NAME, args, {}, figures)
    print(_common.table(["outcome", "count"], sorted(outcomes.items(), key=lambda kv: -kv[1])))
    print("\nthe relayed seam's channel:")
    print(_common.table(["outcome", "count"], sorted(channel["outcomes"].items(), key=lambda kv: -kv[1])))
    defects = f"defects: {figures['defects']} ({outcomes['CRASH']} crashes)"
    print(f"\n{total} inputs in {seconds:.1f} s, {defects}\nwrote {path}")
    return 1 if figures["defects"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
