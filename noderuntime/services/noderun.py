"""Running processes: a shard node (``noderuntime up --model ...``) and a gateway (``noderuntime gateway``).

Each prints its ready line (:mod:`noderuntime.services.ready`) when it serves (with its
node id, address and ports), runs until SIGINT or SIGTERM, then drains: sessions end
with an error frame to their peers, KV is released, listeners close.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from noderuntime.access import identity, known_trackers
from noderuntime.access.known_trackers import KnownTrackers
from noderuntime.access.signing import join_proof
from noderuntime.access.tickets import TicketVerifier
from noderuntime.control import admission
from noderuntime.control.ledger import Ledger
from noderuntime.engine import memplan
from noderuntime.engine.backends import BackendMismatchError, parse_device
from noderuntime.engine.base import EngineError
from noderuntime.engine.cores import CoreTurns, machine_cores
from noderuntime.engine.llama import (
    Recipe,
    ShardEngine,
    build_info,
    describe_device,
    flash_attn_choice,
    kernel_class,
    pinned_cores,
)
from noderuntime.engine.thread import EngineThread
from noderuntime.models import artifacts
from noderuntime.models.artifacts import LayerRange
from noderuntime.node.core import Node, NodeConfig
from noderuntime.node.draftmodel import DraftModel
from noderuntime.operations.connections import CONNECTIONS_PER_HOST
from noderuntime.operations.httpserve import Routes, json_handler, serve_http
from noderuntime.operations.telemetry import trio_tasks
from noderuntime.seams.network import NetworkConnector, ticket_check
from noderuntime.services.ready import GatewayReady, NodeReady
from noderuntime.services.rebalancing import Mover, NodeSwitch, Rebalancing, serving
from noderuntime.services.running import run_main, server_tls
from noderuntime.tracker import shapes
from noderuntime.tracker.client import NodeLoad
from noderuntime.tracker.messages import Registration, ShapeProof
from noderuntime.tracker.roundtrips import RoundTrips, measure_round_trips
from noderuntime.tracker.trackers import TrackerLinks, first_issuer_keys
from noderuntime.transport.grpc import AsyncioThread, GrpcConnector, GrpcServer, parse_address
from noderuntime.transport.relay_client import RelayDialer, RelayListener
from noderuntime.transport.sealed import accept_sealed
from protocol import Hop, Limits, Span
from protocol.channel import sealed_size

log = logging.getLogger(__name__)


@attrs.frozen
class NodeOptions:
    """Everything ``noderuntime up`` needs to run one shard node."""

    model: Path
    layers: LayerRange | None
    listen: str | None  # HOST:PORT of the gRPC listener; None for a relay-only node
    data_dir: Path
    issuer_keys: tuple[bytes, ...]
    advertise: str | None = None
    relay: str | None = None
    threads: int = attrs.Factory(lambda: len(machine_cores()))  # every core this process may run on
    # take turns on this machine's cores with the other nodes on it (engine.cores); off
    # for a node whose cores are its own (pinned apart from every other node's)
    share_cores: bool = True
    slots: int = 8
    ctx_per_session: int = 2048
    batch: int = 512
    flash_attn: str = "auto"  # on, off, or auto: the device's default (Recipe)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    idle_timeout: float = 60.0
    hang_timeout: float = 2.0
    drain_timeout: float = 10.0  # seconds a leaving node waits for its sessions to be handed over
    # bytes of finished sessions' KV kept for sessions that begin alike; None: memplan.prefix_cache_size decides
    prefix_cache: int | None = None
    expected_fingerprint: str | None = None
    # register with each of these trackers, and trust their issuer keys unless issuer_keys were given
    trackers: tuple[str, ...] = ()
    # keys given for trackers (--tracker-key), by URL: pinned in the data directory in place of any other
    tracker_keys: tuple[tuple[str, bytes], ...] = ()
    http: str | None = "127.0.0.1:0"  # status (and metrics) endpoint
    memory_limit: int | None = None  # bytes: refuse a shard that would not fit, load weights unmapped
    mmap: bool = True  # map the model file (pages shared with the page cache) or read the shard's weights
    rebalancing: Rebalancing | None = None  # a node the tracker placed: how it re-plans (None: pinned)
    backend: str = "llama.cpp"  # or "transformers": a safetensors directory run by torchengine
    device: str = "cpu"  # where the layers and KV live: "cpu", "vulkan:0", "cuda:1", ... (Recipe.device)
    gpu_layers: int | None = None  # on a GPU, how many local layers it holds (None: all)
    join_secret: bytes | None = None  # a private swarm's: its proof goes with each registration
    # seams unsealed, in and out, direct and relayed: only to measure what sealing costs, every peer started so
    insecure_plaintext_seams: bool = False
    # a small whole model of the same vocabulary that drafts for the routes this node heads (node.draftmodel)
    draft: Path | None = None
    # what that model holds (memplan.draft_needs; set by services.joining): the shard is planned beside it
    draft_bytes: int = 0
    # decode windows that may follow one in flight through this node (node/windows.py; 0: one at a time)
    windows_ahead: int = 3

    @property
    def shard_memory_limit(self) -> int | None:
        """What the shard may hold of :attr:`memory_limit` (None: no limit): the rest is the draft model's."""
        return None if self.memory_limit is None else self.memory_limit - self.draft_bytes

    @property
    def tracker(self) -> str | None:
        """The first of the trackers, the one asked first (None without any)."""
        return self.trackers[0] if self.trackers else None


async def run_node(
    opts: NodeOptions,
    *,
    task_status: trio.TaskStatus[NodeReady] = trio.TASK_STATUS_IGNORED,
    on_node: Callable[[Node], None] | None = None,
) -> None:
    """Serve one shard until cancelled.

    Long, for a reason: the engine, its thread, the gRPC runtime, server and connector and
    the node's tasks are opened in order here and closed in reverse in this one ``finally``,
    where a reader can check that each is closed once, whatever failed.
    """
    if opts.listen is None and opts.relay is None:
        raise ValueError("a node needs --listen, --relay, or both")
    me = identity.load_or_create(opts.data_dir)
    issuer_keys = opts.issuer_keys
    tracker_keys: dict[str, bytes] = {}
    # each tracker must show the key pinned for it (at first contact, or by --tracker-key)
    pins = KnownTrackers.in_data_dir(opts.data_dir, dict(opts.tracker_keys))
    if opts.trackers and not issuer_keys:
        # the keys of those that answer now (one at least); the others' once they answer (TrackerLinks)
        tracker_keys = await first_issuer_keys(opts.trackers, pins)
        issuer_keys = tuple(dict.fromkeys(tracker_keys.values()))
    # bad certificate files fail here, before the model loads
    tls = server_tls(opts.tls_cert, opts.tls_key) if opts.tls_cert and opts.tls_key else None
    pin = identity.TlsFiles(opts.tls_cert, opts.tls_key).cert_sha256 if opts.tls_cert and opts.tls_key else b""
    # every call that touches the engine runs on this one thread (see engine.thread); on
    # the CPU each call holds the turn on this process's cores (see engine.cores)
    turns = None
    if opts.share_cores and opts.device == "cpu" and opts.backend == "llama.cpp":
        turns = await trio.to_thread.run_sync(CoreTurns)  # opens a file per core
    engine_thread = EngineThread(turns=turns)
    draft_engine: ShardEngine | None = None
    draft_model: DraftModel | None = None
    try:
        if opts.draft is not None:  # first: a draft model that cannot draft for this one fails at once
            recipe = node_recipe(opts)
            cores = pinned_cores(recipe.n_threads, machine_cores())
            draft_engine, draft_model = await load_draft(opts.model, opts.draft, recipe, engine_thread, cores=cores)
        info, recipe, layers, engine, prefix_cache = await _load_engine(opts, engine_thread)
    except BaseException:
        if draft_engine is not None:
            draft_engine.close()
        engine_thread.close()
        raise
    try:
        # timed before the node admits anything: the shard has the cores to itself
        capability = await engine_thread.run(functools.partial(admission.measure, engine))
    except BaseException:
        engine.close()
        if draft_engine is not None:
            draft_engine.close()
        engine_thread.close()
        raise
    log.info(
        "measured layers %s: prefill %.2f ms/token, decode %s",
        layers,
        capability.prefill_ms_per_token,
        ", ".join(f"{t:.2f} ms at batch {b}" for b, t in capability.decode_ms),
    )
    limits = Limits()
    runtime = AsyncioThread()
    # every frame goes sealed, a little larger than itself (protocol.channel.sealed_size)
    grpc_connector = GrpcConnector(runtime, max_frame_bytes=sealed_size(limits.max_frame_bytes))
    server: GrpcServer | None = None
    switch: NodeSwitch | None = None
    try:
        async with trio.open_nursery() as nursery:
            verifier = TicketVerifier(issuer_keys)
            keys = identity.channel_keys(me)
            config = NodeConfig(
                layers=Span(layers.start, layers.end),
                n_layer=info.n_layer,
                artifact_fingerprint=bytes.fromhex(info.fingerprint),
                recipe_fingerprint=bytes.fromhex(recipe.fingerprint(info.quant)),
                n_slots=opts.slots,
                ctx_per_seq=opts.ctx_per_session,
                max_batch_tokens=opts.batch,
                prefill_chunk=min(256, opts.batch),
                idle_timeout=opts.idle_timeout,
                hang_timeout=opts.hang_timeout,
                prefix_cache_bytes=prefix_cache,
                limits=limits,
                max_ahead=opts.windows_ahead,
            )
            node = Node(
                engine,
                config,
                me.node_id,
                NetworkConnector(
                    grpc_connector,
                    RelayDialer(nursery, keys, plaintext=opts.insecure_plaintext_seams),
                    keys,
                    opts.insecure_plaintext_seams,
                ),
                ticket_check=ticket_check(verifier, me.node_id),
                signer=lambda body: me.sign(b"noderuntime-usage-v1", body),
                engine_thread=engine_thread,
                draft_model=draft_model,
            )
            node.capability = capability.to_json()
            switch = NodeSwitch(node, engine)  # a move (services.rebalancing) gives it another node
            await nursery.start(switch.serve, node)
            address = ""
            if opts.listen is not None:
                host, port = parse_address(opts.listen, listen=True)
                accept = switch.accept if opts.insecure_plaintext_seams else accept_sealed(switch.accept, keys)
                server = GrpcServer(runtime, accept, max_frame_bytes=sealed_size(limits.max_frame_bytes))
                bound = await server.start(host, port, tls)
                address = opts.advertise or f"{host}:{bound}"
            listener: RelayListener | None = None
            if opts.relay is not None:
                listener = RelayListener(opts.relay, me, switch.accept, plaintext=opts.insecure_plaintext_seams)
                await nursery.start(listener.run)
            http_url = ""
            if opts.http is not None:
                status = node_status(switch, me.node_id, listener, node.connector, device=opts.device)
                routes = Routes(
                    {"/status": json_handler(status), "/metrics": node.metrics_exposition},
                    {"/probe": probe_handler(switch)},
                )
                http_url = await nursery.start(serve_http, routes, opts.http)
            # what the tracker and the ready line are told of this node
            shown = NodeReady(
                node_id=me.node_id.hex(),
                artifact=info.fingerprint,
                n_layer=info.n_layer,
                layers=(layers.start, layers.end),
                recipe=recipe.fingerprint(info.quant),
                address=address,
                relay=opts.relay or "",
                tls_cert_sha256=pin.hex(),
                slots=opts.slots,
                ctx_per_session=opts.ctx_per_session,
                pid=os.getpid(),
                http=http_url,
                capability=capability.to_json(),
                device=opts.device,
                model_name=info.name,
                kernel_class=kernel_class(opts.device) if opts.backend == "llama.cpp" else "",
            )
            if opts.trackers:
                record = admission.capability_record(
                    me,
                    artifact=info.fingerprint,
                    layers=(layers.start, layers.end),
                    recipe=recipe.fingerprint(info.quant),
                    capability=capability,
                )
                registration = Registration.of(shown, record)
                shape = await trio.to_thread.run_sync(shape_proof, info)
                if shape is not None:
                    registration = registration.model_copy(update={"shape": shape})
                if opts.join_secret is not None:
                    proof = join_proof(opts.join_secret, me.node_id)
                    registration = registration.model_copy(update={"join_proof": proof})

                async def answer_probe(seed: int) -> dict[str, Any]:
                    return (await node.probe(seed)).to_json()

                round_trips = RoundTrips()
                nursery.start_soon(measure_round_trips, round_trips, functools.partial(next_hops, switch))
                load = node_load(switch, round_trips)
                links = TrackerLinks(
                    opts.trackers,
                    me,
                    registration,
                    load,
                    on_probe=answer_probe,
                    verifier=None if opts.issuer_keys else verifier,
                    trusted=tracker_keys,
                    pins=pins,
                )
                await nursery.start(links.run)  # registered with one tracker; the others' links keep trying
                node.on_leave.append(links.leave)
                node.leases.on_free.append(links.slot_freed)
                node.leases.on_refused.append(links.slot_refused)
            if on_node is not None:
                on_node(node)
            pid_file = opts.data_dir / PID_FILE
            pid_file.write_text(f"{os.getpid()}\n")
            task_status.started(shown)
            log.info(
                "node %s serving layers %s of %s at %s%s",
                me.node_id.hex()[:12],
                layers,
                info.name,
                address or "(no direct address)",
                f" and through {opts.relay}" if opts.relay else "",
            )
            if opts.rebalancing is not None and opts.trackers:
                mover = Mover(
                    opts.rebalancing,
                    me,
                    switch,
                    links.links,
                    load=functools.partial(_load_range, opts, engine_thread),
                    model=opts.model,
                    expected=opts.expected_fingerprint,
                    recipe=recipe,
                    engine_thread=engine_thread,
                    nursery=nursery,
                    memory_limit=opts.shard_memory_limit,
                    drain_timeout=opts.drain_timeout,
                    on_node=on_node,
                )
                nursery.start_soon(mover.run)
    finally:
        with trio.CancelScope(shield=True):
            if server is not None:
                await server.close()
            await grpc_connector.close()
        runtime.close()
        if switch is not None:
            switch.close()  # the engines moves loaded
        engine.close()
        if draft_engine is not None:
            draft_engine.close()
        engine_thread.close()
        (opts.data_dir / PID_FILE).unlink(missing_ok=True)


PID_FILE = "node.pid"  # in the data directory while the node runs: `noderuntime down` reads it


async def _load_range(
    opts: NodeOptions, engine_thread: EngineThread, layers: LayerRange, model: Path, expected: str | None
) -> tuple[artifacts.ArtifactInfo, Any, Any, Any, int]:
    """What :func:`_load_engine` loads for ``layers`` of ``model``: a placed node's move (services.rebalancing)."""
    moved = attrs.evolve(opts, layers=layers, model=model, expected_fingerprint=expected)
    return await _load_engine(moved, engine_thread)


async def _load_engine(
    opts: NodeOptions, engine_thread: EngineThread
) -> tuple[artifacts.ArtifactInfo, Any, Any, Any, int]:
    """(the model file's info, the recipe, the layers, the engine, the prefix cache's bytes), loaded on
    ``engine_thread``.

    With ``--memory-limit``, and on a GPU always, the plan is checked first: a shard that
    cannot fit is refused before anything is allocated.
    """
    if opts.backend == "transformers":
        info, recipe, engine = await engine_thread.run(functools.partial(_torch_engine, opts))
        return info, recipe, engine.layers, engine, 0  # it cannot save a sequence
    # hashes every tensor of a file it has not seen (seconds for an 8B model): off the trio thread
    info = await trio.to_thread.run_sync(artifacts.inspect, opts.model)
    layers = opts.layers or info.layer_range
    if opts.device != "cpu":
        # ggml asks the driver (for CUDA, the first call sets up its context): off the trio thread
        described = await trio.to_thread.run_sync(check_device, opts.device)
        log.info("layers %s on %s: %s", layers, opts.device, described)
    recipe = node_recipe(opts)
    # a shard on a GPU is always planned against the memory its device has free
    budget = await trio.to_thread.run_sync(memplan.device_budget, recipe, opts.shard_memory_limit)
    prefix_cache = await trio.to_thread.run_sync(
        lambda: memplan.prefix_cache_size(opts.model, layers, recipe, budget, opts.prefix_cache)
    )
    if budget.host is not None or budget.device is not None:
        try:
            planned = await trio.to_thread.run_sync(
                lambda: memplan.check(opts.model, layers, recipe, budget, prefix_cache)
            )
        except memplan.MemoryLimitError as exc:
            if not opts.draft_bytes or opts.memory_limit is None:
                raise
            beside = f"--draft {opts.draft} holds {memplan.human(opts.draft_bytes)} of --memory-limit"
            raise memplan.MemoryLimitError(
                f"{exc} ({beside} {memplan.human(opts.memory_limit)})", exc.needs, exc.fitting
            ) from None
        limits = [f"{memplan.human(budget.host)} host limit"] if budget.host is not None else []
        limits += [f"{memplan.human(budget.device)} free on {opts.device}"] if budget.device is not None else []
        log.info("layers %s will hold %s, within the %s", layers, planned.describe(), " and ".join(limits))
    # one thread to a core where the team has a thread for each (see engine.llama.pinned_cores)
    cores = pinned_cores(recipe.n_threads, machine_cores()) if opts.device == "cpu" else None
    engine = await engine_thread.run(
        lambda: ShardEngine(opts.model, recipe, layers, expected_fingerprint=opts.expected_fingerprint, cores=cores)
    )
    return info, recipe, layers, engine, prefix_cache


async def load_draft(
    model: Path, draft: Path, recipe: Recipe, engine_thread: EngineThread, *, cores: Sequence[int] | None
) -> tuple[ShardEngine, DraftModel]:
    """The engine and drafter of ``draft`` (``--draft``), loaded whole on ``engine_thread`` with
    the node's recipe (a sequence for each of its slots, as long as theirs) and its team on
    ``cores`` (None: unpinned); :class:`EngineError` where its vocabulary is not that of
    ``model``, which would make every draft a wrong one."""
    ours, theirs = await trio.to_thread.run_sync(
        lambda: (artifacts.vocabulary_digest(model), artifacts.vocabulary_digest(draft))
    )
    if ours != theirs:
        raise EngineError(f"--draft {draft}: its vocabulary is not that of {model}; a draft model must share it")
    engine = await engine_thread.run(lambda: ShardEngine(draft, recipe, None, cores=cores))
    try:
        # what a draft costs, before any session has timed its own: the policy weighs windows with it
        measured = await engine_thread.run(functools.partial(admission.measure, engine))
        drafter = DraftModel(
            engine,
            engine_thread.run,
            n_seq=recipe.n_seq_max,
            n_ctx_per_seq=recipe.n_ctx_per_seq,
            n_batch=recipe.n_batch,
            seconds_per_draft=measured.decode_ms[0][1] / 1e3,
        )
    except BaseException:
        engine.close()
        raise
    log.info(
        "drafting with %s (%s, %d layers): %.2f ms a draft",
        engine.info.name,
        draft,
        engine.info.n_layer,
        drafter.seconds_per_draft * 1e3,
    )
    return engine, drafter


def shape_proof(info: artifacts.ArtifactInfo) -> ShapeProof | None:
    """The proof of the model's shape the tracker takes on registration (``tracker.shapes``): the layer
    count then comes from the artifact, not from a vote of its nodes. None, with a warning, where the file
    cannot give one (a model in gguf-split parts, a proof larger than a registration may carry).

    Sent with every registration: 18 KB for the 30-layer SmolLM2, about 17 KB for an 8B Llama (its
    tensor digests are most of it); a tracker that knows the shape already only compares the count.
    """
    try:
        proof = shapes.prove(*artifacts.identity(info.path))
        shapes.proven_layers(info.fingerprint, proof)  # as the tracker checks it: a model in parts fails here
        return proof
    except (artifacts.ArtifactError, shapes.ShapeError) as exc:
        log.warning("no proof of the model's shape for the tracker (%s): it takes the count nodes report", exc)
        return None


def node_recipe(opts: NodeOptions) -> Recipe:
    """The llama.cpp recipe a node of ``opts`` runs (weights read, not mapped, under a memory limit)."""
    recipe = Recipe(
        n_threads=opts.threads,
        n_ctx_per_seq=opts.ctx_per_session,
        n_seq_max=opts.slots,
        n_batch=opts.batch,
        n_ubatch=opts.batch,
        flash_attn=flash_attn_choice(opts.flash_attn, opts.device),
        use_mmap=opts.mmap,
        device=opts.device,
        gpu_layers=opts.gpu_layers,
    )
    return memplan.capped(recipe) if opts.memory_limit is not None else recipe


def check_device(device: str) -> str:
    """The description of ``device``, once this process's llama.cpp is its backend's build and sees it.

    A node on a GPU runs with that backend's build (``noderuntime up`` re-executes itself
    with it); anything else is a typed error before the model loads:
    :class:`BackendMismatchError`, or :class:`NoDeviceError` for an index that is not there.
    """
    kind, _index = parse_device(device)
    loaded = build_info()["backend"]
    if loaded != kind:
        raise BackendMismatchError(
            f"device {device} needs the {kind} build of llama.cpp, and this node loaded the {loaded} build "
            f"(run it as `noderuntime up --device {device} ...`, which starts it on that build)"
        )
    return describe_device(device)


def _torch_engine(opts: NodeOptions) -> tuple[artifacts.ArtifactInfo, Any, Any]:
    """The Transformers engine of ``opts`` (torch loads only for nodes that ask for it)."""
    from noderuntime.engine.torch_backend import TorchEngine, TorchRecipe

    recipe = TorchRecipe(
        n_threads=opts.threads, n_ctx_per_seq=opts.ctx_per_session, n_seq_max=opts.slots, n_batch=opts.batch
    )
    engine = TorchEngine(opts.model, recipe, opts.layers, expected_fingerprint=opts.expected_fingerprint)
    return engine.info, recipe, engine


def node_load(node: Node | NodeSwitch, round_trips: RoundTrips | None = None) -> Callable[[], NodeLoad]:
    """What a node reports in its heartbeats (``round_trips``: those it measured to its peers)."""

    def load() -> NodeLoad:
        stats = serving(node).statistics()
        return NodeLoad(
            active_sessions=stats.active_sessions,
            free_slots=stats.leases.slots_free,
            queue_depth=stats.batcher.waiting,
            step_ms=round(stats.batcher.recent_tick_seconds * 1e3, 3),
            round_trips=round_trips.snapshot() if round_trips is not None else {},
            sessions_opened=stats.sessions_opened,
        )

    return load


def next_hops(node: Node | NodeSwitch) -> list[Hop]:
    """The next hops of the node's route sessions now: the peers whose round trips it measures."""
    return [session.next_hop for session in list(serving(node).sessions.values()) if session.next_hop is not None]


def probe_handler(node: Node | NodeSwitch) -> Any:
    """``GET /probe?seed=N``: any peer may check this shard against a reference it holds."""

    async def handle(query: dict[str, str]) -> tuple[int, str, bytes]:
        try:
            seed = int(query.get("seed", ""))
            answer = await serving(node).probe(seed, patience=5.0)
        except ValueError as exc:  # AdmissionError too
            return 400, "application/json", json.dumps({"error": str(exc) or "seed must be an integer"}).encode()
        return 200, "application/json", json.dumps(answer.to_json()).encode()

    return handle


def _draft_status(model: DraftModel | None) -> dict[str, Any] | None:
    """What ``/status`` shows of a node's draft model (``up --draft``); None without one."""
    if model is None:
        return None
    return {"drafted": model.drafted, "refused": model.failures, "ms_a_draft": round(model.seconds_per_draft * 1e3, 3)}


def node_status(
    switch: Node | NodeSwitch, node_id: bytes, listener: RelayListener | None, connector: Any, *, device: str = "cpu"
) -> Any:
    """The producer of a node's ``/status`` document."""

    grpc = getattr(connector, "grpc", None)  # a relay-only node has none

    async def status() -> dict[str, Any]:
        node = serving(switch)
        stats = node.statistics()
        return {
            "node_id": node_id.hex(),
            "layers": [node.config.layers.start, node.config.layers.end],
            "capability": node.capability,
            "tasks": trio_tasks(),
            "artifact": node.config.artifact_fingerprint.hex(),
            "recipe": node.config.recipe_fingerprint.hex(),
            "device": device,
            "active_sessions": stats.active_sessions,
            "slots_total": stats.leases.slots_total,
            "slots_leased": stats.leases.slots_leased,
            "slots_draining": stats.leases.slots_draining,
            "slots_free": stats.leases.slots_free,
            "kv_cells": await node.kv_cells_used(),
            "samplers_live": node.engine.live_samplers,
            "sessions_opened": stats.sessions_opened,
            "sessions_ended": stats.sessions_ended,
            "admissions_refused": stats.admissions_refused,
            "batcher": attrs.asdict(stats.batcher),
            "relay_connected": listener.connected if listener is not None else None,
            "prefix_cache": attrs.asdict(node.prefix_cache.statistics()) if node.prefix_cache is not None else None,
            "draft_model": _draft_status(node.draft_model),
            "seams": {
                "direct": getattr(connector, "direct_attempts", 0),
                "relay": getattr(connector, "relay_attempts", 0),
                "fallbacks": getattr(connector, "fallbacks", 0),
                "spares": getattr(grpc, "spares", 0),
                "dead_spares_dropped": getattr(grpc, "spares_dropped", 0),
            },
        }

    return status


def main_node(opts: NodeOptions) -> int:
    """Run a node in this process until a signal; the exit status.

    The first SIGTERM (or SIGINT, or ``noderuntime down``) drains it: the tracker stops
    routing to it, every live session's neighbours are told to go on without it (they
    repair the route around it), and it exits once its sessions ended or after
    ``drain_timeout``; a second signal stops it at once.
    """
    running: list[Node] = []

    async def drain() -> None:
        with trio.move_on_after(opts.drain_timeout):
            if running:
                await running[-1].drain()  # the node serving now: a move adds one

    return run_main(functools.partial(run_node, opts, on_node=running.append), drain=drain)


__all__ = ["GatewayOptions", "NodeOptions", "main_node", "run_gateway", "run_node"]


@attrs.frozen
class GatewayOptions:
    """What ``noderuntime gateway`` needs."""

    trackers: tuple[str, ...]  # in order of preference: each request goes to the first that answers
    listen: str
    models: tuple[tuple[str, Path], ...]  # (model id, GGUF file holding its vocabulary)
    api_keys: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    tracker_api_key: str | None = None  # the bearer key route requests carry (the trackers' --api-key)
    # where the trackers' keys are pinned (known_trackers); None: in memory, for this process only
    data_dir: Path | None = None
    tracker_keys: tuple[tuple[str, bytes], ...] = ()  # given by --tracker-key, by URL
    request_timeout: float = 600.0
    ctx: int | None = None
    queue_timeout: float = 10.0
    queue_limit: int = 256  # requests waiting for a slot, in all (runner/line.py)
    queue_per_key: int = 64  # of them, under one API key
    running_per_key: int = 256  # sessions one API key (or client address) runs at once
    ledger: Path | None = None
    audit_rate: float = 0.0  # the share of sessions audited after they end (runner/audits.py)
    speculate: int = 8  # drafted tokens a route's decode window may carry (node/drafting.py; 0: none)
    insecure_plaintext_seams: bool = False  # as NodeOptions': seams to heads unsealed
    connections_per_host: int = CONNECTIONS_PER_HOST  # HTTP connections one address may hold open (0: any)


async def run_gateway(
    opts: GatewayOptions, *, task_status: trio.TaskStatus[GatewayReady] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve the OpenAI-compatible gateway until cancelled."""
    import time

    from noderuntime.engine.llama import Vocab
    from noderuntime.gateway.app import Gateway
    from noderuntime.gateway.served import ServedModel
    from noderuntime.models.chat import ChatTemplate
    from noderuntime.seams.dialer import open_dialer

    served = []
    for model_id, path in opts.models:
        info = await trio.to_thread.run_sync(artifacts.inspect, path)  # hashes the file once: off the trio thread
        vocab = await trio.to_thread.run_sync(Vocab, path)
        template = None
        if vocab.chat_template:
            bos = vocab.piece(vocab.bos, special=True).decode("utf-8", "replace") if vocab.bos >= 0 else ""
            eos = vocab.piece(vocab.eos, special=True).decode("utf-8", "replace") if vocab.eos >= 0 else ""
            template = ChatTemplate(vocab.chat_template, bos_token=bos, eos_token=eos)
        served.append(
            ServedModel(model_id, info.fingerprint, vocab, template, int(time.time()), opts.ctx or info.context_length)
        )
    me = identity.Identity.generate()  # the key its tickets name and its repairs are signed with
    async with (
        open_dialer(identity=me, plaintext=opts.insecure_plaintext_seams) as dialer,
        trio.open_nursery() as nursery,
    ):
        gateway = Gateway(
            served,
            opts.trackers,
            dialer,
            api_keys=opts.api_keys,
            cors_origins=opts.cors_origins,
            tracker_api_key=opts.tracker_api_key,
            tracker_pins=KnownTrackers(
                opts.data_dir / known_trackers.FILE if opts.data_dir is not None else None, dict(opts.tracker_keys)
            ),
            request_timeout=opts.request_timeout,
            queue_timeout=opts.queue_timeout,
            queue_limit=opts.queue_limit,
            queue_per_key=opts.queue_per_key,
            max_running_per_key=opts.running_per_key,
            ledger=Ledger(opts.ledger) if opts.ledger else None,
            identity=me,
            audit_rate=opts.audit_rate,
            speculate=opts.speculate,
        )
        nursery.start_soon(gateway.runner.audits.run)
        url = await nursery.start(
            functools.partial(serve_http, gateway.app, opts.listen, per_host=opts.connections_per_host)
        )
        task_status.started(GatewayReady(url=url, models=tuple(m.model_id for m in served), pid=os.getpid()))
        log.info("gateway at %s serving %s", url, ", ".join(m.model_id for m in served))
