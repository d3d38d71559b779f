"""How ``noderuntime up --model`` starts a shard node: where it serves, what it fetches, and leaving.

:func:`main` conducts a node's start from its :class:`JoinOptions`. A node given
``--layers`` (or a shard file, or no tracker) serves that range. One with a tracker and
none sizes its shard with the memory planner's dry run (:mod:`noderuntime.engine.memplan`):
the most layers ``k`` such that both the first ``k`` (with the token embedding) and the
last ``k`` (with the output head and its compute) fit its budget, so that any range of
``k`` layers does, with KV for its slots and context. The budget is ``--memory-limit``, or
a share of the memory free now, and on a GPU the memory the device has free. It then asks
the tracker where to serve (:mod:`noderuntime.tracker.placement`; of several ``--tracker``,
the first that answers), runs as if it had been given that range, re-plans now and then
(:mod:`noderuntime.services.rebalancing`), and frees the range at the tracker when it stops.
A model given by URL is sized from a copy of its header, and only the range served is
fetched (:mod:`noderuntime.models.fetch`).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import httpx
import psutil
import trio

from noderuntime.access.identity import Identity, load_or_create, self_signed
from noderuntime.access.signing import join_proof, sign
from noderuntime.engine import memplan
from noderuntime.engine.llama import Recipe
from noderuntime.models import fetch
from noderuntime.models.artifacts import ArtifactError, LayerRange, inspect
from noderuntime.services.noderun import NodeOptions, main_node, node_recipe
from noderuntime.services.rebalancing import REBALANCE_SECONDS, MoveError, Rebalancing
from noderuntime.tracker.client import LEAVE_SECONDS, TrackerError, request_placement
from noderuntime.tracker.messages import MAX_LAYERS, Leave, PlacementReply, PlacementRequest
from noderuntime.tracker.trackers import tracker_urls, unanswered

log = logging.getLogger(__name__)

FREE_SHARE = 0.8  # of the memory free now, what a node without a limit plans to hold: the rest for others
TRACKER_PATIENCE = 60.0  # seconds a joining node waits for an unreachable tracker


@attrs.frozen
class Placed:
    """The range the tracker gave a node, and how many layers it can hold (what it asks to move with)."""

    layers: LayerRange
    max_layers: int


class JoinError(Exception):
    """A node cannot be placed: it holds no layer, or the tracker refused or never answered."""


class OptionsError(Exception):
    """A node's options do not go together, or with its model: the message names the flag to change."""


@attrs.frozen
class JoinOptions:
    """What ``noderuntime up --model`` starts a shard node with (:func:`main`).

    ``node`` is the node as its flags give it; the join settles its layers (placed, when it
    has none and a tracker), its model file (fetched, for a URL), its TLS files (made, for
    ``tls_self_signed``) and how it re-plans. ``url``: the model's URL, of which only the
    range served is fetched, checked against the signed manifest at ``manifest`` (a file, a
    URL, or a tracker's URL; None: the node's first tracker), signed by ``publisher_key``,
    or by any key when ``trust_tracker_manifests`` (one of the two is required);
    ``node.model`` is then the folder the ranges are fetched into.
    ``max_layers``: a placed node holds at most this many; ``rebalance_every``: seconds
    between a placed node's questions whether to move (0: never).
    """

    node: NodeOptions
    url: str | None = None
    manifest: str | None = None
    publisher_key: bytes | None = None
    trust_tracker_manifests: bool = False
    max_layers: int | None = None
    rebalance_every: float = REBALANCE_SECONDS
    tls_self_signed: bool = False


def budget(recipe: Recipe, memory_limit: int | None, beside: int = 0) -> memplan.Budget:
    """What a joining node's shard may hold: ``memory_limit``, else :data:`FREE_SHARE` of the host memory
    free now, less ``beside`` (what the node holds besides: a draft model); on a GPU also the memory the
    device has free."""
    host = memory_limit if memory_limit is not None else int(psutil.virtual_memory().available * FREE_SHARE)
    # a draft model larger than the free memory leaves the shard nothing, not a negative budget
    return memplan.device_budget(recipe, max(0, host - beside))


def holdable(model: str | os.PathLike[str], recipe: Recipe, limit: memplan.Budget, prefix_cache: int = 0) -> int:
    """How many layers of the whole model ``model`` any range of which fits ``limit`` (0: not even one).

    The widest range from the first layer (it holds the token embedding), then the widest of
    at most that many ending at the last (the output head and the logits' compute buffer):
    a range between holds neither, and needs no more than these.
    """
    n = inspect(model, verify=False).n_layer
    head = memplan.widest_fit(model, 0, n, recipe, limit, prefix_cache)
    if head is None:
        return 0
    lo, hi = 0, len(head)  # the last lo layers fit; the last hi + 1 are more than the head's
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if limit.admits(memplan.needs(model, LayerRange(n - mid, n), recipe, prefix_cache)):
            lo = mid
        else:
            hi = mid - 1
    return lo


def describe(limit: memplan.Budget, device: str) -> str:
    """The budget in words, for messages."""
    parts = [f"{memplan.human(limit.host)} of host memory"] if limit.host is not None else []
    if limit.device is not None:
        parts.append(f"{memplan.human(limit.device)} free on {device}")
    return " and ".join(parts) or "no limit"


async def ask(
    trackers: str | Sequence[str],
    me: Identity,
    artifact: str,
    n_layer: int,
    max_layers: int,
    *,
    tokens_per_s: float | None = None,
    patience: float = TRACKER_PATIENCE,
    join_secret: bytes | None = None,
) -> PlacementReply:
    """The range the first of ``trackers`` (one URL, or several in order) that answers gives this node.

    While none answers they are tried again for ``patience`` seconds. :class:`JoinError` when the
    one that answers refuses, or none ever answers. ``join_secret``: a private swarm's, whose
    proof goes with the request (a secret-only tracker places no one without it).
    """
    asked = PlacementRequest(
        node_id=me.node_id.hex(),
        artifact=artifact,
        n_layer=n_layer,
        max_layers=min(max_layers, MAX_LAYERS),
        tokens_per_s=tokens_per_s,
        join_proof="" if join_secret is None else join_proof(join_secret, me.node_id),
    )
    deadline = trio.current_time() + patience
    failure = ""
    async with httpx.AsyncClient() as client:
        while True:
            for url in tracker_urls(trackers):
                try:
                    return await request_placement(client, url, me, asked)
                except TrackerError as exc:
                    if not unanswered(exc):
                        raise JoinError(str(exc)) from None
                    failure = str(exc)
                    log.warning("the tracker at %s cannot place this node now: %s", url, exc)
            if trio.current_time() >= deadline:
                raise JoinError(failure)
            await trio.sleep(1.0)


def release(trackers: str | Sequence[str], me: Identity) -> None:
    """Tell the ``trackers`` (each, at once) that this node leaves, so that the range one gave it is free at once.

    Bounded (:data:`LEAVE_SECONDS`) and quiet: a tracker that does not hear it lets the reservation lapse.
    """

    async def leave(url: str) -> None:
        path = "/v1/nodes/leave"
        data = Leave(node_id=me.node_id.hex()).model_dump_json().encode()
        headers = {"content-type": "application/json", **sign(me, "POST", path, data, int(time.time() * 1000))}
        with trio.move_on_after(LEAVE_SECONDS):
            async with httpx.AsyncClient() as client:
                try:
                    await client.post(url.rstrip("/") + path, content=data, headers=headers, timeout=LEAVE_SECONDS)
                except httpx.HTTPError as exc:
                    log.info("could not tell the tracker %s that this node leaves: %s", url, exc)

    async def leave_all() -> None:
        async with trio.open_nursery() as nursery:
            for url in tracker_urls(trackers):
                nursery.start_soon(leave, url)

    trio.run(leave_all)


def place(
    model: str | os.PathLike[str],
    recipe: Recipe,
    trackers: str | Sequence[str],
    me: Identity,
    *,
    memory_limit: int | None,
    prefix_cache: int | None,
    patience: float = TRACKER_PATIENCE,
    max_layers: int | None = None,
    join_secret: bytes | None = None,
    artifact: str | None = None,
    beside: int = 0,
) -> Placed:
    """The range a node of ``recipe`` should serve of the whole model ``model``, as the first of ``trackers``
    that answers gives it.

    ``model`` may be a copy of the model's header alone, when ``artifact`` names the artifact
    it is the header of (its manifest's); without ``artifact`` the file's fingerprint is
    taken, which reads every tensor once (then kept: :class:`artifacts.DigestCache`).
    ``prefix_cache``: the bytes the operator gave the prefix cache (None: the default, which
    under a memory limit takes only what the shard leaves); ``max_layers``: at most this many,
    whatever fits; ``join_secret``: a private swarm's, proved to its tracker; ``beside``: the bytes the
    node holds besides its shard (a draft model), out of its limit. With the range comes
    the count it was sized to, which a move asks with.
    """
    info = inspect(model, verify=False)
    if info.layer_range != LayerRange(0, info.n_layer):
        raise JoinError(f"{model} is a shard file of layers {info.layer_range}: it serves those, with --layers or not")
    if artifact is None:
        artifact = inspect(model).fingerprint
    limit = budget(recipe, memory_limit, beside)
    cache = (
        prefix_cache if prefix_cache is not None else 0 if memory_limit is not None else memplan.DEFAULT_PREFIX_CACHE
    )
    if limit.host is not None:
        # the planner counts the cache against the host only
        limit = memplan.Budget(host=max(1, limit.host - cache), device=limit.device)
    most = holdable(model, recipe, limit)
    if max_layers is not None:  # the operator's cap (--max-layers)
        most = min(most, max_layers)
    if most == 0:
        raise JoinError(
            f"not even one layer of {info.name} fits {describe(limit, recipe.device)} with {recipe.n_seq_max} "
            f"slots of {recipe.n_ctx_per_seq} tokens: lower --slots or --ctx, or raise --memory-limit"
        )
    log.info(
        "this node can hold %d of the %d layers of %s within %s; asking the tracker where",
        most,
        info.n_layer,
        info.name,
        describe(limit, recipe.device),
    )
    reply = trio.run(
        lambda: ask(trackers, me, artifact, info.n_layer, most, patience=patience, join_secret=join_secret)
    )
    start, end = reply.layers
    capacity = "nobody served it" if reply.weakest_capacity == 0 else f"{reply.weakest_capacity:.1f} tokens/s"
    log.info("the tracker placed this node on layers %d:%d, around layer %d (%s)", start, end, reply.weakest, capacity)
    return Placed(LayerRange(start, end), most)


def main(opts: JoinOptions) -> int:
    """Start the node of ``opts`` and serve until a signal; the exit status.

    A node the tracker places frees its range there when it stops: the tracker holds it for
    the node until it registers or leaves, and one that stops before it registered has not
    left. :class:`JoinError` when it cannot be placed, :class:`OptionsError` for options that
    cannot start it.
    """
    sizing = _sizing_file(opts)
    opts = with_draft_sized(opts, placing=sizing is not None)
    if sizing is None:
        return _serve(opts, opts.node.layers)
    node = opts.node
    sizing_path, artifact = sizing
    placed = place(
        sizing_path,
        node_recipe(node),
        node.trackers,
        load_or_create(node.data_dir),
        memory_limit=node.memory_limit,
        prefix_cache=node.prefix_cache,
        max_layers=opts.max_layers,
        join_secret=node.join_secret,
        artifact=artifact,
        beside=node.draft_bytes,
    )
    try:
        return _serve(opts, placed.layers, rebalancing=_rebalancing(opts, placed.max_layers))
    finally:
        # briefly: a tracker that does not answer lets the reservation lapse
        release(node.trackers, load_or_create(node.data_dir))


def with_draft_sized(opts: JoinOptions, *, placing: bool) -> JoinOptions:
    """``opts`` with what its draft model will hold (``--draft``), which its shard is planned beside:
    a node the tracker is ``placing`` asks for fewer layers, a node under ``--memory-limit`` plans its
    shard within what the draft model leaves of it. :class:`OptionsError` where the draft model alone
    takes all of it. Neither: nothing plans with it, and the draft model is not sized (a dry run)."""
    node = opts.node
    if node.draft is None or (node.memory_limit is None and not placing):
        return opts
    held = memplan.draft_needs(node.draft, node_recipe(node)).total
    if node.memory_limit is not None and held >= node.memory_limit:
        raise OptionsError(
            f"--draft {node.draft} alone holds {memplan.human(held)}, all of --memory-limit "
            f"{memplan.human(node.memory_limit)}: raise the limit, lower --slots or --ctx, or draft without it"
        )
    return attrs.evolve(opts, node=attrs.evolve(node, draft_bytes=held))


def _sizing_file(opts: JoinOptions) -> tuple[Path, str | None] | None:
    """What a node the tracker places sizes its shard by: the whole model's file, or a copy of the header
    of the model at its URL with the artifact its manifest names; None for a node that serves the range
    it was given (or its shard file's)."""
    node = opts.node
    if node.layers is not None or not node.trackers or node.backend != "llama.cpp":
        return None
    if opts.url is not None:
        copy = fetch.header_copy(
            opts.url,
            node.data_dir / "headers",
            _manifest_source(opts),
            publisher=opts.publisher_key,
            trust_source=opts.trust_tracker_manifests,
        )
        return copy.path, copy.artifact
    return (node.model, None) if node.model.is_file() and _whole(node.model) else None


def _whole(model: Path) -> bool:
    """Whether ``model`` holds every layer of its model (a shard file serves its own range, placed or not)."""
    info = inspect(model, verify=False)
    return info.layer_range == LayerRange(0, info.n_layer)


def _serve(opts: JoinOptions, layers: LayerRange | None, *, rebalancing: Rebalancing | None = None) -> int:
    """Run the node of ``opts`` on ``layers`` of its model (fetched first, for a URL) until a signal;
    ``rebalancing``: how a node the tracker placed re-plans, None for a pinned one."""
    node = opts.node
    model, expected = node.model, None
    if opts.url is not None:
        pulled = _pull_range(opts, opts.url, layers)
        model, expected = pulled.path, pulled.artifact
    if node.backend == "transformers":
        if not model.is_dir():
            raise OptionsError(f"--backend transformers takes a safetensors model directory; {model} is a file")
        if node.memory_limit is not None:
            raise OptionsError("--memory-limit plans llama.cpp's buffers; the transformers backend does not take it")
    elif model.is_dir():
        raise OptionsError(f"{model} is a directory; give a GGUF file, or --backend transformers for safetensors")
    tls_cert, tls_key = node.tls_cert, node.tls_key
    if opts.tls_self_signed:
        files = self_signed(node.data_dir)
        tls_cert, tls_key = files.cert, files.key
    return main_node(
        attrs.evolve(
            node,
            model=model,
            layers=layers,
            tls_cert=tls_cert,
            tls_key=tls_key,
            expected_fingerprint=expected,
            rebalancing=rebalancing,
        )
    )


def _rebalancing(opts: JoinOptions, max_layers: int) -> Rebalancing | None:
    """How a placed node re-plans (None: ``rebalance_every`` 0, it stays where it was placed)."""
    if not opts.rebalance_every:
        return None
    fetch_range = None if opts.url is None else functools.partial(_fetch_for_move, opts, opts.url)
    return Rebalancing(max_layers, every=opts.rebalance_every, fetch=fetch_range)


def _fetch_for_move(opts: JoinOptions, url: str, layers: LayerRange) -> tuple[Path, str | None]:
    """The shard file of ``layers`` a move loads, and the artifact to expect; :class:`MoveError` when
    fetching it fails (the node stays where it is)."""
    try:
        pulled = _pull_range(opts, url, layers)
    except (OptionsError, ArtifactError, OSError) as exc:
        raise MoveError(f"fetching them failed: {exc}") from None
    return pulled.path, pulled.artifact


def _pull_range(opts: JoinOptions, url: str, layers: LayerRange | None) -> fetch.PulledShard:
    """The shard file of ``layers`` of the model at ``url``, fetched (once) into the node's shards folder."""
    if layers is None:
        raise OptionsError(
            "--model URL fetches one layer range of the model: give it with --layers A:B, "
            "or give a --tracker that places this node"
        )
    return fetch.pull_layers(
        url,
        layers,
        _manifest_source(opts),
        opts.node.model,
        publisher=opts.publisher_key,
        trust_source=opts.trust_tracker_manifests,
        progress=sys.stderr.isatty(),
    )


def _manifest_source(opts: JoinOptions) -> str:
    """Where the manifest of a URL model comes from: ``--manifest``, else the node's first tracker."""
    source = opts.manifest or opts.node.tracker
    if source is None:
        raise OptionsError(
            "--model URL: the range fetched is checked against the model's signed manifest; give --manifest "
            "(a file, a URL, or a tracker's URL), or a --tracker that serves it"
        )
    return source


__all__ = [
    "JoinError",
    "JoinOptions",
    "OptionsError",
    "Placed",
    "ask",
    "budget",
    "holdable",
    "main",
    "place",
    "release",
    "with_draft_sized",
]
