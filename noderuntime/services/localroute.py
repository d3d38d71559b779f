"""In-process routes: N shard nodes in one process joined by in-memory frame streams.

The frames are the real encoded protocol frames; only the transport is memory. Used
by tests and benchmarks of the node core.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from noderuntime.engine.llama import Recipe, ShardEngine
from noderuntime.engine.thread import EngineThread
from noderuntime.models.artifacts import LayerRange, inspect
from noderuntime.node.core import Node, NodeConfig
from noderuntime.node.draftmodel import DraftModel
from noderuntime.seams.client import GenerationRequest, open_route_generation, over_stream
from noderuntime.services.noderun import load_draft
from noderuntime.transport import FrameStream, TransportError, memory_stream_pair
from protocol import Encoding, Hop, OpenRoute, Span, UsageRecord


class InProcessNetwork:
    """Reaches nodes of this process by node id."""

    def __init__(self, buffer: int = 4) -> None:
        self.nodes: dict[bytes, Node] = {}
        self.buffer = buffer
        self.connections = 0

    def add(self, node: Node) -> None:
        """Make ``node`` reachable."""
        self.nodes[node.node_id] = node

    async def connect(self, hop: Hop, open_route: OpenRoute | None = None, *, source: str = "") -> FrameStream:
        """A new seam stream to the node of ``hop``; ``source``: the address the node sees it come from."""
        node = self.nodes.get(hop.node_id)
        if node is None or node._nursery is None:
            raise TransportError(f"no node {hop.node_id.hex()[:12]} in this process")
        ours, theirs = memory_stream_pair(self.buffer)
        theirs.source = source
        node.accept(theirs)
        self.connections += 1
        return ours


@attrs.frozen
class Completion:
    """A finished generation."""

    tokens: tuple[int, ...]
    finish_reason: str
    usage: tuple[UsageRecord, ...] | None
    drafted: int = 0  # speculative decoding's drafted tokens, and those the tail kept
    accepted: int = 0


@attrs.define
class LocalRoute:
    """A running in-process route."""

    network: InProcessNetwork
    nodes: list[Node]
    engines: list[ShardEngine]
    hops: tuple[Hop, ...]
    artifact: bytes
    recipe: bytes

    async def generate(self, request: GenerationRequest) -> Completion:
        """Run one generation to its end."""
        stream = await self.network.connect(self.hops[0])
        async with open_route_generation(
            over_stream(stream), self.hops, request, artifact=self.artifact, recipe=self.recipe
        ) as gen:
            while await gen.next() is not None:
                pass
        return Completion(tuple(gen.tokens), gen.finish_reason, gen.usage, gen.drafted, gen.accepted)

    async def kv_cells_used(self) -> list[int]:
        """KV cells in use on every node, by llama.cpp's count."""
        return [await node.kv_cells_used() for node in self.nodes]


def node_id_for(index: int, layers: LayerRange) -> bytes:
    """A stable 32-byte id for in-process node ``index`` (real nodes use their public key)."""
    return hashlib.sha256(f"local-node-{index}-{layers}".encode()).digest()


@asynccontextmanager
async def open_local_route(
    model: str | os.PathLike[str],
    cuts: Sequence[int],
    recipe: Recipe,
    *,
    prefill_chunk: int = 128,
    idle_timeout: float = 60.0,
    encoding: Encoding = Encoding.F32,
    buffer: int = 4,
    eager_windows: bool = False,
    draft: str | os.PathLike[str] | None = None,
) -> AsyncIterator[LocalRoute]:
    """Load one engine per range and serve them as nodes until the block ends (``draft``: a
    whole model of the same vocabulary that drafts at the head, as ``up --draft``).

    Every engine runs on one shared thread: each thread that calls llama.cpp keeps an
    OpenMP team of its own, and two teams in one process oversubscribe the cores and
    throttle every barrier (see :mod:`noderuntime.engine.thread`). The ranges take turns,
    as they would have to on one machine's cores anyway.
    """
    info = await trio.to_thread.run_sync(inspect, model)  # may hash the file: off the trio thread
    ranges = [LayerRange(a, b) for a, b in itertools.pairwise(cuts)]
    engines: list[ShardEngine] = []
    draft_engine: ShardEngine | None = None
    draft_model: DraftModel | None = None
    thread = EngineThread("engines")
    try:
        for layers in ranges:
            engines.append(await thread.run(functools.partial(ShardEngine, model, recipe, layers)))
        if draft is not None:
            draft_engine, draft_model = await load_draft(Path(model), Path(draft), recipe, thread, cores=None)
        network = InProcessNetwork(buffer)
        artifact = bytes.fromhex(info.fingerprint)
        recipe_fp = bytes.fromhex(recipe.fingerprint(info.quant))
        nodes = []
        for i, (engine, layers) in enumerate(zip(engines, ranges, strict=True)):
            config = NodeConfig(
                layers=Span(layers.start, layers.end),
                n_layer=info.n_layer,
                artifact_fingerprint=artifact,
                recipe_fingerprint=recipe_fp,
                n_slots=recipe.n_seq_max,
                ctx_per_seq=recipe.n_ctx_per_seq,
                max_batch_tokens=recipe.n_batch,
                prefill_chunk=min(prefill_chunk, recipe.n_batch),
                idle_timeout=idle_timeout,
                encoding=encoding,
                eager_windows=eager_windows,
            )
            node = Node(
                engine,
                config,
                node_id_for(i, layers),
                network,
                engine_thread=thread,
                draft_model=draft_model if i == 0 else None,
            )
            network.add(node)
            nodes.append(node)
        hops = tuple(Hop(n.node_id, n.config.layers) for n in nodes)
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await nursery.start(node.run)
            yield LocalRoute(network, nodes, engines, hops, artifact, recipe_fp)
            nursery.cancel_scope.cancel()
    finally:
        for engine in engines:
            engine.close()
        if draft_engine is not None:
            draft_engine.close()
        thread.close()
