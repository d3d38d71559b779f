"""Round trips from a node to the peers it talks to, measured and smoothed for its heartbeats.

The tracker costs the seam between two hops by the round trip their nodes measured
(:meth:`noderuntime.tracker.registry.TrackerState.seam_ms`), so a route across continents
costs what it costs. A node measures the next hops of its route sessions: the time a TCP
connection to the address the route names takes to open is one round trip (SYN, SYN-ACK),
without the engine or a queue in it, which a decode step's round trip through the rest
of the route would hold. A hop reached only through its relay is not measured here: the
tracker keeps the constant for it.

:class:`RoundTrips` is plain synchronous bookkeeping; :func:`measure_round_trips` is the
task that feeds it.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable

import trio

from noderuntime.access import untrusted
from noderuntime.tracker.messages import MAX_PEERS, MAX_ROUND_TRIP_MS
from protocol import Hop

SMOOTHING = 0.3  # weight of a new measurement in the moving average
FORGET_SECONDS = 300.0  # a peer not measured this long is no longer reported
MEASURE_SECONDS = 5.0  # how often the peers seen lately are measured
LOOK_SECONDS = 1.0  # how often the sessions' next hops are looked at (sessions may be short)
CONNECT_SECONDS = 2.0


class RoundTrips:
    """Smoothed round trips by peer node id: at most ``MAX_PEERS``, the most recently measured."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, for forgetting peers no longer measured."""
        self._clock = clock
        self._peers: collections.OrderedDict[bytes, tuple[float, float]] = collections.OrderedDict()

    def note(self, peer: bytes, ms: float) -> None:
        """Take one measurement of the round trip to ``peer``."""
        if not math.isfinite(ms) or ms < 0:
            return
        ms = min(ms, MAX_ROUND_TRIP_MS)
        old = self._peers.pop(peer, None)
        smoothed = ms if old is None else old[0] + SMOOTHING * (ms - old[0])
        self._peers[peer] = (smoothed, self._clock())
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)

    def snapshot(self) -> dict[bytes, float]:
        """The round trips a heartbeat reports now (ms, rounded to 0.01), forgetting stale peers."""
        now = self._clock()
        for peer in [p for p, (_, when) in self._peers.items() if now - when > FORGET_SECONDS]:
            del self._peers[peer]
        return {peer: round(ms, 2) for peer, (ms, _) in self._peers.items()}


async def connect_ms(address: str) -> float | None:
    """Milliseconds to open a TCP connection to ``address`` (HOST:PORT), or None when it did not open.

    The name is resolved first, so that the time is the round trip alone; one that takes
    over ``CONNECT_SECONDS`` is no measurement (the peer may be down).
    """
    try:
        host, port = untrusted.host_port(address)
    except ValueError:
        return None
    with trio.move_on_after(CONNECT_SECONDS):
        try:
            found = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
            if not found:
                return None
            family, kind, proto, _, where = found[0]
            with trio.socket.socket(family, kind, proto) as sock:
                began = time.perf_counter()
                await sock.connect(where)
                return (time.perf_counter() - began) * 1e3
        except OSError:
            return None
    return None


async def measure_round_trips(
    round_trips: RoundTrips,
    next_hops: Callable[[], Iterable[Hop]],
    *,
    every: float = MEASURE_SECONDS,
    look_every: float = LOOK_SECONDS,
) -> None:
    """Forever: note the direct next hops ``next_hops()`` names, and measure those seen lately every ``every`` s."""
    seen: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # peer -> address
    last = -math.inf
    while True:
        for hop in next_hops():
            if hop.address:
                seen.pop(hop.node_id, None)
                seen[hop.node_id] = hop.address
                while len(seen) > MAX_PEERS:
                    seen.popitem(last=False)
        if trio.current_time() - last >= every:
            last = trio.current_time()
            for peer, address in list(seen.items()):
                ms = await connect_ms(address)
                if ms is not None:
                    round_trips.note(peer, ms)
            seen.clear()  # measured again only while sessions still go there
        await trio.sleep(look_every)
