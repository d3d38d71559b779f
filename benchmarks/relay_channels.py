"""The end-to-end channel of relayed seams: Noise XX (what nodes run) against TLS 1.3, measured side by side.

    python -m benchmarks.relay_channels [--quick] [--out PATH]

Both channels authenticate each end by its node key and seal every frame; the relay
sees only ciphertext either way (``docs/security.md``). Which one nodes run was
chosen on these figures:

1. CPU per frame, both ends in this process with no network: sealing and opening
   frames of one decode token of SmolLM2 (2,442 B), of a 1B-class model (8 KiB) and of
   an 8B-class model (16 KiB), a 256-token prefill chunk of SmolLM2 (590 KB) and the
   largest frame (4 MiB); and the handshake, both sides' CPU.
2. Over a real relay on loopback (the project's relay, trio-websocket): a frame's
   round trip (decode-size and prefill-size) and a seam's opening (pairing, handshake
   and a first decode-size round trip), for the plaintext seam of old, Noise and TLS.

TLS 1.3 is stdlib ``ssl`` over memory BIOs, each node's certificate made from its
Ed25519 node key (so the pin is the node id); the dialer sends its certificate ahead
of its ClientHello, since Python's ``ssl`` can only require a client certificate it
already holds (no verify callback), and checks the acceptor's certificate after the
handshake. It lives here, not in the runtime: it is the measured alternative. Each
frame is length-prefixed inside the TLS byte stream and sent as one websocket message.
"""

from __future__ import annotations

import datetime
import functools
import os
import ssl
import statistics
import struct
import time
from collections.abc import Callable
from typing import Any

import trio

from benchmarks import _common

NAME = "relay_channels"
SIZES = {"decode_smollm2": 2442, "decode_1b": 8 << 10, "decode_8b": 16 << 10, "prefill_smollm2": 590_000}
LARGEST = 4 << 20
KINDS = ("plaintext", "noise", "tls")


# --- TLS 1.3, the measured alternative


@functools.cache
def _certificate(identity: Any) -> tuple[bytes, bytes]:
    """(certificate DER, key PEM): self-signed with the node's own Ed25519 key; made once an identity."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.node_id.hex()[:32])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(identity.private_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(identity.private_key, None)
    )
    key = identity.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.DER), key


def _context(server: bool, cert_der: bytes, key_pem: bytes, peer_der: bytes | None) -> ssl.SSLContext:
    import tempfile

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    if peer_der is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=peer_der)
    else:
        context.verify_mode = ssl.CERT_NONE  # the dialer checks the acceptor's key after the handshake
    with tempfile.NamedTemporaryFile("wb", suffix=".pem") as cert, tempfile.NamedTemporaryFile("wb") as key:
        cert.write(ssl.DER_cert_to_PEM_cert(cert_der).encode())
        key.write(key_pem)
        cert.flush()
        key.flush()
        context.load_cert_chain(cert.name, key.name)
    if server:
        context.num_tickets = 0
    return context


class TlsEnd:
    """One end of the TLS channel, sans-IO: handshake messages and sealed frames in and out."""

    def __init__(self, context: ssl.SSLContext, server: bool) -> None:
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.ssl = context.wrap_bio(self._in, self._out, server_side=server)
        self._plain = bytearray()

    def step(self, message: bytes = b"") -> tuple[bool, bytes]:
        """Feed a handshake message; (whether the handshake is done, what to send)."""
        if message:
            self._in.write(message)
        try:
            self.ssl.do_handshake()
            done = True
        except ssl.SSLWantReadError:
            done = False
        return done, self._out.read()

    def seal(self, frame: bytes) -> bytes:
        self.ssl.write(struct.pack(">I", len(frame)) + frame)
        return self._out.read()

    def open(self, message: bytes) -> list[bytes]:
        self._in.write(message)
        while True:
            try:
                self._plain += self.ssl.read(1 << 20)
            except ssl.SSLWantReadError:
                break
        frames = []
        while len(self._plain) >= 4:
            (size,) = struct.unpack(">I", self._plain[:4])
            if len(self._plain) < 4 + size:
                break
            frames.append(bytes(self._plain[4 : 4 + size]))
            del self._plain[: 4 + size]
        return frames


def _tls_pair(
    client_context: ssl.SSLContext, dialer_cert: bytes, acceptor_cert: bytes, acceptor_key: bytes, acceptor: bytes
) -> tuple[TlsEnd, TlsEnd]:
    """A full handshake in memory: the dialer's context made once, the acceptor's for this dialer's certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    client = TlsEnd(client_context, server=False)
    _, hello = client.step()
    # the first message: the dialer's certificate, then its ClientHello
    first = struct.pack(">H", len(dialer_cert)) + dialer_cert + hello
    (size,) = struct.unpack(">H", first[:2])
    server = TlsEnd(_context(True, acceptor_cert, acceptor_key, first[2 : 2 + size]), server=True)
    _, second = server.step(first[2 + size :])
    _, third = client.step(second)
    done, _ = server.step(third)
    assert done
    peer = x509.load_der_x509_certificate(client.ssl.getpeercert(binary_form=True) or b"")
    raw = peer.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert raw == acceptor  # the pin: the acceptor's certificate carries its node key
    return client, server


# --- 1. CPU per frame


def _per_frame(quick: bool) -> dict[str, Any]:
    from noderuntime.access.identity import Identity, channel_keys, verify
    from protocol.channel import AcceptorHandshake, Binding, DialerHandshake

    dialer, acceptor = Identity.generate(), Identity.generate()
    dialer_keys, acceptor_keys = channel_keys(dialer), channel_keys(acceptor)

    def noise_pair() -> tuple[Any, Any]:
        binding = Binding(os.urandom(16), 0, dialer.node_id, acceptor.node_id)
        dial, accept = DialerHandshake(dialer_keys, binding, verify), AcceptorHandshake(acceptor_keys, verify)
        theirs = accept.read_third(dial.read_second(accept.read_first(dial.first())))
        return dial.channel(), theirs

    # certificates are made once a process, as static keys are; the acceptor's context is
    # made for each dialer (it must hold the certificate it requires), the dialer's once
    dialer_cert, dialer_key = _certificate(dialer)
    acceptor_cert, acceptor_key = _certificate(acceptor)
    client_context = _context(False, dialer_cert, dialer_key, None)

    def tls_pair() -> tuple[Any, Any]:
        return _tls_pair(client_context, dialer_cert, acceptor_cert, acceptor_key, acceptor.node_id)

    out: dict[str, Any] = {"handshake_both_sides_ms": {}}
    for name, make in (("noise", noise_pair), ("tls", tls_pair)):
        times = []
        for _ in range(10 if quick else 50):
            started = time.perf_counter()
            make()
            times.append((time.perf_counter() - started) * 1e3)
        out["handshake_both_sides_ms"][name] = statistics.median(times)
    noise_send, noise_receive = noise_pair()
    tls_send, tls_receive = tls_pair()
    cases: dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], Any]]] = {
        "noise": (noise_send.seal, noise_receive.open),
        "tls": (tls_send.seal, tls_receive.open),
    }
    for label, size in (*SIZES.items(), ("largest_frame", LARGEST)):
        frame = os.urandom(size)
        repeats = max(5, (200 if quick else 2000) * 2442 // size)
        row: dict[str, Any] = {"frame_bytes": size}
        for name, (seal, opened) in cases.items():
            seal_times, open_times, wire = [], [], 0
            for _ in range(repeats):
                started = time.perf_counter()
                message = seal(frame)
                middle = time.perf_counter()
                opened(message)
                seal_times.append(middle - started)
                open_times.append(time.perf_counter() - middle)
                wire = len(message)
            row[name] = {
                "seal_us": statistics.median(seal_times) * 1e6,
                "open_us": statistics.median(open_times) * 1e6,
                "bytes_added": wire - size,
            }
        out[label] = row
    return out


# --- 2. over a real relay


async def _relay_pair(kind: str, nursery: trio.Nursery, url: str, issuer: Any) -> tuple[Any, Any]:
    """(dialer's stream, acceptor's stream) of one relayed seam of ``kind``."""
    from noderuntime.access.identity import Identity, channel_keys
    from noderuntime.access.tickets import issue
    from noderuntime.transport.relay_client import RelayDialer
    from protocol import Hop, Span

    node = _NODES[kind]
    session = os.urandom(16)
    dialer = RelayDialer(nursery, channel_keys(Identity.generate()), plaintext=kind != "noise")
    ticket = issue(issuer, session_id=session, epoch=0, artifact=b"a" * 32, hops=[Hop(node.node_id, Span(0, 1))])
    stream = await dialer.dial(url, node.node_id, session_id=session, epoch=0, ticket=ticket)
    accepted = await _ACCEPTED[kind].receive()
    if kind != "tls":
        return stream, accepted
    # TLS runs over the plaintext relayed websocket: its handshake, then framed records
    cert, _ = _certificate(_NODES["tls-dialer"])
    client = TlsEnd(_client_context(_NODES["tls-dialer"]), server=False)
    _, hello = client.step()
    await stream.send(struct.pack(">H", len(cert)) + cert + hello)
    first = await accepted.receive()
    (size,) = struct.unpack(">H", first[:2])
    node_cert, node_key = _certificate(node)
    server = TlsEnd(_context(True, node_cert, node_key, first[2 : 2 + size]), server=True)
    _, second = server.step(first[2 + size :])
    await accepted.send(second)
    _, third = client.step(await stream.receive())
    await stream.send(third)
    server.step(await accepted.receive())
    return _TlsStream(stream, client), _TlsStream(accepted, server)


@functools.cache
def _client_context(identity: Any) -> ssl.SSLContext:
    cert, key = _certificate(identity)
    return _context(False, cert, key, None)


class _TlsStream:
    """A frame stream: TLS records over a plaintext relayed seam."""

    def __init__(self, inner: Any, end: TlsEnd) -> None:
        self._inner = inner
        self._end = end
        self._ready: list[bytes] = []

    async def send(self, frame: bytes) -> None:
        await self._inner.send(self._end.seal(frame))

    async def receive(self) -> bytes:
        while not self._ready:
            self._ready += self._end.open(await self._inner.receive())
        return self._ready.pop(0)

    async def aclose(self) -> None:
        await self._inner.aclose()


_NODES: dict[str, Any] = {}
_ACCEPTED: dict[str, trio.MemoryReceiveChannel[Any]] = {}


async def _over_relay(quick: bool) -> dict[str, Any]:
    from noderuntime.access.identity import Identity
    from noderuntime.access.tickets import TicketVerifier
    from noderuntime.transport.relay_client import RelayListener
    from relay.server import Relay, serve

    issuer = Identity.generate()
    relay = Relay(TicketVerifier([issuer.node_id]))
    count = 30 if quick else 200
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, relay, "127.0.0.1", 0)
        url = f"ws://127.0.0.1:{listening.port}"
        listeners = []
        _NODES["tls-dialer"] = Identity.generate()
        for kind in KINDS:
            _NODES[kind] = Identity.generate()
            send, _ACCEPTED[kind] = trio.open_memory_channel[Any](8)
            listener = RelayListener(url, _NODES[kind], send.send_nowait, plaintext=kind != "noise")
            listeners.append(listener)
            await nursery.start(listener.run)
        opens: dict[str, list[float]] = {k: [] for k in KINDS}
        trips: dict[str, dict[str, list[float]]] = {k: {"decode": [], "prefill": []} for k in KINDS}
        decode, prefill = os.urandom(SIZES["decode_smollm2"]), os.urandom(SIZES["prefill_smollm2"])
        for _ in range(max(3, count // 10)):
            for kind in KINDS:  # interleaved: the machine drifts
                started = time.perf_counter()
                client, server = await _relay_pair(kind, nursery, url, issuer)
                await client.send(decode)
                await server.send(await server.receive())
                await client.receive()
                opens[kind].append(time.perf_counter() - started)
                for label, frame, repeats in (("decode", decode, 10), ("prefill", prefill, 2)):
                    for _ in range(repeats):
                        started = time.perf_counter()
                        await client.send(frame)
                        await server.send(await server.receive())
                        await client.receive()
                        trips[kind][label].append(time.perf_counter() - started)
                await client.aclose()
                await server.aclose()
        for listener in listeners:
            listener.stop()
        nursery.cancel_scope.cancel()
    for kind in KINDS:
        out[kind] = {
            "open_and_first_round_trip_p50_ms": statistics.median(opens[kind]) * 1e3,
            "decode_round_trip_p50_ms": statistics.median(trips[kind]["decode"]) * 1e3,
            "decode_round_trip_p95_ms": _common.percentile(trips[kind]["decode"], 95) * 1e3,
            "prefill_round_trip_p50_ms": statistics.median(trips[kind]["prefill"]) * 1e3,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    per_frame = _per_frame(args.quick)
    relayed = trio.run(_over_relay, args.quick)
    figures = {"per_frame_cpu": per_frame, "over_the_relay": relayed, "chosen": "noise"}
    recipe = {"python_ssl": ssl.OPENSSL_VERSION, "noise": "Noise_XX_25519_AESGCM_SHA256"}
    path = _common.out_path(NAME, args)
    _common.write(path, NAME, args, recipe, figures)
    rows = [
        [label, row["frame_bytes"], *(f"{row[k]['seal_us'] + row[k]['open_us']:.1f}" for k in ("noise", "tls"))]
        for label, row in per_frame.items()
        if label != "handshake_both_sides_ms"
    ]
    print(_common.table(["frame", "bytes", "Noise seal+open µs", "TLS seal+open µs"], rows))
    hs = per_frame["handshake_both_sides_ms"]
    print(f"\nhandshake, both sides' CPU: Noise {hs['noise']:.2f} ms, TLS {hs['tls']:.2f} ms\n")
    rows = [
        [
            kind,
            f"{r['open_and_first_round_trip_p50_ms']:.2f}",
            f"{r['decode_round_trip_p50_ms']:.3f}",
            f"{r['prefill_round_trip_p50_ms']:.2f}",
        ]
        for kind, r in relayed.items()
    ]
    print(_common.table(["over the relay", "open + 1st trip ms", "decode trip ms", "prefill trip ms"], rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
