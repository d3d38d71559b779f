"""Which addresses a route may name: public ones, unless the swarm is declared local.

Whoever registers a node chooses the address and relay URL that gateways and other nodes
then dial. Left unchecked, a stranger could make them connect into their own networks
(loopback services, a cloud's metadata address, the LAN): a blind request forgery. So in a
swarm not declared local (the tracker's ``--local-swarm`` says it is, in every ticket it
signs), an address must be public: not loopback, link-local, private, shared (CGNAT),
multicast, unspecified, documentation or otherwise reserved, in IPv4 or IPv6, nor an IPv6
address that embeds such an IPv4 one (mapped, 6to4, NAT64, Teredo).

Names are treated by what is dialled:

- a node's direct address (``HOST:PORT``, dialled over gRPC) must be a literal IP address:
  a name would be resolved again by the transport after any check, so its records could
  change in between (DNS rebinding), and a node knows the address it listens on;
- a relay URL may name its host (a ``wss://`` relay's certificate names it); the dialler
  resolves it just before it dials and refuses it when any address it resolves to is not
  public (:func:`check_relay_resolved`). The WebSocket client resolves once more when it
  connects; the name's owner could answer differently in between, which is why direct
  addresses, dialled by every peer of a route, take no names at all.

The tracker checks registrations with :func:`check_endpoints` (no DNS: a stranger's name
must not make the tracker wait on a resolver), the dialler with the same and
:func:`check_relay_resolved`.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

import trio

from noderuntime.access import untrusted

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


class AddressError(ValueError):
    """An address or relay URL that a swarm not declared local may not name."""


def is_public(ip: IP) -> bool:
    """Whether ``ip`` is a public unicast address (and, for IPv6, embeds no IPv4 address that is not)."""
    if not ip.is_global or ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = [ip.ipv4_mapped, ip.sixtofour]
        if ip.teredo is not None:
            embedded.append(ip.teredo[1])
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        return all(v4 is None or is_public(v4) for v4 in embedded)
    return True


def literal(host: str) -> IP | None:
    """``host`` as an IP address, or None when it is a name."""
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def check_address(address: str) -> None:
    """A node's direct address (``HOST:PORT``): a literal public IP address; :class:`AddressError` else."""
    try:
        host, _port = untrusted.host_port(address)
    except ValueError as exc:
        raise AddressError(str(exc)) from None
    ip = literal(host)
    if ip is None:
        raise AddressError(
            f"the direct address {address!r:.80} names a host: in a swarm not declared local a node's address "
            "must be a literal public IP address (--advertise IP:PORT)"
        )
    if not is_public(ip):
        raise AddressError(
            f"the direct address {address!r:.80} is not public (loopback, private, link-local, multicast or "
            "reserved): only a swarm declared local (tracker --local-swarm) may name it"
        )


def relay_host(url: str) -> tuple[str, int]:
    """The host and port a relay URL (``ws://`` or ``wss://``) dials; :class:`AddressError` when it has none."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "wss" else 80)
    except ValueError:
        raise AddressError(f"the relay URL {url!r:.80} is malformed") from None
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise AddressError(f"the relay URL {url!r:.80} is not a ws:// or wss:// URL with a host")
    return parts.hostname, port


def check_relay(url: str) -> None:
    """A relay URL whose host, when a literal address, is public; :class:`AddressError` else.

    A name passes: the dialler resolves and checks it (:func:`check_relay_resolved`).
    """
    host, _port = relay_host(url)
    ip = literal(host)
    if ip is not None and not is_public(ip):
        raise AddressError(
            f"the relay URL {url!r:.80} names an address that is not public: only a swarm declared local "
            "(tracker --local-swarm) may name it"
        )


def check_endpoints(address: str, relay: str) -> None:
    """A node's direct address and relay URL (either may be empty), as a swarm not declared local takes them."""
    if address:
        check_address(address)
    if relay:
        check_relay(relay)


def check_resolved(what: str, addresses: Iterable[str]) -> None:
    """:class:`AddressError` unless every one of ``addresses`` (what a name resolved to) is public."""
    resolved = [ip for ip in (literal(a.partition("%")[0]) for a in addresses) if ip is not None]
    if not resolved:
        raise AddressError(f"{what} resolves to no address")
    for ip in resolved:
        if not is_public(ip):
            raise AddressError(
                f"{what} resolves to {ip}, which is not public: only a swarm declared local "
                "(tracker --local-swarm) may name it"
            )


async def check_relay_resolved(url: str) -> None:
    """:func:`check_relay`, and for a name every address it resolves to now; :class:`AddressError` else."""
    check_relay(url)
    host, port = relay_host(url)
    if literal(host) is not None:
        return
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    except OSError as exc:
        raise AddressError(f"the relay URL {url!r:.80} does not resolve: {exc}") from None
    check_resolved(f"the relay URL {url!r:.80}", (str(info[4][0]) for info in infos))


__all__ = [
    "AddressError",
    "check_address",
    "check_endpoints",
    "check_relay",
    "check_relay_resolved",
    "check_resolved",
    "is_public",
    "literal",
    "relay_host",
]
