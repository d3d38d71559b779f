"""Reading what a peer wrote: JSON (tickets, relay control messages, signed records) and addresses.

``json.loads`` raises ``RecursionError`` on deeply nested input and turns ``1e999`` into
``inf``, on which ``int()`` raises ``OverflowError``; neither is a ``ValueError``, so a
caller that catches only that lets a few bytes from anyone end its task (or, unhandled,
its process). Likewise asyncio's name lookup raises ``UnicodeError`` for a host name
with an empty label or one over 63 characters, where a caller expects ``OSError``.
Everything here raises :class:`ValueError` and nothing else.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any


def json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; :class:`ValueError` naming ``what`` otherwise."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ValueError(f"{what} is not JSON (or is nested too deeply)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not a JSON object")
    return data


def integer(value: Any, what: str, *, low: int = 0, high: int = (1 << 63) - 1) -> int:
    """``value`` if it is a JSON integer in ``[low, high]``; :class:`ValueError` otherwise."""
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], not {value!r:.40}")
    return value


def host_port(address: str, *, listen: bool = False) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) into its parts; :class:`ValueError` when malformed.

    The host must be an IP address or a name that the resolver can encode; a listen
    address may use port 0 (any free port).
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if listen else 1) <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r:.80}")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    try:
        if bracketed or ":" in host:
            ipaddress.IPv6Address(host)
        elif not host.isprintable() or " " in host:
            raise ValueError(host)
        else:
            host.encode("idna")
    except (ValueError, UnicodeError):  # UnicodeError is a ValueError; named for the reader
        raise ValueError(f"{host!r:.80} in {address!r:.80} is not a host name or IP address") from None
    return host, int(port)
