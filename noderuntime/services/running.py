"""What every long-running process shares: its ready line, its signals, and its TLS files.

Light on purpose: the relay and the tracker run from an install without the engine.
"""

from __future__ import annotations

import functools
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from noderuntime.services import ready
from noderuntime.services.ready import Ready

log = logging.getLogger(__name__)


class TlsFilesError(ValueError):
    """A certificate and key that cannot serve TLS."""


def server_tls(cert: Path, key: Path, *, alpn: Sequence[str] = ("h2",)) -> ssl.SSLContext:
    """A TLS server context (for HTTP/2 unless ``alpn`` says otherwise); :class:`TlsFilesError` if unusable."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:  # missing, unreadable, not PEM, a key that is not the certificate's (SSLError)
        raise TlsFilesError(f"cannot use the certificate {cert} with the key {key}: {exc}") from None
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def announce(info: Ready) -> None:
    """The ready line on stdout."""
    print(ready.dump(info), flush=True)


async def run_until_signal(
    main: Callable[..., Awaitable[None]], *args: Any, drain: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Run ``main(*args, task_status=...)`` and announce readiness; SIGINT/SIGTERM drain it.

    ``drain``, if given, runs first (a node hands its sessions over); a second signal
    while it runs stops at once. A signal before ``main`` is ready (a node still waiting for
    its tracker, still loading) stops it at once: there is nothing to hand over yet.
    """
    ready = False
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    log.info("received %s: %s", signal.Signals(signum).name, "draining" if ready else "stopping")
                    if drain is not None and ready:
                        async with trio.open_nursery() as draining:
                            draining.start_soon(_until_second_signal, signals, draining.cancel_scope)
                            await drain()
                            draining.cancel_scope.cancel()
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(watch)
            info = await nursery.start(main, *args)
            ready = True
            announce(info)


async def _until_second_signal(signals: Any, scope: trio.CancelScope) -> None:
    async for signum in signals:
        log.info("received %s again: stopping now", signal.Signals(signum).name)
        scope.cancel()
        return


def run_main(
    main: Callable[..., Awaitable[None]], *args: Any, drain: Callable[[], Awaitable[None]] | None = None
) -> int:
    """Run ``main`` in this process until a signal; the exit status (errors before it served, unwrapped)."""
    try:
        trio.run(functools.partial(run_until_signal, main, *args, drain=drain))
    except BaseExceptionGroup as group:
        # a failure before the service was up (a model that does not fit, a port in use)
        # comes wrapped by the nursery; the user needs the error itself
        leaf: BaseException = group
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if leaf is group:
            raise
        raise leaf from None
    return 0
