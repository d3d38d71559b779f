"""The tracker's soft state: registered nodes, their load and the seams they measured; plain synchronous code, no I/O.

Nodes register (and re-register after a tracker restart) and send heartbeats with
their load; a node that misses heartbeats for ``expire_after`` seconds (in a large
swarm, a few of its longer intervals) is dropped. Heartbeats also carry the round trips
a node measured to its peers: the seam between two neighbours on a route costs what
they measured, and one nobody measured a constant by the node's reachability.

Step times come from the capability each node measured and signed at start (checked
against what its heartbeats show), and they also bound how many sessions a slow node
is sent. A node the tracker can probe is admitted to routes only once it has
answered its known-answer probe correctly.

Each artifact's nodes are kept as :class:`~noderuntime.tracker.columns.Columns` too,
which :mod:`noderuntime.tracker.routechoice` picks routes over.
"""

from __future__ import annotations

import collections
import itertools
import math
import random
from collections.abc import Collection, Iterable, Mapping, Sequence

import attrs

from noderuntime.operations.memory import compacted
from noderuntime.tracker import routechoice
from noderuntime.tracker.columns import COST_CEILING_MS, SEAMS_KEPT, Columns
from noderuntime.tracker.messages import MAX_PEERS, MAX_ROUND_TRIP_MS
from noderuntime.tracker.records import HEARTBEAT_SECONDS, NodeRecord
from noderuntime.tracker.routechoice import RouteChoice, layer_count, route_cost
from noderuntime.tracker.shapes import ProvenShapes

STEP_BUDGET_MS = 1000.0  # a node gets no more sessions than keep its decode step under this
DEPARTED_KEPT = 64  # departed nodes remembered, for status pages
ROUND_TRIP_SLACK = 0.1  # a reported round trip that moved less than this share (or 0.2 ms) is kept as it was
# Heartbeats: a small swarm's nodes beat every HEARTBEAT_SECONDS; a large one's less often, so
# that all of them together send about HEARTBEATS_PER_SECOND. A heartbeat costs the tracker
# about 1.4 ms of CPU through its HTTP stack (85 % of it the framework, 9 % the signature:
# benchmarks.tracker_scale), so 200 a second take under a third of a core and leave the
# rest to route requests. At 10,000 nodes that is a beat every 50 s (Petals announces every
# 60 s); past MAX_HEARTBEAT_SECONDS the interval stops growing and the budget is exceeded.
HEARTBEATS_PER_SECOND = 200.0
MAX_HEARTBEAT_SECONDS = 60.0
# a node is dropped after this many of its intervals without a word (and never sooner than expire_after)
EXPIRE_HEARTBEATS = 3.0
# clients whose unconfirmed grants through one node are counted by name (note_session); past them, a
# newcomer's grants count as others' for everyone, itself included
CLIENTS_COUNTED = 256


@attrs.define
class Unconfirmed:
    """The route grants through one node since its last heartbeat, by client, and the load that heartbeat reported."""

    free_slots: int  # as the node reported them
    active_sessions: int
    room: int  # the sessions it had room for then: its free slots, or fewer where its measured capacity binds
    total: int = 0
    by_client: dict[str, int] = attrs.field(factory=dict)

    def counted(self, client: str | None) -> int:
        """The grants ``client`` sees taken: every one of its own, and others' up to half the room (see
        :meth:`TrackerState.note_session`); None: a client with none of its own."""
        own = self.by_client.get(client, 0) if client is not None else 0
        return own + min(self.total - own, self.room // 2)


class TrackerState:
    """Registered nodes and their load."""

    def __init__(
        self,
        *,
        expire_after: float = 10.0,
        heartbeat_seconds: float = HEARTBEAT_SECONDS,
        step_budget_ms: float = STEP_BUDGET_MS,
        rng: random.Random | None = None,
        mixes: Mapping[str, Collection[frozenset[str]]] | None = None,
        shapes: Mapping[str, int] | None = None,
    ) -> None:
        """``mixes``: by artifact, the pairs of recipes that may share a route (certified);
        ``expire_after``: seconds of silence after which a node is dropped, at the least (a
        large swarm's nodes beat less often, and are given ``EXPIRE_HEARTBEATS`` of their intervals);
        ``heartbeat_seconds``: the interval a small swarm's nodes beat at (a large one's grows past it);
        ``shapes``: by artifact, its layer count where a manifest says it (no vote of nodes then)."""
        self.shapes: dict[str, int] = dict(shapes or {})
        # layer counts registrations proved (tracker.shapes): no vote of nodes either
        self.proven = ProvenShapes()
        self.expire_after = expire_after
        self.heartbeat_floor = heartbeat_seconds  # the interval's least, whatever the swarm's size
        self.step_budget_ms = step_budget_ms
        self.mixes: dict[str, frozenset[frozenset[str]]] = {a: frozenset(p) for a, p in (mixes or {}).items()}
        self.nodes: dict[bytes, NodeRecord] = {}
        # the nodes that left lately, newest last: (record, when, why: "left", "expired" or "refused")
        self.departed: collections.deque[tuple[NodeRecord, float, str]] = collections.deque(maxlen=DEPARTED_KEPT)
        self._rng = rng or random.Random()
        self._columns: dict[str, Columns] = {}
        # round trips as their nodes last reported them (reporter -> peer -> ms), and who names whom
        self._round_trips: dict[bytes, dict[bytes, float]] = {}
        self._named_by: dict[bytes, set[bytes]] = {}
        # measured seams between registered neighbours: node -> previous hop -> ms, and back
        self._seams_into: dict[bytes, dict[bytes, float]] = {}
        self._seams_from: dict[bytes, set[bytes]] = {}
        self._seams_kept: dict[bytes, dict[bytes, float]] = {}  # what routes read: the slowest SEAMS_KEPT
        # route grants through each node since its last heartbeat (note_session), and the nodes each client has some on
        self._unconfirmed: dict[bytes, Unconfirmed] = {}
        self._granted_to: dict[str, set[bytes]] = {}
        self.compactions = 0  # times the node map was rebuilt at its size (compact)

    # --- the registry

    @property
    def heartbeat_seconds(self) -> float:
        """The interval nodes are told to heartbeat at now: longer as the swarm grows (see HEARTBEATS_PER_SECOND)."""
        floor = self.heartbeat_floor
        return min(max(MAX_HEARTBEAT_SECONDS, floor), max(floor, len(self.nodes) / HEARTBEATS_PER_SECOND))

    def expires_after(self, beat_seconds: float) -> float:
        """Seconds of silence after which a node told to beat every ``beat_seconds`` is dropped."""
        return max(self.expire_after, EXPIRE_HEARTBEATS * beat_seconds)

    def register(self, record: NodeRecord, now: float) -> None:
        """Add or replace a node; a re-registration starts afresh (it may run other weights now).

        Its ``beat_seconds`` is the interval to tell it (:attr:`heartbeat_seconds`).
        """
        self._forget_seams(record.node_id)
        self._confirm(record.node_id)
        beat = self.heartbeat_seconds
        self._store(attrs.evolve(record, last_seen=now, free_slots=record.slots, beat_seconds=beat))
        # what its neighbours measured of it still holds: it is the same host
        touched: set[bytes] = set()
        for reporter in self._named_by.get(record.node_id, ()):
            self._relink(reporter, record.node_id, touched)
        self._write_seams(touched)

    def heartbeat(
        self,
        node_id: bytes,
        now: float,
        *,
        active_sessions: int,
        free_slots: int,
        queue_depth: int,
        step_ms: float,
        round_trips: Mapping[bytes, float] | None = None,
    ) -> bool:
        """Update a node's load; False if the node is unknown (it must register again).

        Its ``beat_seconds`` becomes the interval to tell it now (:attr:`heartbeat_seconds`).
        ``round_trips``: by peer node id, the smoothed round trip in ms to the peers it talks to;
        they replace what it reported before (None: leave those as they are).
        """
        record = self.nodes.get(node_id)
        if record is None:
            return False
        self._confirm(node_id)  # what it says now holds the sessions granted before it
        self._store(
            attrs.evolve(
                record,
                active_sessions=active_sessions,
                free_slots=free_slots,
                queue_depth=queue_depth,
                step_ms=step_ms,
                last_seen=now,
                beat_seconds=self.heartbeat_seconds,
            )
        )
        if round_trips is not None:
            self._report(node_id, round_trips)
        return True

    def update(self, node_id: bytes, **changes: object) -> None:
        """Set fields of a registered node (capability, probe result)."""
        record = self.nodes.get(node_id)
        if record is not None:
            self._store(attrs.evolve(record, **changes))  # type: ignore[arg-type]

    def expire(self, now: float) -> list[bytes]:
        """Drop nodes silent for longer than their interval allows (:meth:`expires_after`); returns their ids."""
        gone = [nid for nid, r in self.nodes.items() if now - r.last_seen > self.expires_after(r.beat_seconds)]
        for nid in gone:
            self.departed.append((self._drop(nid, now), now, "expired"))
        self.proven.expire(now)
        self.compact()
        return gone

    def compact(self) -> None:
        """Rebuild the maps keyed by node that kept the table of a flood now gone (:func:`compacted`);
        :attr:`compactions` counts the times the node map was (three quarters of its nodes went)."""
        nodes = self.nodes
        self.nodes = compacted(nodes)
        self.compactions += self.nodes is not nodes
        self._columns = compacted(self._columns)
        self._round_trips = compacted(self._round_trips)
        self._named_by = compacted(self._named_by)
        self._seams_into = compacted(self._seams_into)
        self._seams_from = compacted(self._seams_from)
        self._seams_kept = compacted(self._seams_kept)
        self._unconfirmed = compacted(self._unconfirmed)
        self._granted_to = compacted(self._granted_to)

    def leave(self, node_id: bytes, now: float) -> bool:
        """Forget a node that says it leaves; False if it was not registered."""
        if node_id not in self.nodes:
            return False
        self.departed.append((self._drop(node_id, now), now, "left"))
        return True

    def shape_of(self, artifact: str) -> int | None:
        """``artifact``'s layer count where it is known: by its manifest, else proven by a registration."""
        return self.shapes.get(artifact, self.proven.get(artifact))

    def learn_shape(self, artifact: str, n_layer: int, now: float) -> list[bytes]:
        """Take ``artifact``'s proven layer count (``tracker.shapes.proven_layers``): nodes registered with
        another are dropped (they claimed what the artifact is not); returns their ids."""
        self.proven.prove(artifact, n_layer, now)
        columns = self._columns.get(artifact)
        if columns is None:
            return []
        columns.shape = n_layer
        wrong = [nid for nid, r in self.nodes.items() if r.artifact == artifact and r.n_layer != n_layer]
        for nid in wrong:
            self.departed.append((self._drop(nid, now), now, "refused"))
        if artifact in self._columns:
            self.proven.in_use(artifact)
        return wrong

    def note_session(self, node_ids: Iterable[bytes], client: str = "") -> None:
        """Count a session routed to ``client`` in its nodes' load until their next heartbeat reports the truth.

        The cost sees it, and so does the capacity of a node whose measured step time allows
        fewer sessions than its slots (see :meth:`NodeRecord.has_room`). Its free slots
        lose one each: left at what the last heartbeat said, every route asked for between
        two heartbeats went to the same "free" slots, and a burst of twice a node's slots
        met refusals at the node (a third of 48 streams, with 16 clients on 8 slots). Slots
        freed before the next heartbeat are not seen until it comes, and a node counted
        full heartbeats as soon as one frees (``TrackerLink.slot_freed``).

        Until then nothing tells a grant whose session is on its way from one never opened,
        so each client sees a node through :meth:`seen`: its own grants count in full (its
        burst spreads as before), and all other clients' together weigh at most half the
        room the node last reported. Counted for everyone, a crowd of names that asks for
        routes and never opens them, each within its limits, kept every node "full" from one
        heartbeat to the next; now whatever their number, each other client still sees at
        least half of every node's free slots, and a heartbeat ends every count. (A heartbeat
        saying how many of the granted sessions were opened would come no sooner than the
        free slots it reports, which already say it.) The cost: two clients bursting into
        the same node at once may be granted up to half its slots more than it has, and the
        node refuses those (``TrackerLink.slot_refused`` then heartbeats at once).
        """
        for nid in node_ids:
            record = self.nodes.get(nid)
            if record is None:
                continue
            grants = self._unconfirmed.get(nid)
            if grants is None:
                capacity = record.capacity(self.step_budget_ms)
                room = record.free_slots
                if capacity < record.slots:  # as in NodeRecord.has_room: the measured capacity binds
                    room = min(room, max(0, capacity - record.active_sessions))
                grants = self._unconfirmed[nid] = Unconfirmed(record.free_slots, record.active_sessions, room)
            grants.total += 1
            if client in grants.by_client or len(grants.by_client) < CLIENTS_COUNTED:
                grants.by_client[client] = grants.by_client.get(client, 0) + 1
                self._granted_to.setdefault(client, set()).add(nid)
            # the record counts every grant (status pages, the node list); route choice reads seen()
            self._store(
                attrs.evolve(
                    record,
                    active_sessions=grants.active_sessions + grants.total,
                    free_slots=max(0, grants.free_slots - grants.total),
                )
            )

    def seen(self, record: NodeRecord, client: str | None = None) -> NodeRecord:
        """``record`` as ``client`` sees it: the grants through it since its last heartbeat counted as
        :meth:`note_session` says (None: a client with none of its own there)."""
        grants = self._unconfirmed.get(record.node_id)
        if grants is None:
            return record
        counted = grants.counted(client)
        return attrs.evolve(
            record,
            active_sessions=grants.active_sessions + counted,
            free_slots=max(0, grants.free_slots - counted),
        )

    def _confirm(self, node_id: bytes) -> None:
        """Forget the grants through a node that reported its load (or registered, or left) since."""
        grants = self._unconfirmed.pop(node_id, None)
        if grants is None:
            return
        for client in grants.by_client:
            nodes = self._granted_to[client]
            nodes.discard(node_id)
            if not nodes:
                del self._granted_to[client]

    def _store(self, record: NodeRecord) -> None:
        old = self.nodes.get(record.node_id)
        if old is not None and old.artifact != record.artifact:
            self._columns[old.artifact].remove(record.node_id)
        self.nodes[record.node_id] = record
        columns = self._columns.get(record.artifact)
        if columns is None:
            columns = self._columns[record.artifact] = Columns(record.artifact, self.shape_of(record.artifact))
            self.proven.in_use(record.artifact)
        columns.put(self.seen(record), self.step_budget_ms)  # as a client with no grants of its own sees it

    def _drop(self, node_id: bytes, now: float) -> NodeRecord:
        self._forget_seams(node_id)  # before its row can go to another node
        self._confirm(node_id)
        record = self.nodes.pop(node_id)
        columns = self._columns[record.artifact]
        columns.remove(node_id)
        if not columns.rows:
            del self._columns[record.artifact]
            self.proven.idle(record.artifact, now)
        return record

    # --- measured seams

    def seam_ms(self, previous: NodeRecord | None, node: NodeRecord) -> float:
        """The seam into ``node`` from ``previous`` (None: from the route's client).

        The round trip the two measured, where either reported one (the larger, where both
        did: neither end can make its seams look faster than the other saw them); else the
        constant for the node's reachability.
        """
        if previous is not None:
            measured = self._seams_kept.get(node.node_id, {}).get(previous.node_id)
            if measured is not None:
                return measured
        # scaled to what the artifact's nodes measure (Columns.unmeasured_scale)
        columns = self._columns.get(node.artifact)
        return node.seam_ms() * (columns.unmeasured_scale() if columns is not None else 1.0)

    def route_cost(self, route: Sequence[NodeRecord]) -> float:
        """Estimated milliseconds per decode step along ``route``, its measured seams counted."""
        return sum(
            min(node.estimated_step_ms(), COST_CEILING_MS) + self.seam_ms(before, node)
            for before, node in zip((None, *route[:-1]), route, strict=True)
        )

    def _report(self, reporter: bytes, round_trips: Mapping[bytes, float]) -> None:
        """Take a node's round trips to its peers in place of those it reported before."""
        fresh: dict[bytes, float] = {}
        # bounded again here: the message type bounds what arrives over HTTP, not every caller
        for peer, ms in itertools.islice(round_trips.items(), MAX_PEERS):
            if peer != reporter and isinstance(ms, int | float) and math.isfinite(ms) and ms >= 0:
                fresh[peer] = min(float(ms), MAX_ROUND_TRIP_MS)
        old = self._round_trips.get(reporter, {})
        for peer, ms in fresh.items():
            # jitter is no news: the seams keep their costs and route choice its arrays
            was = old.get(peer)
            if was is not None and abs(ms - was) <= max(0.2, ROUND_TRIP_SLACK * was):
                fresh[peer] = was
        if fresh == old:
            return
        if fresh:
            self._round_trips[reporter] = fresh
        else:
            self._round_trips.pop(reporter, None)
        touched: set[bytes] = set()
        for peer in old.keys() | fresh.keys():
            if peer not in fresh:
                self._unname(reporter, peer)
            elif peer not in old:
                self._named_by.setdefault(peer, set()).add(reporter)
            if old.get(peer) != fresh.get(peer):
                self._relink(reporter, peer, touched)
        self._write_seams(touched)

    def _unname(self, reporter: bytes, peer: bytes) -> None:
        naming = self._named_by.get(peer)
        if naming is not None:
            naming.discard(reporter)
            if not naming:
                del self._named_by[peer]

    def _forget_seams(self, node_id: bytes) -> None:
        """Drop what a node reported and every seam it is an end of (it leaves, or starts afresh)."""
        for peer in self._round_trips.pop(node_id, {}):
            self._unname(node_id, peer)
        touched: set[bytes] = set()
        for after in list(self._seams_from.get(node_id, ())):
            self._unlink(node_id, after, touched)
        for before in list(self._seams_into.get(node_id, ())):
            self._unlink(before, node_id, touched)
        self._write_seams(touched)

    def _relink(self, a: bytes, b: bytes, touched: set[bytes]) -> None:
        """Cost the seam between two nodes again from what both reported (a seam runs one way: layers say which)."""
        self._unlink(a, b, touched)
        self._unlink(b, a, touched)
        first, second = self.nodes.get(a), self.nodes.get(b)
        if first is None or second is None or first.artifact != second.artifact:
            return
        if first.layers[1] == second.layers[0]:
            before, after = a, b
        elif second.layers[1] == first.layers[0]:
            before, after = b, a
        else:
            return  # not neighbours on any route
        reports = [
            r for r in (self._round_trips.get(a, {}).get(b), self._round_trips.get(b, {}).get(a)) if r is not None
        ]
        if reports:
            self._seams_into.setdefault(after, {})[before] = max(reports)
            self._seams_from.setdefault(before, set()).add(after)
            touched.add(after)

    def _unlink(self, before: bytes, after: bytes, touched: set[bytes]) -> None:
        into = self._seams_into.get(after)
        if into is None or before not in into:
            return
        del into[before]
        if not into:
            del self._seams_into[after]
        following = self._seams_from[before]
        following.discard(after)
        if not following:
            del self._seams_from[before]
        touched.add(after)

    def _write_seams(self, nodes: Iterable[bytes]) -> None:
        """Put the measured seams into ``nodes`` where route choice reads them."""
        for node_id in nodes:
            record = self.nodes.get(node_id)
            into = self._seams_into.get(node_id, {})
            # the slowest: a slow seam taken for a fast constant would send routes across it
            kept = dict(sorted(into.items(), key=lambda item: -item[1])[:SEAMS_KEPT])
            if kept:
                self._seams_kept[node_id] = kept
            else:
                self._seams_kept.pop(node_id, None)
            if record is None:
                continue
            columns = self._columns[record.artifact]
            columns.set_seams(columns.rows[node_id], [(columns.rows[b], ms) for b, ms in kept.items()])

    # --- what routes there are

    def artifacts(self) -> dict[str, dict[str, object]]:
        """Known artifacts: name, layers, nodes, and whether some route covers them."""
        out: dict[str, dict[str, object]] = {}
        for artifact in {r.artifact for r in self.nodes.values()}:
            nodes = self.nodes_of(artifact)
            out[artifact] = {
                "name": nodes[0].model_name,
                "n_layer": self.shape_of(artifact) or layer_count(nodes),
                "nodes": len(nodes),
                "routable": self.routable(artifact),
            }
        return out

    def shape(self, artifact: str) -> int | None:
        """``artifact``'s layer count: its manifest's or a proven one (:meth:`shape_of`), else what its
        admitted nodes say; None when none is known (no manifest, no proof, no node admitted)."""
        known = self.shape_of(artifact)
        if known is not None:
            return known
        admitted = [r for r in self.nodes_of(artifact) if r.admitted]
        return layer_count(admitted) if admitted else None

    def routable(self, artifact: str) -> bool:
        """Whether the nodes routes may use chain into a complete route of ``artifact``, full or not."""
        return routechoice.routable(self._columns.get(artifact), self.mixes.get(artifact, ()))

    def nodes_of(self, artifact: str) -> list[NodeRecord]:
        """Registered nodes of one artifact."""
        return [r for r in self.nodes.values() if r.artifact == artifact]

    def choose(
        self,
        artifact: str,
        tokens: int,
        *,
        exclude: Iterable[bytes] = (),
        start: int = 0,
        recipe: str | None = None,
        prefer: str | None = None,
        near: Collection[bytes] = (),
        client: str = "",
    ) -> RouteChoice:
        """Pick a route for a session of ``tokens`` positions; raises :class:`~noderuntime.tracker.routechoice.NoRoute`.

        See :func:`noderuntime.tracker.routechoice.choose` for ``start``, ``recipe``, ``prefer``
        and ``near``; the route is costed with its measured seams (:meth:`route_cost`). Nodes'
        load is as ``client`` sees it (:meth:`seen`): its own grants since their last heartbeat
        count in full, others' at most half their room.
        """
        own: dict[bytes, routechoice.Seen] = {}
        for node_id in self._granted_to.get(client, ()):
            record = self.nodes[node_id]  # a node's grants are forgotten when it goes (_confirm)
            if record.artifact == artifact:
                seen = self.seen(record, client)
                own[node_id] = routechoice.Seen(seen, seen.has_room(self.step_budget_ms))
        return routechoice.choose(
            self._columns.get(artifact),
            artifact,
            tokens,
            exclude=exclude,
            start=start,
            recipe=recipe,
            prefer=prefer,
            near=near,
            mixes=self.mixes.get(artifact, ()),
            rng=self._rng,
            route_cost=self.route_cost,
            seen=own,
        )

    def routes_now(self, artifact: str) -> list[RouteChoice]:
        """The routes :meth:`choose` would pick from for a short session of ``artifact`` now, cheapest
        first; [] when it would find none. Those within ``NEAR_EQUAL`` of the first are equally likely.
        """
        free = routechoice.free_routes(self.nodes_of(artifact), self.mixes.get(artifact, ()), self.step_budget_ms)
        return sorted((RouteChoice(tuple(r), route_cost(r)) for r in free), key=lambda choice: choice.cost_ms)
