"""A relay that attacks the seams it pairs, as a curious or malicious operator could.

    python -m tests.hostile_relay --listen HOST:PORT --issuer-key HEX --mode-file PATH [--tap PATH]

It is the project's own relay (:mod:`relay.server`) with its forwarding patched. Its
attack is read from ``--mode-file`` whenever a pair starts, so one running relay serves
a whole test module. Modes (``N`` counts a direction's messages from 0, handshake
messages included: the dialer's first data message is its message 2, the acceptor's
its message 1):

- ``honest``: forward as the relay does.
- ``tap``: forward, and append every forwarded message to ``--tap`` (u32 length,
  one direction byte: ``d`` dialer to acceptor, ``a`` back; the message).
- ``flip-d:N`` / ``flip-a:N``: flip one bit of message N in that direction.
- ``replay-d:N`` / ``replay-a:N``: send message N twice.
- ``drop-d:N`` / ``drop-a:N``: never send message N.
- ``reorder-d:N`` / ``reorder-a:N``: send message N after message N+1.
- ``inject-d:N`` / ``inject-a:N``: send random bytes of the same length before message N.
- ``splice:N``: once two pairs run, send each dialer's messages from its message N on
  to the other pair's acceptor.
- ``close-d:N`` / ``close-a:N``: in place of message N, close the connection it was going
  to with a status close code that claims the far end refused the seam
  (PERMISSION_DENIED), as the relay would pass on a peer's own refusal.
- ``wrong-node``: pair a dialer with another node connected to the relay than the one
  it asked for.
"""

from __future__ import annotations

import argparse
import os
import struct
from pathlib import Path
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from noderuntime.access.identity import load_public_key
from noderuntime.access.tickets import TicketVerifier
from noderuntime.services import ready
from noderuntime.services.ready import RelayReady
from noderuntime.transport import relay_messages as m
from protocol import StatusCode
from relay.server import Relay, _Pair, serve


class _Misdirecting(dict[bytes, WebSocketConnection]):
    """The relay's table of connected nodes, which answers with another node in ``wrong-node`` mode."""

    def __init__(self, relay: HostileRelay) -> None:
        super().__init__()
        self._relay = relay

    def get(self, key: bytes, default: Any = None) -> Any:  # type: ignore[override]
        if self._relay.mode() == "wrong-node":
            others = [connection for node, connection in self.items() if node != key]
            if others:
                return others[0]
        return super().get(key, default)


class HostileRelay(Relay):
    """See the module docstring."""

    def __init__(self, verifier: TicketVerifier, mode_file: Path, tap: Path | None) -> None:
        super().__init__(verifier)
        self._mode_file = mode_file
        self._tap = tap
        self.nodes = _Misdirecting(self)
        self._modes: dict[int, str] = {}  # each pair's mode, read when it starts
        self._running: list[_Pair] = []  # for splicing

    def mode(self) -> str:
        try:
            return self._mode_file.read_text().strip() or "honest"
        except OSError:
            return "honest"

    async def _forward(self, pair: _Pair) -> None:
        self._modes[id(pair)] = self.mode()
        self._running.append(pair)
        try:
            await super()._forward(pair)
        finally:
            self._running.remove(pair)
            self._modes.pop(id(pair), None)

    async def _pipe(
        self, pair: _Pair, src: WebSocketConnection, dst: WebSocketConnection, scope: trio.CancelScope
    ) -> None:
        direction = "d" if src is pair.dialer else "a"
        attack, _, at = self._modes.get(id(pair), "honest").partition(":")
        kind, _, side = attack.partition("-")
        target = int(at) if at else -1
        held: bytes | None = None
        count = 0
        try:
            while True:
                message = await src.get_message()
                if not isinstance(message, bytes):
                    break
                out = dst
                if kind == "splice" and direction == "d" and count >= target:
                    others = [p for p in self._running if p is not pair and p.acceptor is not None]
                    if others and others[0].acceptor is not None:
                        out = others[0].acceptor
                sends = [message]
                if side == direction and count == target:
                    if kind == "flip":
                        spot = len(message) // 2
                        sends = [message[:spot] + bytes([message[spot] ^ 0x01]) + message[spot + 1 :]]
                    elif kind == "replay":
                        sends = [message, message]
                    elif kind == "drop":
                        sends = []
                    elif kind == "reorder":
                        held, sends = message, []
                    elif kind == "inject":
                        sends = [os.urandom(len(message)), message]
                    elif kind == "close":
                        forged = m.CLOSE_STATUS_BASE + int(StatusCode.PERMISSION_DENIED)
                        await out.aclose(forged, "the node refuses to serve you")
                        break
                elif held is not None:
                    sends, held = [message, held], None
                for item in sends:
                    if kind == "tap" and self._tap is not None:
                        with self._tap.open("ab") as tap:
                            tap.write(struct.pack(">I", len(item)) + direction.encode() + item)
                    await out.send_message(item)
                count += 1
        except ConnectionClosed as exc:
            closed = exc.reason
            if closed is not None and pair.status is None and closed.code >= 4500:
                pair.status = (closed.code, closed.reason or "")
        finally:
            scope.cancel()


def read_tap(path: Path) -> list[tuple[str, bytes]]:
    """What a ``tap`` relay wrote: (direction, message) in the order forwarded."""
    data = path.read_bytes() if path.exists() else b""
    out, at = [], 0
    while at < len(data):
        (size,) = struct.unpack(">I", data[at : at + 4])
        out.append((chr(data[at + 4]), data[at + 5 : at + 5 + size]))
        at += 5 + size
    return out


async def _main(args: argparse.Namespace) -> None:
    host, _, port = args.listen.rpartition(":")
    relay = HostileRelay(
        TicketVerifier([load_public_key(args.issuer_key)]), Path(args.mode_file), Path(args.tap) if args.tap else None
    )
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(serve, relay, host, int(port))
        info = RelayReady(url=f"ws://{host}:{listening.port}", port=listening.port, pid=os.getpid(), http="")
        print(ready.dump(info), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--issuer-key", required=True)
    parser.add_argument("--mode-file", required=True)
    parser.add_argument("--tap")
    trio.run(_main, parser.parse_args())


if __name__ == "__main__":
    main()
