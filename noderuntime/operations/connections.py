"""How many connections one source may hold open on a server, counted as the relay counts them.

A stranger's connections cost a server a descriptor and a task each; a process has a few
thousand descriptors, and one address that holds them all leaves every other client out.
Every server of the project that strangers reach counts its open connections by source
(:class:`HostCap`) and closes one past the cap unanswered: the HTTP servers
(``operations/httpserve.py``) and a node's gRPC seam server (``transport/grpc/server.py``).
"""

from __future__ import annotations

import collections
import ipaddress
import logging

log = logging.getLogger(__name__)

# connections one address (an IPv6 /64) may hold open at once unless a server is told
# otherwise: above the 256 streamed replies one gateway key may run at once, far below the
# descriptors a process has
CONNECTIONS_PER_HOST = 512


def source(address: str) -> str:
    """Whose connection this is, for a per-address cap: the address, or its /64 for IPv6 (the relay's too)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    # one IPv6 host commonly holds a whole /64
    return str(ipaddress.ip_network(f"{ip}/64", strict=False)) if ip.version == 6 else address


class HostCap:
    """The connections each source holds open on one server, and those refused past ``per_host`` (0: no cap).

    Not thread-safe: one server's connections come and go on one thread.
    """

    def __init__(self, per_host: int = CONNECTIONS_PER_HOST) -> None:
        self.per_host = per_host
        self.open: collections.Counter[str] = collections.Counter()
        self.refused = 0

    def take(self, address: str) -> str | None:
        """Count a new connection from ``address``: its source, to :meth:`give` back when it ends;
        None (counted as refused) past the cap."""
        host = source(address)
        if self.per_host and self.open[host] >= self.per_host:
            if self.refused % 1000 == 0:  # the first and every thousandth: a flood logs a line, not a line each
                log.warning("refused a connection from %s: it holds %d, the most one address may", host, self.per_host)
            self.refused += 1
            return None
        self.open[host] += 1
        return host

    def give(self, host: str) -> None:
        """A connection counted under ``host`` (what :meth:`take` returned) ended."""
        self.open[host] -= 1
        if self.open[host] <= 0:
            del self.open[host]
