"""What a seam's transports cost apart from the engines: frame round trips over each transport,
opening a gRPC seam, and thread wake-ups (used by ``benchmarks.seams``)."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

from benchmarks import _common

DECODE_FRAME = 2442  # a decode step's frame on the demo model's seam
PREFILL_FRAME = 256 * 576 * 4 + 300  # a 256-token prefill chunk's
WAKE_IDLE = 0.003  # seconds a thread sleeps before it is woken: about one shard's decode tick
SWEEP_BYTES = 64 << 20  # about what one decode tick of a shard reads


async def echo(stream: Any) -> None:
    """Send back every frame until the seam ends."""
    from noderuntime.transport import TransportError

    with contextlib.suppress(TransportError):
        while True:
            await stream.send(await stream.receive())


async def round_trips(kind: str, size: int, count: int) -> list[float]:
    from noderuntime.testing.seams import seam

    payload = os.urandom(size)
    times = []
    async with seam(kind) as (client, server), trio.open_nursery() as nursery:
        nursery.start_soon(echo, server)
        for i in range(count + 5):
            started = time.perf_counter()
            await client.send(payload)
            await client.receive()
            if i >= 5:  # warm-up
                times.append(time.perf_counter() - started)
        nursery.cancel_scope.cancel()
    return times


async def seam_opens(count: int, tmp: Path, modes: tuple[str, ...] = ("plain", "tls")) -> dict[str, Any]:
    """Opening a gRPC seam and its first decode-size round trip: on a new connection, and on a spare.

    A connector keeps one connected spare per peer it recently opened a seam to: a
    session's first seam to a new peer pays the handshakes (with TLS: fetching the pinned
    certificate, then the connection's own), later ones start with their first frame.
    ``modes``: ``plain`` (h2c), ``sealed`` (the seam's own handshake inside the stream, as
    nodes open every seam), ``tls`` (pinned to a certificate).
    """
    from noderuntime.access.identity import Identity, channel_keys, self_signed
    from noderuntime.services.running import server_tls
    from noderuntime.transport.grpc import AsyncioThread, GrpcConnector, GrpcServer
    from noderuntime.transport.sealed import seal_acceptor, seal_dialer
    from protocol.channel import Binding

    payload = os.urandom(DECODE_FRAME)
    cert = self_signed(tmp / "seam-opens")
    near, far = channel_keys(Identity.generate()), channel_keys(Identity.generate())
    times: dict[str, list[float]] = {
        f"{mode}_{kind}": [] for mode in modes for kind in ("new_connection", "spare_connection")
    }

    runtime = AsyncioThread()
    async with trio.open_nursery() as nursery:
        servers = []
        try:
            for mode in modes:

                def accept(stream: Any, sealed: bool = mode == "sealed") -> None:
                    nursery.start_soon(echo, seal_acceptor(stream, far, "the dialer") if sealed else stream)

                server = GrpcServer(runtime, accept, max_frame_bytes=1 << 20)
                servers.append(server)
                tls = server_tls(cert.cert, cert.key) if mode == "tls" else None
                address = f"127.0.0.1:{await server.start('127.0.0.1', 0, tls)}"
                pin = cert.cert_sha256 if mode == "tls" else b""

                async def open_seam(
                    connector: GrpcConnector, mode: str = mode, address: str = address, pin: bytes = pin
                ) -> Any:
                    stream = await connector.open(address, tls_cert_sha256=pin)
                    if mode != "sealed":
                        return stream
                    binding = Binding(os.urandom(16), 0, near.node_id, far.node_id)
                    return await seal_dialer(stream, near, binding, "the echo")

                warm = GrpcConnector(runtime, max_frame_bytes=1 << 20)
                try:
                    await (await open_seam(warm)).aclose()
                    for _ in range(count):
                        for kind in ("new_connection", "spare_connection"):
                            fresh = kind == "new_connection"
                            connector = GrpcConnector(runtime, max_frame_bytes=1 << 20) if fresh else warm
                            await trio.sleep(0.05)  # the spare has connected
                            started = time.perf_counter()
                            stream = await open_seam(connector)
                            await stream.send(payload)
                            await stream.receive()
                            times[f"{mode}_{kind}"].append(time.perf_counter() - started)
                            await stream.aclose()
                            if fresh:
                                await connector.close()
                finally:
                    await warm.close()
        finally:
            for server in servers:
                await server.close()
            runtime.close()
            nursery.cancel_scope.cancel()
    return {f"{k}_p50_ms": statistics.median(v) * 1e3 for k, v in times.items()} | {
        f"{k}_p95_ms": _common.percentile(v, 95) * 1e3 for k, v in times.items()
    }


async def wake_ups(count: int) -> dict[str, Any]:
    """Round trips from a trio task to a sleeping engine thread and to the sleeping asyncio thread.

    Each is timed after an idle pause, and again after that pause plus a read of
    ``SWEEP_BYTES``, as a decode tick reads a shard's weights: the caches then hold
    weights, not the interpreter's code and data. The engine thread is what a node's
    batches go to; ``trio.to_thread``, what they went to before, is timed beside it.
    """
    from noderuntime.engine.thread import EngineThread
    from noderuntime.transport.grpc import AsyncioThread

    async def nothing() -> None:
        return None

    sweep = np.ones(SWEEP_BYTES // 8)
    kinds = ("worker", "worker_awake", "worker_cold", "to_thread", "asyncio", "asyncio_cold")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    runtime = AsyncioThread()
    engine_thread = EngineThread()
    try:
        for _ in range(count):
            for cold in (False, True):
                await trio.sleep(WAKE_IDLE)
                if cold:
                    sweep.sum()
                started = time.perf_counter()
                await engine_thread.run(int)
                times["worker_cold" if cold else "worker"].append(time.perf_counter() - started)
                if not cold:
                    started = time.perf_counter()
                    await engine_thread.run(int)  # the same thread again, still awake
                    times["worker_awake"].append(time.perf_counter() - started)
                    await trio.sleep(WAKE_IDLE)
                    started = time.perf_counter()
                    await trio.to_thread.run_sync(int)
                    times["to_thread"].append(time.perf_counter() - started)
                await trio.sleep(WAKE_IDLE)
                if cold:
                    sweep.sum()
                started = time.perf_counter()
                await runtime.call(nothing)
                times["asyncio_cold" if cold else "asyncio"].append(time.perf_counter() - started)
    finally:
        runtime.close()
        engine_thread.close()
    us = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {
        "idle_before_each_ms": WAKE_IDLE * 1e3,
        "sweep_bytes": SWEEP_BYTES,
        "worker_thread_round_trip_us": us["worker"],
        "worker_thread_round_trip_awake_us": us["worker_awake"],
        "worker_thread_round_trip_after_sweep_us": us["worker_cold"],
        "to_thread_round_trip_us": us["to_thread"],
        "asyncio_thread_round_trip_us": us["asyncio"],
        "asyncio_thread_round_trip_after_sweep_us": us["asyncio_cold"],
        # per decode token of a 2-shard gRPC route: each shard's tick goes to the engine
        # thread and back, and each seam direction crosses trio -> asyncio in the sender
        # and asyncio -> trio in the receiver
        "grpc_route_thread_round_trips_per_token": {"worker": 2, "asyncio": 2},
        "grpc_route_thread_wake_ups_ms_per_token": (2 * us["worker"] + 2 * us["asyncio"]) / 1e3,
        "grpc_route_thread_wake_ups_after_sweep_ms_per_token": (2 * us["worker_cold"] + 2 * us["asyncio_cold"]) / 1e3,
    }
