"""A seam of one session: a frame stream plus the protocol's codec and state machine."""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from noderuntime.operations import timeline
from noderuntime.transport import FrameStream, StreamBroken, StreamClosed, TransportError
from protocol import (
    Event,
    FrameDecoder,
    FrameEncoder,
    Limits,
    ProtocolError,
    SeamEndpoint,
    State,
    error_event,
)

log = logging.getLogger(__name__)

# How long a best-effort notice (Cancel, Error) to a peer may take before we give up on it.
NOTICE_TIMEOUT = 0.5


class SeamConnection:
    """Typed events over a :class:`FrameStream`, checked by a :class:`SeamEndpoint`.

    The endpoint may be attached after the first event (a node learns the session's
    identity from the OpenRoute it receives).
    """

    def __init__(
        self,
        stream: FrameStream,
        endpoint: SeamEndpoint | None = None,
        limits: Limits = Limits(),
        on_frame: Callable[[str, str, int], None] | None = None,
        label: str = "seam",
    ) -> None:
        """``on_frame(transport, direction, bytes)`` is called for every frame (telemetry).

        ``label`` names the seam in the timeline (``up``, ``down``, ``client``).
        """
        self.stream = stream
        self.transport = getattr(stream, "kind", "unknown")
        self._on_frame = on_frame
        self.endpoint = endpoint
        self._encoder = FrameEncoder(limits)
        self._decoder = FrameDecoder(limits)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self._closed = False
        self._broken = False
        self._stages = (f"{label}.sent", f"{label}.received", f"{label}.decoded")
        # one event at a time: each takes the next step id, and must leave in that order
        # (a session's tokens and its heartbeats go up the same seam from two tasks)
        self._sending = trio.StrictFIFOLock()

    def set_limits(self, limits: Limits) -> None:
        """Bound what this connection sends and accepts by ``limits`` from now on."""
        self._encoder.limits = limits
        self._decoder.limits = limits

    async def send(self, event: Event) -> None:
        """Check ``event`` against the state machine, encode it and send its frames."""
        await self.send_next(lambda: event)

    async def send_next(self, build: Callable[[], Event]) -> None:
        """Send the event ``build`` makes once it is this sender's turn.

        An event's header takes the next step id (``SeamEndpoint.header``): made before the
        turn, two senders waiting for it (a session's tokens and its heartbeat) took the
        same one, and the second was refused as a step sent twice.
        """
        try:  # uncontended, taking the turn costs no checkpoint
            self._sending.acquire_nowait()
        except trio.WouldBlock:
            await self._sending.acquire()
        try:
            await self._send(build())
        finally:
            self._sending.release()

    async def _send(self, event: Event) -> None:
        if self._broken:
            raise StreamBroken("an earlier event was cut off mid-way on this seam")
        snapshot = self.endpoint.outbound_snapshot() if self.endpoint is not None else None
        if self.endpoint is not None:
            self.endpoint.send(event)
        frames = self._encoder.encode(event)
        timeline.mark(self._stages[0])
        sent = 0
        try:
            for frame in frames:
                await self.stream.send(frame)
                sent += 1
                self.bytes_sent += len(frame)
                self.frames_sent += 1
                if self._on_frame is not None:
                    self._on_frame(self.transport, "out", len(frame))
        except BaseException:
            # nothing left: the event never happened; part of it left: the seam is unusable
            if sent == 0 and snapshot is not None and self.endpoint is not None:
                self.endpoint.restore_outbound(snapshot)
            elif sent:
                self._broken = True
            raise

    async def receive(self) -> Event:
        """The next event the peer sent (retries of the last step are skipped)."""
        while True:
            frame = await self.stream.receive()
            timeline.mark(self._stages[1])
            self.bytes_received += len(frame)
            self.frames_received += 1
            if self._on_frame is not None:
                self._on_frame(self.transport, "in", len(frame))
            event = self._decoder.receive(frame)
            if event is None:
                continue  # a chunk of a larger step
            timeline.mark(self._stages[2])
            if self.endpoint is None:
                return event
            accepted = self.endpoint.receive(event)
            if accepted is not None:
                return accepted

    async def notify(self, event: Event) -> bool:
        """Send a closing notice (Cancel or Error) if the state machine allows it; never waits long."""
        if self._closed or (self.endpoint is not None and self.endpoint.outbound_state is State.CLOSED):
            return False
        with trio.move_on_after(NOTICE_TIMEOUT) as scope:
            scope.shield = True
            try:
                await self.send(event)
                return True
            except (TransportError, ProtocolError) as exc:
                log.debug("could not deliver %s: %s", type(event).__name__, exc)
        return False

    async def fail(self, error: ProtocolError, node_id: bytes = b"") -> None:
        """Tell the peer about ``error`` with an Error frame, best effort."""
        if self.endpoint is not None:
            await self.notify(error_event(self.endpoint, error, node_id))

    async def abort(self, error: ProtocolError) -> None:
        """End the stream at once with ``error``'s status, for a peer with no session to tell."""
        if not self._closed:
            self._closed = True
            with trio.CancelScope(shield=True):
                await self.stream.abort(error.code, error.message)

    async def aclose(self) -> None:
        """Close the stream; idempotent, does not wait for the peer."""
        if not self._closed:
            self._closed = True
            with trio.CancelScope(shield=True):
                await self.stream.aclose()


__all__ = ["SeamConnection", "StreamClosed"]
