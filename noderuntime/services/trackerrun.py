"""The tracker's process (``noderuntime tracker``): runs from the light install (no engine)."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import trio

from noderuntime.access import identity
from noderuntime.control import admission
from noderuntime.models.manifest import Manifest
from noderuntime.operations.connections import CONNECTIONS_PER_HOST
from noderuntime.operations.httpserve import serve_http
from noderuntime.services.ready import TrackerReady
from noderuntime.tracker.records import HEARTBEAT_SECONDS
from noderuntime.verify.certificates import CoveredPair

log = logging.getLogger(__name__)


async def run_tracker(
    listen: str,
    data_dir: Path,
    *,
    api_key: str | None = None,
    expire_after: float = 10.0,
    heartbeat_seconds: float = HEARTBEAT_SECONDS,
    route_rate: float = 50.0,
    route_burst: int = 200,
    route_concurrency: int = 4096,
    referees: Sequence[bytes] = (),
    allow_nodes: Sequence[bytes] = (),
    join_secret: bytes | None = None,
    probe_references: tuple[Path, ...] = (),
    require_probe: bool = False,
    probe_interval: float = 600.0,
    probe_tolerance: float = admission.DEFAULT_TOLERANCE,
    mixes: Sequence[CoveredPair] = (),
    manifests: Sequence[Manifest] = (),  # served to nodes that fetch only their layers
    status_key: str | None = None,
    local_swarm: bool = False,
    connections_per_host: int = CONNECTIONS_PER_HOST,
    task_status: trio.TaskStatus[TrackerReady] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a tracker until cancelled; ``mixes`` are the recipe pairs certified to share routes;
    ``status_key``, when given, is needed to read the swarm map and the node lists; ``referees``: the nodes
    whose re-execution may confirm an audit; ``local_swarm``: nodes may register loopback and private
    addresses, and its tickets let them be dialled (see :class:`~noderuntime.tracker.app.Tracker`);
    ``connections_per_host``: see :func:`~noderuntime.operations.httpserve.serve_http`."""
    from noderuntime.tracker.app import Tracker

    tracker_identity = identity.load_or_create(data_dir)
    references = admission.ProbeReferences.load(probe_references)
    tracker = Tracker(
        tracker_identity,
        expire_after=expire_after,
        heartbeat_seconds=heartbeat_seconds,
        route_rate=route_rate,
        route_burst=route_burst,
        route_concurrency=route_concurrency,
        referees=referees,
        allow_nodes=allow_nodes,
        join_secret=join_secret,
        api_key=api_key,
        references=references,
        require_probe=require_probe,
        probe_interval=probe_interval,
        probe_tolerance=probe_tolerance,
        mixes=mixes,
        manifests=manifests,
        status_key=status_key,
        local_swarm=local_swarm,
    )
    for signed in manifests:
        log.info(
            "serving the manifest of %s (%s), signed by %s", signed.artifact[:12], signed.name, signed.publisher[:12]
        )
    for pair in mixes:
        log.info(
            "routes may mix recipes %s and %s of %s (certified)", pair.cpu_recipe, pair.gpu_recipe, pair.artifact[:12]
        )
    if allow_nodes or join_secret is not None:
        secret = ", and holders of the join secret" if join_secret is not None else ""
        log.info("a private swarm: %d node(s) allow-listed%s", len(allow_nodes), secret)
    if local_swarm:
        log.warning("a local swarm: nodes may register loopback and private addresses, and are dialled there")
    for referee in referees:
        log.info("referee %s may confirm audits", referee.hex()[:12])
    if probe_references:
        log.info("probe references: %d answers from %d file(s)", len(references), len(probe_references))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(tracker.expire_loop)
        url = await nursery.start(functools.partial(serve_http, tracker.app, listen, per_host=connections_per_host))
        task_status.started(TrackerReady(url=url, issuer_key=tracker_identity.node_id.hex(), pid=os.getpid()))
        log.info("tracker at %s, issuer key %s", url, tracker_identity.node_id.hex())
