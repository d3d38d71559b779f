"""A node the tracker placed re-plans: now and then it asks whether to move, and moves make-before-break.

A node started without ``--layers`` (:mod:`noderuntime.services.joining`) asks its tracker
every :attr:`Rebalancing.every` seconds (60 by default, with a fifth of jitter so that nodes
started together do not ask together) whether it should serve other layers
(``POST /v1/placement/reconsider``; :meth:`noderuntime.tracker.placement.Placement.reconsider`).
The tracker says move only where the least capacity of the swarm's routes grows by more
than its margin (1/0.75) and no layer is left uncovered, and it does not say so to the same
node again for its hold-down (600 s). A node given its range with ``--layers`` is pinned:
it never asks.

A move is make-before-break, in one process under the node's one identity:

1. if the model came by URL, the new range's layers are fetched (a ranged pull);
2. the new range is loaded as a second engine beside the one serving, measured, and run
   as a second :class:`Node` on the same engine thread, connector and identity;
3. the process's transports hand every new seam to the new node (:class:`NodeSwitch`), and
   the node registers anew with the new range: the tracker replaces its record, so routes
   name the new range from then on;
4. the old node drains through the graceful-leave path (its live sessions end as the node's
   own leaving, and their previous hops repair the routes around it onto the nodes that
   still serve the old range), then stops, and its engine is freed.

Both ranges are held at once during a move, so a node moves only when the new range fits
beside the old one: within ``--memory-limit`` less what the old range holds, else within
the share of the memory free now that a joining node would take (and on a GPU within what
the device has free now). A node sized to its whole budget therefore moves only to a
narrower range, or not at all: it declines, registers again (which drops the reservation
the tracker made for it), and stays where it is. Seams that arrive for the old range in
the instant between the switch and the tracker's new record are refused, and their
sessions repaired like any refused hop's.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import psutil
import trio

from noderuntime.access.identity import Identity
from noderuntime.control import admission
from noderuntime.engine import memplan
from noderuntime.engine.base import EngineError
from noderuntime.engine.thread import EngineThread
from noderuntime.models.artifacts import ArtifactError, LayerRange
from noderuntime.node.core import Node
from noderuntime.tracker.client import TrackerError, TrackerLink, request_reconsider
from noderuntime.tracker.messages import RebalanceRequest, Registration
from noderuntime.transport import FrameStream
from protocol import Span

log = logging.getLogger(__name__)

REBALANCE_SECONDS = 60.0  # how often a placed node asks whether to move (Petals re-checks about this often)
JITTER = 0.2  # of the interval, either way: nodes started together do not ask together
REGISTER_SECONDS = 10.0  # how long a moved node waits for its trackers to take its new range
FREE_SHARE = 0.8  # of the memory free now, what a move may take without a memory limit (as joining does)


# what loading a range gives: the model file's info, the recipe, the layers, the engine, the prefix cache's bytes
Loaded = tuple[Any, Any, LayerRange, Any, int]


class MoveError(Exception):
    """A move could not be made: the node goes on serving its old range."""


@attrs.frozen
class Rebalancing:
    """How a placed node re-plans (``noderuntime up`` without ``--layers``).

    ``max_layers``: how many layers it can hold, as it told the tracker when placed;
    ``every``: seconds between its questions (with :data:`JITTER`);
    ``fetch``: for a model fetched by URL, what fetches a range's shard file (its path and
    the artifact fingerprint to expect), run on a worker thread, raising :class:`MoveError`
    when it cannot; None for a local file.
    """

    max_layers: int
    every: float = REBALANCE_SECONDS
    fetch: Callable[[LayerRange], tuple[Path, str | None]] | None = None

    def __attrs_post_init__(self) -> None:
        if self.max_layers <= 0 or not self.every > 0:
            raise ValueError("a placed node holds a layer at least, and asks at a positive interval")

    def wait(self, rng: random.Random) -> float:
        """Seconds until the next question: the interval, give or take :data:`JITTER` of it."""
        return self.every * rng.uniform(1 - JITTER, 1 + JITTER)


class NodeSwitch:
    """The node this process serves now, and the engines its nodes hold.

    The transports hand every new seam to :meth:`accept`, which gives it to :attr:`current`;
    a move replaces it. Each node runs under a cancel scope of its own (:meth:`serve`), so
    that a move can stop the old one while the new one serves on.
    """

    def __init__(self, node: Node, engine: Any) -> None:
        """``node`` serves on ``engine`` now."""
        self.current = node
        self.engines: dict[int, Any] = {id(node): engine}  # by node: what :meth:`close` frees
        self._scopes: dict[int, trio.CancelScope] = {}
        self._stopped: dict[int, trio.Event] = {}
        self.moves = 0

    def accept(self, stream: FrameStream) -> None:
        """A new seam for this process's node: the current one takes it (never raises, as :meth:`Node.accept`)."""
        self.current.accept(stream)

    async def serve(self, node: Node, *, task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED) -> None:
        """Run ``node`` until cancelled or :meth:`stop` stops it."""
        scope = trio.CancelScope()
        self._scopes[id(node)] = scope
        self._stopped[id(node)] = stopped = trio.Event()
        try:
            with scope:
                await node.run(task_status=task_status)
        finally:
            stopped.set()

    async def stop(self, node: Node, engine_thread: EngineThread) -> None:
        """Stop ``node`` (its sessions end) and free its engine, on the engine thread that ran it."""
        scope = self._scopes.pop(id(node), None)
        if scope is not None:
            scope.cancel()
            await self._stopped.pop(id(node)).wait()
        engine = self.engines.pop(id(node), None)
        if engine is not None:
            await engine_thread.run(engine.close)

    def close(self) -> None:
        """Free every engine still held (idempotent: a closed engine closes again harmlessly)."""
        for engine in self.engines.values():
            engine.close()


def serving(node: Node | NodeSwitch) -> Node:
    """The node that serves now: ``node`` itself, or the switch's current one."""
    return node.current if isinstance(node, NodeSwitch) else node


def room(model: Path, layers: LayerRange, old: LayerRange, recipe: Any, memory_limit: int | None) -> str:
    """Why ``layers`` of ``model`` cannot be loaded beside ``old`` now ("" when they can).

    Within ``memory_limit`` less what ``old`` holds; without one, within :data:`FREE_SHARE` of
    the host memory free now (the old range's memory is in use, not free); on a GPU also
    within what the device has free now.
    """
    wanted = memplan.needs(model, layers, recipe)
    if memory_limit is not None:
        held = memplan.needs(model, old, recipe) if old.start >= 0 else None
        host = memory_limit - (held.host if held is not None else 0)
    else:
        host = int(psutil.virtual_memory().available * FREE_SHARE)
    budget = memplan.device_budget(recipe, max(0, host))
    if budget.admits(wanted):
        return ""
    return f"layers {layers} need {wanted.describe()}, over {budget.describe(wanted)} beside layers {old}"


class Mover:
    """Asks the tracker whether to move, and moves (see the module docstring)."""

    def __init__(
        self,
        plan: Rebalancing,
        me: Identity,
        switch: NodeSwitch,
        links: Sequence[TrackerLink],
        *,
        load: Callable[[LayerRange, Path, str | None], Awaitable[Loaded]],
        model: Path,
        expected: str | None,
        recipe: Any,
        engine_thread: EngineThread,
        nursery: trio.Nursery,
        memory_limit: int | None,
        drain_timeout: float,
        on_node: Callable[[Node], None] | None = None,
    ) -> None:
        """``load(layers, model, expected_fingerprint)`` loads a range as ``noderun`` loaded the first;
        ``model`` and ``expected``: the file it serves now (a URL's ranges are fetched anew, see
        :attr:`Rebalancing.fetch`), ``recipe`` its llama.cpp recipe; ``nursery`` runs the nodes a move
        starts, ``on_node`` hears of each."""
        self.plan = plan
        self.me = me
        self.switch = switch
        self.links = list(links)
        self._load = load
        self.model = model  # what a move to other layers loads them from, unless it fetches them
        self.expected = expected
        self.recipe = recipe
        self.engine_thread = engine_thread
        self.nursery = nursery
        self.memory_limit = memory_limit
        self.drain_timeout = drain_timeout
        self.on_node = on_node
        self._rng = random.Random()
        self.declined = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ask every :attr:`Rebalancing.every` seconds until cancelled; move when told to."""
        task_status.started()
        async with httpx.AsyncClient() as client:
            while True:
                await trio.sleep(self.plan.wait(self._rng))
                move = await self.ask(client)
                if move is None:
                    continue
                try:
                    await self.move(move)
                except MoveError as exc:
                    self.declined += 1
                    log.warning("not moving to layers %s: %s", move, exc)
                    self._register(self._registration())  # the tracker drops the range it reserved

    async def ask(self, client: httpx.AsyncClient) -> LayerRange | None:
        """The range the first tracker that answers moves this node to; None: stay (or none answered)."""
        asked = RebalanceRequest(node_id=self.me.node_id.hex(), max_layers=self.plan.max_layers)
        for link in self.links:
            try:
                reply = await request_reconsider(client, link.url, self.me, asked)
            except TrackerError as exc:
                log.info("the tracker %s did not reconsider this node: %s", link.url, exc)
                continue
            if reply.layers is None:
                return None
            start, end = reply.layers
            current = self.switch.current.config
            if end > current.n_layer or (start, end) == (current.layers.start, current.layers.end):
                return None
            log.info(
                "the tracker %s moves this node to layers %d:%d (the least capacity %.1f -> %.1f tokens/s)",
                link.url,
                start,
                end,
                reply.least_before,
                reply.least_after,
            )
            return LayerRange(start, end)
        return None

    def _registration(self) -> Registration:
        return self.links[0].registration

    def _register(self, registration: Registration) -> None:
        for link in self.links:
            link.register_again(registration)

    async def move(self, layers: LayerRange) -> None:
        """Load ``layers``, serve them, then drain the old range; :class:`MoveError` leaves the old serving."""
        old = self.switch.current
        before = LayerRange(old.config.layers.start, old.config.layers.end)
        model, expected = self.model, self.expected
        if self.plan.fetch is not None:
            model, expected = await trio.to_thread.run_sync(self.plan.fetch, layers)
        short = await trio.to_thread.run_sync(room, model, layers, before, self.recipe, self.memory_limit)
        if short:
            raise MoveError(short)
        try:
            info, _recipe, loaded, engine, prefix_cache = await self._load(layers, model, expected)
        except (EngineError, ArtifactError, OSError, ValueError) as exc:
            raise MoveError(f"loading them failed: {exc}") from None
        try:
            capability = await self.engine_thread.run(functools.partial(admission.measure, engine))
            node = Node(
                engine,
                attrs.evolve(old.config, layers=Span(loaded.start, loaded.end), prefix_cache_bytes=prefix_cache),
                self.me.node_id,
                old.connector,
                ticket_check=old.ticket_check,
                signer=lambda body: self.me.sign(b"noderuntime-usage-v1", body),
                engine_thread=self.engine_thread,
                draft_model=old.draft_model,  # it drafts should the node head routes after the move
            )
        except BaseException:
            await self.engine_thread.run(engine.close)
            raise
        node.capability = capability.to_json()
        self.switch.engines[id(node)] = engine
        await self.nursery.start(self.switch.serve, node)
        # the old node's hooks (telling the trackers it leaves, its freed slots) are the new one's now
        node.on_leave.extend(old.on_leave)
        node.leases.on_free.extend(old.leases.on_free)
        node.leases.on_refused.extend(old.leases.on_refused)
        old.on_leave.clear()
        self.switch.current = node
        self.switch.moves += 1
        if self.on_node is not None:
            self.on_node(node)
        record = admission.capability_record(
            self.me,
            artifact=info.fingerprint,
            layers=(loaded.start, loaded.end),
            recipe=self._registration().recipe,
            capability=capability,
        )
        self._register(
            self._registration().model_copy(update={"layers": (loaded.start, loaded.end), "capability": record})
        )
        with trio.move_on_after(REGISTER_SECONDS):
            # a link's registration is a flag it sets; the old range drains once a tracker routes to the new
            while not any(link.registered for link in self.links):  # noqa: ASYNC110
                await trio.sleep(0.05)
        log.info("serving layers %s; draining layers %s", loaded, before)
        with trio.move_on_after(self.drain_timeout):
            await old.drain()
        await self.switch.stop(old, self.engine_thread)
        self.model, self.expected = model, expected
        log.info("moved from layers %s to %s", before, loaded)


__all__ = ["REBALANCE_SECONDS", "MoveError", "Mover", "NodeSwitch", "Rebalancing", "room", "serving"]
