"""The ``ready`` line: what a process prints on stdout, once, when it serves.

One JSON object on one line, ``{"event": "ready", "process": KIND, ...}``, whose fields
depend on the kind of process: :class:`NodeReady`, :class:`RelayReady`,
:class:`TrackerReady`, :class:`GatewayReady` and :class:`SystemReady` (``noderuntime up``
with no arguments). The process writes it with :func:`dump`; whoever started it reads
it with :func:`parse`, which raises :class:`ReadyError` on anything malformed.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any, ClassVar, TypeVar

import attrs
import pydantic

from noderuntime.access import untrusted
from noderuntime.tracker.messages import NodeDescription, RouteHop
from protocol import Hop

PREFIX = '{"event": "ready"'  # every ready line starts so; other output never does


class ReadyError(ValueError):
    """A ready line is malformed, or not of the kind expected."""


_HEX = "hex"  # in a field's metadata: (bytes, whether empty is allowed) of a hex string


def _hex(size: int, *, optional: bool = False) -> dict[str, tuple[int, bool]]:
    return {_HEX: (size, optional)}


class NodeReady(NodeDescription):
    """A shard node serves: what it told the tracker (its description, bounded as a registration's),
    and where its status is.

    A pydantic model where the other kinds are attrs classes: its description is the one a
    registration carries, read by the same validators.
    """

    PROCESS: ClassVar[str] = "node"
    pid: int
    http: str  # its /status and /metrics endpoint, or none
    capability: dict[str, Any]  # what it measured (admission.Capability.to_json())

    def hop(self) -> Hop:
        """The node as a hop of a route plan (as a route grant would name it)."""
        return RouteHop(
            node_id=self.node_id,
            layers=self.layers,
            address=self.address,
            relay=self.relay,
            tls_cert_sha256=self.tls_cert_sha256,
        ).hop()


@attrs.frozen
class RelayReady:
    """A relay serves."""

    PROCESS: ClassVar[str] = "relay"
    url: str  # ws:// or wss://
    port: int
    pid: int
    http: str  # its /status and /metrics endpoint, or none


@attrs.frozen
class TrackerReady:
    """A tracker serves."""

    PROCESS: ClassVar[str] = "tracker"
    url: str
    issuer_key: str = attrs.field(metadata=_hex(32))  # the key its session tickets are signed with
    pid: int


@attrs.frozen
class GatewayReady:
    """A gateway serves."""

    PROCESS: ClassVar[str] = "gateway"
    url: str
    models: tuple[str, ...]
    pid: int


@attrs.frozen
class SystemReady:
    """The local system (``noderuntime up`` with no arguments) serves."""

    PROCESS: ClassVar[str] = "local"
    url: str  # the gateway
    tracker: str
    model: str


Ready = NodeReady | RelayReady | TrackerReady | GatewayReady | SystemReady
R = TypeVar("R", NodeReady, RelayReady, TrackerReady, GatewayReady, SystemReady)

_KINDS: dict[str, type[Ready]] = {
    kind.PROCESS: kind for kind in (NodeReady, RelayReady, TrackerReady, GatewayReady, SystemReady)
}


def dump(ready: Ready) -> str:
    """The ready line (without its newline)."""
    fields = ready.model_dump(mode="json") if isinstance(ready, pydantic.BaseModel) else attrs.asdict(ready)
    return json.dumps({"event": "ready", "process": ready.PROCESS, **fields})


def parse(line: str) -> Ready:
    """A ready line read back; :class:`ReadyError` when it is not one, or is malformed."""
    try:
        data = untrusted.json_object(line, "the ready line")
    except ValueError as exc:
        raise ReadyError(str(exc)) from None
    if data.get("event") != "ready":
        raise ReadyError("not a ready line")
    kind = _KINDS.get(str(data.get("process")))
    if kind is None:
        raise ReadyError(f"a ready line of no known process: {data.get('process')!r:.40}")
    if issubclass(kind, pydantic.BaseModel):
        return _model(line, data, kind)
    hints = typing.get_type_hints(kind)
    values = {}
    for field in attrs.fields(kind):
        if field.name not in data:
            raise ReadyError(f"the {kind.PROCESS}'s ready line has no {field.name}")
        values[field.name] = _value(data[field.name], hints[field.name], f"{kind.PROCESS} {field.name}")
        if _HEX in field.metadata:
            size, optional = field.metadata[_HEX]
            _check_hex(values[field.name], size, optional, f"{kind.PROCESS} {field.name}")
    return kind(**values)


def _model(line: str, data: dict[str, Any], kind: type[NodeReady]) -> NodeReady:
    """A ready line of a ``kind`` that pydantic reads: strictly (an int is no float or bool, a list no
    string), every field present (defaults are for registrations, not for ready lines)."""
    for name in kind.model_fields:
        if name not in data:
            raise ReadyError(f"the {kind.PROCESS}'s ready line has no {name}")
    try:
        return kind.model_validate_json(line, strict=True)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ReadyError(f"{kind.PROCESS} {where}: {first['msg']}") from None


def expect(ready: Ready, kind: type[R]) -> R:
    """``ready`` if it is a ``kind``; :class:`ReadyError` otherwise."""
    if not isinstance(ready, kind):
        raise ReadyError(f"expected the ready line of a {kind.PROCESS}, not of a {ready.PROCESS}")
    return ready


def _value(value: Any, hint: Any, what: str) -> Any:
    """``value`` as a ``hint`` (str, int, a tuple or a dict of JSON), or :class:`ReadyError`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (str, int):
        if type(value) is not hint:  # bool is an int, but not here
            raise ReadyError(f"{what} must be a {hint.__name__}, not {value!r:.40}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ReadyError(f"{what} must be a list, not {value!r:.40}")
        items = args[:1] * len(value) if args[-1:] == (...,) else args  # tuple[str, ...] or tuple[int, int]
        if len(value) != len(items):
            raise ReadyError(f"{what} must be a list of {len(items)}, not {value!r:.40}")
        return tuple(_value(item, item_hint, what) for item, item_hint in zip(value, items, strict=True))
    if origin is dict:
        if not isinstance(value, dict):
            raise ReadyError(f"{what} must be an object, not {value!r:.40}")
        return value
    raise TypeError(f"no reader for {hint!r}")  # a field of a type this module does not read


_HEX_DIGITS = re.compile(r"[0-9a-f]*")


def _check_hex(value: str, size: int, optional: bool, what: str) -> None:
    if not (optional and not value) and (len(value) != 2 * size or not _HEX_DIGITS.fullmatch(value)):
        raise ReadyError(f"{what} must be {size} bytes in hex, not {value!r:.80}")
