"""The asyncio thread grpclib runs on, and the bounded pipes that carry frames between it and trio."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import trio

from noderuntime.operations.threadnames import name_this_thread
from noderuntime.transport.base import StreamClosed, TransportError

PIPE_CAPACITY = 8  # frames a pipe holds before its producer waits
_T = TypeVar("_T")


class AsyncioThread:
    """An asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._handovers: dict[trio.lowlevel.TrioToken, Handover] = {}
        self._handovers_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="grpc-asyncio", daemon=True)
        self._thread.start()

    def handover(self, token: trio.lowlevel.TrioToken) -> Handover:
        """The wake-ups between this loop and the trio run of ``token``, shared by all its pipes.

        Either thread asks: a dialed stream's pipes are made on trio's, an accepted one's on
        asyncio's.
        """
        with self._handovers_lock:
            found = self._handovers.get(token)
            if found is None:
                found = self._handovers[token] = Handover(self.loop, token)
            return found

    def _run(self) -> None:
        name_this_thread("grpc-asyncio")
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def call(self, factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        """Run ``factory()`` on the asyncio loop and wait for it from trio (cancellation crosses over)."""
        future = asyncio.run_coroutine_threadsafe(factory(), self.loop)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            future.cancel()
            raise
        return future.result()

    def close(self) -> None:
        """Cancel what still runs on the loop, then stop it and its thread (idempotent)."""
        if not self.loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


class Handover:
    """Wake-ups between the asyncio thread and a trio run: one crossing for all those ready.

    A batcher's tick answers all its sessions at once, so their frames leave trio
    together and arrive together. Woken one by one, each frame wrote the other thread's
    wakeup socket; here the first wake-up of a burst crosses, and those that come before
    the other side has run ride along with it. Sixteen seams with a frame each way on
    every one: rounds 9-16 % shorter, 10-18 % less CPU a frame in both processes; one seam
    alone crosses as before (measured before and after, three runs of each; ``benchmarks.crossings``
    times such bursts as they are now).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, token: trio.lowlevel.TrioToken) -> None:
        self.loop = loop
        self.token = token
        self._to_trio: list[trio.Event] = []  # touched on the asyncio thread only
        self._lock = threading.Lock()
        self._to_asyncio: list[asyncio.Event] = []  # under the lock

    def set_trio(self, event: trio.Event) -> None:
        """Set ``event`` in trio once this pass of the loop is done (asyncio thread)."""
        self._to_trio.append(event)
        if len(self._to_trio) == 1:
            # after the callbacks this pass runs: every frame read with this one rides along
            self.loop.call_soon(self._cross_to_trio)

    def _cross_to_trio(self) -> None:
        events, self._to_trio = self._to_trio, []
        with contextlib.suppress(trio.RunFinishedError):  # nobody is left to wake
            self.token.run_sync_soon(_set_all, events)

    def set_asyncio(self, event: asyncio.Event) -> None:
        """Set ``event`` on the asyncio loop soon (trio thread)."""
        with self._lock:
            self._to_asyncio.append(event)
            first = len(self._to_asyncio) == 1
        if first:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                self.loop.call_soon_threadsafe(self._cross_to_asyncio)

    def _cross_to_asyncio(self) -> None:
        with self._lock:
            events, self._to_asyncio = self._to_asyncio, []
        for event in events:
            event.set()


def _set_all(events: list[trio.Event]) -> None:
    for event in events:
        event.set()


class Pipe:
    """A bounded single-producer, single-consumer queue between the trio and asyncio threads.

    ``trio_to_aio`` says which side produces. The consumer may also be told the stream
    ended (``finish``): with ``None`` for a clean end, or a :class:`TransportError`.

    A side that has to wait leaves an event under the lock; the other side takes it,
    under the same lock, when it changes the queue, and wakes only that waiter, through the
    runtime's :class:`Handover` (with the other pipes' wake-ups of the same moment). A
    decode step moves one frame at a time, so a producer hardly ever waits for room: waking
    the other thread after every frame taken would cost a thread wake-up per frame for
    nothing. An end (``finish``, ``drop``) may come from either thread and wakes both sides
    at once.
    """

    def __init__(self, handover: Handover, *, trio_to_aio: bool) -> None:
        self._handover = handover
        self._loop = handover.loop
        self._token = handover.token
        self._trio_to_aio = trio_to_aio
        self._lock = threading.Lock()
        self._items: deque[bytes] = deque()
        self._end: TransportError | None = None
        self._ended = False
        self._trio_waiter: trio.Event | None = None
        self._aio_waiter: asyncio.Event | None = None

    @property
    def ended_with(self) -> TransportError | None:
        """The error the stream ended with; ``None`` while it runs or after a clean end (read without the lock)."""
        return self._end

    def _take_waiters(self, *, trio_side: bool, aio_side: bool) -> Callable[[], None]:
        """Take the named sides' waiters (lock held); returns what wakes them (call it unlocked)."""
        trio_event = aio_event = None
        if trio_side:
            trio_event, self._trio_waiter = self._trio_waiter, None
        if aio_side:
            aio_event, self._aio_waiter = self._aio_waiter, None

        def wake() -> None:
            # each wake-up runs on the waiter's own thread
            if trio_event is not None:
                with contextlib.suppress(trio.RunFinishedError):
                    self._token.run_sync_soon(trio_event.set)
            if aio_event is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    self._loop.call_soon_threadsafe(aio_event.set)

        return wake

    def _take_waiter(self, *, trio_side: bool) -> trio.Event | asyncio.Event | None:
        """The trio side's waiter or the asyncio side's, if it waits (lock held)."""
        event: trio.Event | asyncio.Event | None
        if trio_side:
            event, self._trio_waiter = self._trio_waiter, None
        else:
            event, self._aio_waiter = self._aio_waiter, None
        return event

    def _hand_over(self, waiter: trio.Event | asyncio.Event | None) -> None:
        """Wake ``waiter``, taken by put or get on their own side's thread, through the handover."""
        if isinstance(waiter, trio.Event):
            self._handover.set_trio(waiter)  # put or get ran on the asyncio thread
        elif waiter is not None:
            self._handover.set_asyncio(waiter)  # on the trio thread

    async def _trio_wait(self, ready: Callable[[], bool]) -> None:
        while True:
            with self._lock:
                if ready():
                    return
                event = self._trio_waiter = trio.Event()
            try:
                await event.wait()
            finally:
                with self._lock:
                    if self._trio_waiter is event:
                        self._trio_waiter = None

    async def _aio_wait(self, ready: Callable[[], bool]) -> None:
        while True:
            with self._lock:
                if ready():
                    return
                event = self._aio_waiter = asyncio.Event()
            try:
                await event.wait()
            finally:
                with self._lock:
                    if self._aio_waiter is event:
                        self._aio_waiter = None

    def _room(self) -> bool:
        return len(self._items) < PIPE_CAPACITY or self._ended

    def _has_item_or_ended(self) -> bool:
        return bool(self._items) or self._ended

    async def put(self, frame: bytes) -> None:
        """Producer side: wait for room, then queue ``frame``."""
        if self._trio_to_aio:
            await self._trio_wait(self._room)
        else:
            await self._aio_wait(self._room)
        with self._lock:
            if self._ended:
                raise fresh(self._end) if self._end is not None else StreamClosed("the seam is closed")
            self._items.append(frame)
            waiter = self._take_waiter(trio_side=not self._trio_to_aio)  # the consumer's
        self._hand_over(waiter)

    async def get(self) -> bytes | None:
        """Consumer side: the next frame, ``None`` at a clean end; raises the end's error."""
        if self._trio_to_aio:
            await self._aio_wait(self._has_item_or_ended)
        else:
            await self._trio_wait(self._has_item_or_ended)
        with self._lock:
            if not self._items:
                if self._end is not None:
                    raise fresh(self._end)
                return None
            frame = self._items.popleft()
            waiter = self._take_waiter(trio_side=self._trio_to_aio)  # the producer's, waiting for room
        self._hand_over(waiter)
        return frame

    def finish(self, error: TransportError | None = None) -> None:
        """No more frames (thread-safe: wakes both sides)."""
        with self._lock:
            if not self._ended:
                # frames already queued are still delivered (the peer's last Cancel or Error among them)
                self._ended = True
                self._end = None if error is None else fresh(error)
            wake = self._take_waiters(trio_side=True, aio_side=True)
        wake()

    def drop(self, error: TransportError) -> None:
        """End now, discarding queued frames: nobody will take them (thread-safe)."""
        with self._lock:
            self._items.clear()
        self.finish(error)


def fresh(error: TransportError) -> TransportError:
    """A copy of ``error`` with no traceback: what a pipe keeps, and what is raised in its name.

    Raising the kept error itself would grow its traceback with every raise, and the frames in
    it hold the stream that keeps the pipe: a reference cycle, freed only by the cyclic
    collector, with the frames the stream was moving still in it.
    """
    return copy.copy(error).with_traceback(None)
