"""TLS pinned to the certificate a route names: a peer's identity is its certificate's hash."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl

from noderuntime.transport.base import StreamBroken
from noderuntime.transport.grpc.bridge import AsyncioThread
from noderuntime.transport.grpc.errors import HANDSHAKE, map_exceptions
from protocol import StatusCode


async def pinned_context(runtime: AsyncioThread, host: str, port: int, cert_sha256: bytes) -> ssl.SSLContext:
    """A TLS context that trusts exactly the certificate whose DER sha256 is ``cert_sha256``.

    The certificate is fetched once with an unverified handshake and checked against
    the pin; the returned context then requires that very certificate, so a
    man-in-the-middle in either handshake is refused.
    """

    async def fetch() -> bytes:
        probe = ssl.create_default_context()
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        probe.set_alpn_protocols(["h2"])
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=probe), 5.0)
        try:
            ssl_object = writer.get_extra_info("ssl_object")
            der: bytes = ssl_object.getpeercert(binary_form=True)
            return der
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            del reader

    with map_exceptions(HANDSHAKE, f"{host}:{port}"):
        der = await runtime.call(fetch)
    if hashlib.sha256(der).digest() != cert_sha256:
        raise StreamBroken(
            f"{host}:{port} presented a certificate that is not the one the route names", StatusCode.UNAUTHENTICATED
        )
    context = ssl.create_default_context(cadata=ssl.DER_cert_to_PEM_cert(der))
    context.check_hostname = False  # the pin names the certificate, not a host name
    context.set_alpn_protocols(["h2"])
    return context
