"""The JSON a node, a gateway and a tracker exchange, defined once: the tracker validates
with these and the others build their messages with them; a gateway validates a route
grant (:class:`RouteReply`) with them in turn. The swarm map's pages read what the tracker
serves them as :class:`SwarmStatus` and :class:`NodePage`, asked for with a :class:`NodeQuery`.

A route's hops travel as :class:`RouteHop` objects: :func:`encode_hops` writes them and
:func:`decode_hops` reads them back as :class:`protocol.Hop` values, raising pydantic's
``ValidationError`` (a ``ValueError``) on anything malformed.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, field_validator

from noderuntime.access import untrusted
from noderuntime.access.tickets import MAX_TICKET_BYTES
from protocol import Hop, Span, UsageRecord

HEX32 = r"^[0-9a-f]{64}$"
MAX_LAYERS = 4096
MAX_PEERS = 32  # round trips one heartbeat may report
MAX_ROUND_TRIP_MS = 60_000.0
MAX_SLOTS = 4096  # sessions one node may hold at once
MAX_QUEUE = 1 << 20  # requests a node may say are waiting for a slot
MAX_COST_MS = 1e12  # a route's estimated cost per step (256 hops at the ceiling), as a gateway reads it
DEVICE = r"^(cpu|(vulkan|cuda|hip|metal):[0-9]{1,4})$"  # engine.backends.parse_device, bounded


def _layer_span(value: tuple[int, int]) -> tuple[int, int]:
    start, end = value
    if not 0 <= start < end <= MAX_LAYERS:
        raise ValueError(f"layers must be [start, end] with 0 <= start < end <= {MAX_LAYERS}")
    return value


# a layer range another party names: what a route hop runs, what a placement gives
LayerSpan = Annotated[tuple[int, int], AfterValidator(_layer_span)]


class NodeDescription(BaseModel):
    """What a node says of itself: the shard it serves, how peers reach it, and how much it holds.

    Defined once, with every bound: a :class:`Registration` carries it to the tracker (with
    the node's signed capability), a node's ready line (``services.ready.NodeReady``) to
    whoever started it, and the tracker keeps it in its record of the node
    (``tracker.records.NodeRecord.of``).
    """

    model_config = ConfigDict(frozen=True)

    node_id: str = Field(pattern=HEX32)
    artifact: str = Field(pattern=HEX32)
    model_name: str = Field(default="", max_length=200)
    n_layer: int = Field(gt=0, le=MAX_LAYERS)
    layers: tuple[int, int]
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")
    address: str = Field(default="", max_length=300)  # HOST:PORT for direct seams, or none
    relay: str = Field(default="", max_length=300)  # ws:// or wss:// URL of the relay it listens through
    tls_cert_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    slots: int = Field(gt=0, le=MAX_SLOTS)
    ctx_per_session: int = Field(gt=0, le=1 << 22)
    # where its layers and KV live (the recipe fingerprint names the kind of device, not the index)
    device: str = Field(default="cpu", pattern=DEVICE)
    # its drift class (engine.llama.kernel_class), which the recipe fingerprint covers: shown, and
    # told apart when two recipes differ by it alone
    kernel_class: str = Field(default="", max_length=300)

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        # peers dial what routes name: a malformed address would fail every route through the node
        if value and not _dialable(value):
            raise ValueError("address must be HOST:PORT (or [IPv6]:PORT) with a port in 1..65535")
        return value

    @field_validator("relay")
    @classmethod
    def _relay(cls, value: str) -> str:
        if value and not _relay_url(value):
            raise ValueError("relay must be a ws:// or wss:// URL with a host")
        return value

    def description(self) -> NodeDescription:
        """The description alone, of a message that carries more (a registration, a ready line)."""
        return NodeDescription.model_validate(self.model_dump(include=set(NodeDescription.model_fields)))


# A shape proof's bounds, refused before anything is decoded: the identity fields a GGUF model has
# (33 in a Llama's), and its tensor index packed (zlib, base64: 17 KB for an 8B Llama's 291 tensors,
# about 58 characters a tensor, so ~800 tensors fit, a 70B Llama's 723 among them).
MAX_SHAPE_FIELDS = 128
MAX_SHAPE_INDEX_CHARS = 48_000


class ShapeProof(BaseModel):
    """An artifact's layer count, bound by its fingerprint: the digests of the identity fields the
    fingerprint hashes, two of them shown whole (the architecture and its block count), and the
    tensor index, packed. The tracker recomputes the fingerprint from them (``tracker.shapes``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: str = Field(pattern=r"^[a-z0-9_]{1,64}$")
    n_layer: int = Field(gt=0, le=MAX_LAYERS, strict=True)
    n_layer_type: int = Field(ge=0, le=12, strict=True)  # the GGUF integer type the block count is stored as
    # models.artifacts.field_digest of each identity field, in key order
    fields: list[Annotated[str, StringConstraints(pattern=HEX32)]] = Field(max_length=MAX_SHAPE_FIELDS)
    # the sorted lines of the tensor index (models.artifacts.TensorEntry.line), "\n"-joined, zlib'd, base64
    index: str = Field(max_length=MAX_SHAPE_INDEX_CHARS, pattern=r"^[A-Za-z0-9+/=]*$")


class Registration(NodeDescription):
    """A node's description of itself, with the capability it measured and signed (``admission.capability_record``)."""

    capability: dict[str, str]  # {"body": signed JSON text, "signature": hex}
    # for a private swarm's tracker: access.signing.join_proof of its join secret and this node's id
    join_proof: str = Field(default="", max_length=64, pattern=r"^([0-9a-f]{64})?$")
    # its artifact's shape, proven by the artifact's fingerprint: what fixes the layer count where
    # no manifest does (none: the node could not read it, as from a model in gguf-split parts)
    shape: ShapeProof | None = None

    @classmethod
    def of(cls, description: NodeDescription, capability: dict[str, str]) -> Registration:
        """The registration of the node ``description`` describes."""
        return cls(**description.description().model_dump(), capability=capability)


def _dialable(address: str) -> bool:
    try:
        untrusted.host_port(address)
    except ValueError:
        return False
    return True


def _relay_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # raises ValueError when out of range
    except ValueError:
        return False
    return parts.scheme in ("ws", "wss") and bool(parts.hostname) and port != 0


class Heartbeat(BaseModel):
    """A node's load now, every number bounded: route choice computes with them in floats."""

    node_id: str = Field(pattern=HEX32)
    active_sessions: int = Field(ge=0, le=MAX_QUEUE)
    free_slots: int = Field(ge=0, le=MAX_SLOTS)
    queue_depth: int = Field(ge=0, le=MAX_QUEUE)
    step_ms: float = Field(ge=0, le=1e6, allow_inf_nan=False)
    # smoothed round trips to the peers it talks to, in ms, by their node ids: the tracker
    # costs the seams between them by these, and the seams nobody measured by a constant
    round_trips: dict[
        Annotated[str, StringConstraints(pattern=HEX32)],
        Annotated[float, Field(ge=0, le=MAX_ROUND_TRIP_MS, allow_inf_nan=False)],
    ] = Field(default_factory=dict, max_length=MAX_PEERS)


class Leave(BaseModel):
    """A node leaving (SIGTERM, ``noderuntime down``): routes stop naming it at once.

    ``moving``: it leaves its range only to load the one the tracker moved it to, which
    stays reserved for it (see :class:`RebalanceReply`).
    """

    node_id: str = Field(pattern=HEX32)
    moving: bool = False


class PlacementRequest(BaseModel):
    """A node that has no layer range yet asks the tracker for one (``POST /v1/placement``, signed).

    ``max_layers``: how many layers of the model it can hold (its memory planner's answer);
    ``tokens_per_s``: the decode throughput it expects to give them, when it knows one.
    """

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(pattern=HEX32)
    artifact: str = Field(pattern=HEX32)
    n_layer: int = Field(gt=0, le=MAX_LAYERS, strict=True)
    max_layers: int = Field(gt=0, le=MAX_LAYERS, strict=True)
    tokens_per_s: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    join_proof: str = Field(default="", max_length=64, pattern=r"^([0-9a-f]{64})?$")  # as a registration's


class PlacementReply(BaseModel):
    """The range the tracker gives a joining node, reserved for it for ``reserved_seconds``."""

    layers: LayerSpan
    n_layer: int = Field(gt=0, le=MAX_LAYERS)
    weakest: int = Field(ge=0, lt=MAX_LAYERS)  # the layer it was placed around
    weakest_capacity: float = Field(ge=0, allow_inf_nan=False)  # that layer's tokens/s before it: 0 uncovered
    reserved_seconds: float = Field(ge=0, allow_inf_nan=False)


class RebalanceRequest(BaseModel):
    """A serving node the tracker placed asks whether it should move (``POST /v1/placement/reconsider``, signed).

    ``max_layers``: how many layers of the model it can hold, as it told the tracker when placed.
    """

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(pattern=HEX32)
    max_layers: int = Field(gt=0, le=MAX_LAYERS, strict=True)


class RebalanceReply(BaseModel):
    """Stay (``layers`` None), or move to ``layers``, reserved for the node for ``reserved_seconds``.

    ``least_before`` and ``least_after``: the least tokens/s of the swarm's routes with the
    node where it is and where it would go; ``hold_seconds``: how long the tracker will not
    tell it to move again (after a move, its hold-down).
    """

    layers: LayerSpan | None = None
    least_before: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    least_after: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    hold_seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    reserved_seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class ProbeReply(BaseModel):
    """A node's answer to its probe challenge."""

    node_id: str = Field(pattern=HEX32)
    seed: int = Field(ge=0, lt=2**63)
    digest: str = Field(pattern=HEX32)
    sketch: list[Annotated[float, Field(ge=-1e30, le=1e30, allow_inf_nan=False)]] = Field(max_length=4096)


class RouteRequest(BaseModel):
    """What a gateway asks for."""

    artifact: str = Field(pattern=HEX32)
    tokens: int = Field(gt=0, le=1 << 22)
    exclude: list[str] = Field(default_factory=list, max_length=256)
    ttl_seconds: float = Field(default=600.0, gt=0, le=86400)
    # the key the gateway proves when it reaches a head through a relay; the ticket names it
    client: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    # nodes that hold this prompt's prefix in their caches (the route that served its start):
    # a route through them is taken when it has room
    prefer: list[str] = Field(default_factory=list, max_length=256)


class RepairRequest(BaseModel):
    """A route session's repair: the rest of its route after ``keep`` hops, under the next epoch.

    Signed (``access.signing``) by whoever repairs: the ticket's client for a whole new route
    (``keep`` 0, the session replayed from its tokens), or the hop just before the lost range
    (``keep`` its index plus one: it replays what it sent, the hops before it keep their KV).
    """

    ticket: str = Field(pattern=r"^([0-9a-f]{2})+$", max_length=2 * MAX_TICKET_BYTES)  # the session's current one
    keep: int = Field(ge=0, le=255)
    tokens: int = Field(gt=0, le=1 << 22)
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")  # the session's: a replacement of the same is exact
    exclude: list[str] = Field(default_factory=list, max_length=256)
    ttl_seconds: float = Field(default=600.0, gt=0, le=86400)


class RouteHop(BaseModel):
    """One hop of a route: a node, the layers it runs for the route, and how to reach it."""

    node_id: str = Field(pattern=HEX32)
    layers: LayerSpan
    address: str = Field(default="", max_length=300)  # HOST:PORT, or none: through the relay only
    relay: str = Field(default="", max_length=300)
    tls_cert_sha256: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    # on a route that mixes recipes (certified), the one this hop runs; "" on any other route
    recipe: str = Field(default="", pattern=r"^([0-9a-f]{16})?$")

    @classmethod
    def of(cls, hop: Hop) -> RouteHop:
        """The JSON form of ``hop``."""
        return cls(
            node_id=hop.node_id.hex(),
            layers=(hop.layers.start, hop.layers.end),
            address=hop.address,
            relay=hop.relay,
            tls_cert_sha256=hop.tls_cert_sha256.hex(),
            recipe=hop.recipe_fingerprint.hex(),
        )

    def hop(self) -> Hop:
        """The hop this names."""
        return Hop(
            bytes.fromhex(self.node_id),
            Span(*self.layers),
            self.address,
            self.relay,
            bytes.fromhex(self.tls_cert_sha256),
            bytes.fromhex(self.recipe),
        )


class RouteReply(BaseModel):
    """The tracker's answer to a :class:`RouteRequest`: a route and the ticket for one session on it."""

    session_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    epoch: int = Field(ge=0, lt=2**63)
    ticket: str = Field(pattern=r"^([0-9a-f]{2})+$", max_length=2 * MAX_TICKET_BYTES)
    recipe: str = Field(pattern=r"^[0-9a-f]{16}$")
    # what the tracker estimated the route costs per step, in ms
    cost_ms: float = Field(default=0.0, ge=0, le=MAX_COST_MS, allow_inf_nan=False)
    # the longest session every hop of the route can hold (prompt and reply); 0: not said
    ctx_per_session: int = Field(default=0, ge=0, le=1 << 22)
    hops: list[RouteHop] = Field(min_length=1, max_length=256)
    # a repair's route: whether it runs the session's recipe, so the continuation is bit-exact
    exact: bool = True


_HOPS: TypeAdapter[list[RouteHop]] = TypeAdapter(list[RouteHop])


def encode_hops(hops: Iterable[Hop]) -> list[dict[str, Any]]:
    """``hops`` as JSON values."""
    return [RouteHop.of(hop).model_dump(mode="json") for hop in hops]


def decode_hops(data: Any) -> tuple[Hop, ...]:
    """A JSON list of hops (as :func:`encode_hops` writes it); ``ValidationError`` when malformed."""
    return tuple(hop.hop() for hop in _HOPS.validate_python(data))


# --- the swarm map's JSON (``GET /v1/status`` and ``GET /v1/status/nodes``): what a page shows,
# aggregated by the tracker so that no answer grows with the number of nodes but the one page
# of nodes a reader asked for

ProbeState = Literal["passed", "failed", "pending", "none"]
NodeFilter = Literal["all", "admitted", "pending", "failed", "direct", "relay", "slow", "stale"]
NodeOrder = Literal["layers", "step", "load", "seen"]
MAX_PAGE = 200


class LayerSegment(BaseModel):
    """Consecutive layers ``[start, end)`` that the same nodes serve: one stretch of a model's layer strip."""

    start: int
    end: int
    nodes: int  # registered nodes holding these layers
    admitted: int  # of them, those routes may use (probe passed, or none required)
    tokens_per_s: float  # decode tokens per second the admitted ones give these layers together
    active_sessions: int
    slots: int
    thin: bool  # the least served layers of a model whose layers are not all served alike


class RangeBand(BaseModel):
    """The nodes of one layer range."""

    start: int
    end: int
    nodes: int
    admitted: int
    tokens_per_s: float


class RouteHopView(BaseModel):
    """A hop of a route the tracker would pick, as a page shows it."""

    node_id: str
    layers: tuple[int, int]
    device: str
    reachability: str


class RouteView(BaseModel):
    """A route the tracker would pick now, and its estimated cost per decode step."""

    hops: list[RouteHopView]
    cost_ms: float
    near_equal: bool  # within the spread of the cheapest: the tracker picks among these at random


class ModelView(BaseModel):
    """One model artifact's coverage: its layer strip, its ranges, its routes, counts of its nodes."""

    artifact: str
    name: str  # the name most of its nodes give it: a node's word, shown as text
    n_layer: int
    nodes: int
    admitted: int
    routable: bool
    segments: list[LayerSegment]
    bands: list[RangeBand]
    bands_not_shown: int  # ranges past the bands listed (most nodes first)
    routes: list[RouteView]  # the cheapest few
    route_count: int  # routes with room on every hop
    routes_capped: bool  # counting stopped at the enumeration's cap: there may be more
    active_sessions: int
    devices: dict[str, int]  # by kind of device (cpu, cuda, ...)
    drift_classes: dict[str, int]  # the most common few; "other" holds the rest
    reachability: dict[str, int]
    probes: dict[str, int]
    slow: int
    stale: int


class DepartedView(BaseModel):
    """A node that left lately (``left``: it said so; ``expired``: it fell silent)."""

    node_id: str
    model_name: str
    artifact: str
    layers: tuple[int, int]
    why: str
    seconds_ago: float


class SwarmStatus(BaseModel):
    """``GET /v1/status``: the swarm at a glance."""

    generated_unix: float
    heartbeat_seconds: float
    expire_after_seconds: float
    nodes: int
    routes_issued: int
    models: list[ModelView]
    departed: list[DepartedView]  # newest first


class NodeView(BaseModel):
    """One node as the map lists it: no address, relay URL or key, only what it serves and how well."""

    node_id: str
    model_name: str
    artifact: str
    n_layer: int
    layers: tuple[int, int]
    device: str
    drift_class: str  # the CPU kernels or device class its bits depend on (its recipe names it)
    reachability: str  # direct, relay-only or direct+relay
    active_sessions: int
    slots: int
    queue_depth: int
    step_ms: float  # recent engine time per batch, from its heartbeats
    estimated_step_ms: float  # what the tracker costs a step at one more session
    tokens_per_s: float
    probe: ProbeState
    probe_detail: str
    audit_failed: str  # why audits excluded it from routes; "" when they did not
    admitted: bool
    slow: bool  # slower per layer than twice the median of its model's nodes (tails against tails)
    stale: bool  # not heard from for more than two heartbeats
    seconds_since_heartbeat: float


class NodeQuery(BaseModel):
    """The query of ``GET /v1/status/nodes``: which nodes, in which order, which page."""

    model_config = ConfigDict(extra="forbid")

    artifact: str = Field(default="", pattern=r"^([0-9a-f]{64})?$")
    layer: int | None = Field(default=None, ge=0, lt=MAX_LAYERS)  # nodes holding this layer
    q: str = Field(default="", max_length=100)  # in the node id, model name, device or drift class
    state: NodeFilter = "all"
    sort: NodeOrder = "layers"
    offset: int = Field(default=0, ge=0, le=1 << 20)
    limit: int = Field(default=25, ge=1, le=MAX_PAGE)
    key: str = Field(default="", max_length=1000)  # the status key, when the tracker has one


class NodePage(BaseModel):
    """One page of the nodes a :class:`NodeQuery` selects; ``total`` counts all of them."""

    total: int
    offset: int
    limit: int
    nodes: list[NodeView]


# --- audits (``POST /v1/audits``, ``POST /v1/audits/report``; see tracker/audits.py)

MAX_AUDIT_RECORDS = 256  # usage records in one audited or audit session: one per hop
MAX_RECORD_BYTES = 4096  # a usage record's signed body


class AuditRequest(BaseModel):
    """A session's client asks for an audit route: other nodes for each hop of the session's route."""

    model_config = ConfigDict(extra="forbid")

    ticket: str = Field(pattern=r"^([0-9a-f]{2})+$", max_length=2 * MAX_TICKET_BYTES)  # the audited session's
    # nodes the client would not audit with (hex ids): read and ignored, for the tracker alone picks auditors
    exclude: list[str] = Field(default_factory=list, max_length=256)
    ttl_seconds: float = Field(default=600.0, gt=0, le=3600)
    # a third audit, through the referees the tracker's operator named, of a hop two auditors agreed against
    referee: bool = False

    @field_validator("exclude")
    @classmethod
    def _ids(cls, value: list[str]) -> list[str]:
        for node in value:
            if len(node) != 64 or node.strip("0123456789abcdef"):
                raise ValueError("exclude holds hex node ids")
        return value


class RecordJSON(BaseModel):
    """A signed usage record, as JSON carries it."""

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(pattern=HEX32)
    body: str = Field(max_length=2 * MAX_RECORD_BYTES, pattern=r"^([0-9a-f]{2})*$")
    signature: str = Field(pattern=r"^[0-9a-f]{128}$")

    @classmethod
    def of(cls, record: UsageRecord) -> RecordJSON:
        """The JSON form of ``record``."""
        return cls(node_id=record.node_id.hex(), body=record.body.hex(), signature=record.signature.hex())

    def record(self) -> UsageRecord:
        """The record itself."""
        return UsageRecord(bytes.fromhex(self.body), bytes.fromhex(self.node_id), bytes.fromhex(self.signature))


class AuditReport(BaseModel):
    """What an audit found: the audited session's records, and each audit session's (one, two, or two and a
    referee's)."""

    model_config = ConfigDict(extra="forbid")

    audited: list[RecordJSON] = Field(min_length=1, max_length=MAX_AUDIT_RECORDS)
    audits: dict[str, list[RecordJSON]] = Field(min_length=1, max_length=3)  # audit session id (hex) -> records

    @field_validator("audits")
    @classmethod
    def _sessions(cls, value: dict[str, list[RecordJSON]]) -> dict[str, list[RecordJSON]]:
        for session, records in value.items():
            if len(session) != 32 or session.strip("0123456789abcdef"):
                raise ValueError("audits are keyed by their session ids, in hex")
            if not 1 <= len(records) <= MAX_AUDIT_RECORDS:
                raise ValueError(f"an audit holds 1 to {MAX_AUDIT_RECORDS} records")
        return value


class AuditFailure(BaseModel):
    """A node two auditors agreed against (and, where it was excluded, a referee), and why."""

    node_id: str
    why: str


class AuditVerdict(BaseModel):
    """What the tracker concluded from an :class:`AuditReport` (node ids in hex)."""

    passed: list[str]
    suspected: list[str]
    failed: list[AuditFailure]
    outvoted: list[str]
    unjudged: list[str]
    # two auditors agreed against these and no referee confirmed it: the reporter avoids them, no one excludes them
    accused: list[AuditFailure] = Field(default_factory=list)
