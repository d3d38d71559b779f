"""Multi-process test clusters: real `noderuntime up` / `relay` processes on loopback (or in netns)."""

from __future__ import annotations

import itertools
import json
import os
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from noderuntime.access.identity import Identity
from noderuntime.access.tickets import issue
from noderuntime.engine.cores import machine_cores
from noderuntime.seams.client import GenerationRequest, open_route_generation
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.services.ready import NodeReady, RelayReady, expect
from protocol import Hop


def local_tracker_args(data_dir: str | os.PathLike[str], *extra: str, listen: str = "127.0.0.1:0") -> list[str]:
    """``noderuntime tracker``'s arguments for a swarm on loopback (declared local), keeping its key in ``data_dir``."""
    return ["tracker", "--local-swarm", "--listen", listen, "--data-dir", str(data_dir), *extra]


def local_gateway_args(data_dir: str | os.PathLike[str], tracker: str, model: str, *extra: str) -> list[str]:
    """``noderuntime gateway``'s arguments on loopback (any port) for ``tracker``, serving ``model``
    (``ID=PATH``), its tracker keys pinned in ``data_dir``."""
    return [
        "gateway",
        "--data-dir",
        str(data_dir),
        "--tracker",
        tracker,
        "--listen",
        "127.0.0.1:0",
        "--model",
        model,
        *extra,
    ]


@attrs.define
class Cluster:
    """A running route of node processes (and a relay)."""

    issuer: Identity
    nodes: list[ManagedProcess]
    infos: list[NodeReady]
    relay: ManagedProcess | None
    relay_info: RelayReady | None
    hops: tuple[Hop, ...]
    # whom the tickets name as their client: a connector opened with this identity reaches the head
    client: Identity = attrs.Factory(Identity.generate)

    @property
    def artifact(self) -> bytes:
        return bytes.fromhex(self.infos[0].artifact)

    @property
    def recipe(self) -> bytes:
        return bytes.fromhex(self.infos[0].recipe)

    def ticket(
        self,
        session_id: bytes,
        epoch: int = 0,
        *,
        hops: Sequence[Hop] | None = None,
        ttl: float = 600.0,
        issuer: Identity | None = None,
        client: bytes | None = None,
    ) -> bytes:
        """A ticket for ``session_id`` on the cluster's route; ``client``: whom it lets reach the head
        (:attr:`client` when None)."""
        return issue(
            issuer or self.issuer,
            session_id=session_id,
            epoch=epoch,
            artifact=self.artifact,
            hops=hops or self.hops,
            client=self.client.node_id if client is None else client,
            ttl_seconds=ttl,
            local=True,  # the cluster runs on loopback, as a tracker's --local-swarm says
        )

    async def status(self, index: int) -> dict[str, Any]:
        url = self.infos[index].http + "/status"

        def fetch() -> dict[str, Any]:
            with urllib.request.urlopen(url, timeout=10) as response:
                data: dict[str, Any] = json.loads(response.read())
                return data

        return await trio.to_thread.run_sync(fetch)

    async def wait_idle(self, within: float = 20.0, indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Every (listed) node: no session, no slot, no KV cell."""
        indices = list(range(len(self.nodes))) if indices is None else list(indices)
        with trio.fail_after(within):
            while True:
                states = [await self.status(i) for i in indices]
                if all(
                    s["active_sessions"] == 0
                    and s["slots_leased"] == 0
                    and s["slots_draining"] == 0
                    and s["kv_cells"] == 0
                    for s in states
                ):
                    return states
                await trio.sleep(0.1)

    def open(
        self,
        connector: Any,
        request: GenerationRequest,
        *,
        session_id: bytes | None = None,
        ticket: bytes | None = None,
        hops: tuple[Hop, ...] | None = None,
        artifact: bytes | None = None,
    ) -> AbstractAsyncContextManager[Any]:
        """A route generation over the cluster (or ``hops``), with a fresh ticket unless given one.

        The fresh ticket names ``connector``'s key as its client, as a tracker's would. The
        client does not check the ticket itself (a gateway does: ``runner.opening``), so that
        a test may present the nodes any ticket.
        """
        session_id = session_id or os.urandom(16)
        hops = hops or self.hops
        client = getattr(connector, "node_id", b"")
        ticket = self.ticket(session_id, hops=hops, client=client) if ticket is None else ticket
        return open_route_generation(
            connector,
            hops,
            request,
            artifact=artifact or self.artifact,
            recipe=self.recipe,
            ticket=ticket,
            session_id=session_id,
            epoch=0,
        )

    async def generate(
        self,
        connector: Any,
        request: GenerationRequest,
        *,
        session_id: bytes | None = None,
        ticket: bytes | None = None,
        hops: tuple[Hop, ...] | None = None,
    ) -> tuple[int, ...]:
        """Run a generation to its end; its tokens."""
        async with self.open(connector, request, session_id=session_id, ticket=ticket, hops=hops) as gen:
            while await gen.next() is not None:
                pass
        return tuple(gen.tokens)

    def stop(self) -> None:
        stop_all([*([self.relay] if self.relay else []), *self.nodes])


@contextmanager
def running_cluster(
    model: Path,
    cuts: Sequence[int],
    data_root: Path,
    *,
    relay_only: Sequence[int] = (),
    with_relay: bool = False,
    tls: Sequence[int] = (),
    slots: int = 8,
    ctx: int = 512,
    extra: Sequence[str] = (),
    head_extra: Sequence[str] = (),
    prefix: Sequence[Sequence[str]] | None = None,
    hosts: Sequence[str] | None = None,
    relay_prefix: Sequence[str] = (),
    relay_host: str = "127.0.0.1",
    relay_url_for: Sequence[str] | None = None,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    relay_url: str | None = None,
    issuer: Identity | None = None,
) -> Iterator[Cluster]:
    """Start a relay (when needed) and one node process per range; stop them all on exit.

    ``prefix``/``hosts`` run node i under a command prefix (``ip netns exec H``) bound to
    an address; ``relay_url_for`` gives each node the relay URL it can reach; ``env`` is
    added to the nodes' environment; ``relay_url`` names a relay someone else runs (none
    is started then); ``issuer`` signs the tickets the nodes trust (a fresh key when None);
    ``extra`` flags go to every node, ``head_extra`` to the first (``--draft MODEL``).
    """
    issuer = issuer or Identity.generate()
    key = issuer.node_id.hex()
    relay = relay_info = None
    processes: list[ManagedProcess] = []
    try:
        if relay_url is not None:
            relay_info = RelayReady(url=relay_url, port=0, pid=0, http="")
        elif relay_only or with_relay:
            relay = ManagedProcess(
                "relay",
                ["relay", "--listen", f"{relay_host}:0", "--issuer-key", key, "--http", f"{relay_host}:0"],
                prefix=relay_prefix,
            )
            relay_info = expect(relay.start(), RelayReady)
        ranges = list(itertools.pairwise(cuts))
        for i, (a, b) in enumerate(ranges):
            host = hosts[i] if hosts else "127.0.0.1"
            # as `up` does: every core, and co-located nodes take turns on them (engine.cores);
            # a node run under a taskset prefix has fewer: pass `threads` for it
            share = threads or len(machine_cores())
            args = [
                "up",
                "--model",
                str(model),
                "--layers",
                f"{a}:{b}",
                "--data-dir",
                str(data_root / f"node{i}"),
                "--issuer-key",
                key,
                "--slots",
                str(slots),
                "--ctx",
                str(ctx),
                "--http",
                f"{host}:0",
                "--threads",
                str(share),
                *extra,
                *(head_extra if i == 0 else ()),
            ]
            if i not in relay_only:
                args += ["--listen", f"{host}:0"]
            if relay_info is not None:
                args += ["--relay", relay_url_for[i] if relay_url_for else relay_info.url]
            if i in tls:
                args += ["--tls-self-signed"]
            processes.append(ManagedProcess(f"node{i}", args, env=env, prefix=prefix[i] if prefix else ()))
        infos = [expect(line, NodeReady) for line in start_all(processes)]
        hops = tuple(info.hop() for info in infos)
        cluster = Cluster(issuer, processes, infos, relay, relay_info, hops)
        yield cluster
    finally:
        stop_all([*([relay] if relay is not None else []), *processes])
