"""JSON that others write (tickets, relay control messages, usage records, route grants, ready lines) is
refused, typed, however built; each typed message reads back what it writes."""

from __future__ import annotations

import json
import struct

import pydantic
import pytest

from noderuntime.access import tickets
from noderuntime.access.identity import Identity
from noderuntime.control.ledger import USAGE_DOMAIN, Ledger, check
from noderuntime.services import ready
from noderuntime.tracker.messages import Registration, RouteHop, RouteReply, decode_hops, encode_hops
from noderuntime.transport import relay_messages as m
from protocol import Hop, Span, UsageRecord

# each breaks a parser that only expects ValueError: RecursionError, int(inf), a non-object
HOSTILE = ["[" * 5000, '{"epoch": 1e999}', "1e999", '"text"', "[1, 2]", "{" + '"a":' * 3000 + "1"]


def _ticket_with_body(body: bytes, issuer: Identity) -> bytes:
    return tickets.MAGIC + struct.pack(">H", len(body)) + body + issuer.sign(tickets.DOMAIN, body)


@pytest.mark.parametrize("body", HOSTILE)
def test_a_ticket_whose_body_breaks_parsers_is_refused(body: str) -> None:
    issuer = Identity.generate()  # signed by the trusted issuer, even: the body itself is refused
    with pytest.raises(tickets.TicketError) as refused:
        tickets.decode(_ticket_with_body(body.encode(), issuer), [issuer.node_id])
    assert "malformed" in str(refused.value)


def test_a_ticket_whose_numbers_are_not_integers_is_refused() -> None:
    issuer = Identity.generate()
    good = json.loads(
        tickets.issue(issuer, session_id=bytes(16), epoch=1, artifact=bytes(32), hops=[Hop(bytes(32), Span(0, 30))])[
            6:-64
        ]
    )
    assert tickets.decode(_ticket_with_body(json.dumps(good).encode(), issuer), [issuer.node_id]).epoch == 1
    for key, value in [("epoch", 1e300), ("epoch", True), ("exp", "5"), ("epoch", -1), ("hops", [["00", 0, 1.5]])]:
        body = json.dumps({**good, key: value}).encode()
        with pytest.raises(tickets.TicketError):
            tickets.decode(_ticket_with_body(body, issuer), [issuer.node_id])


@pytest.mark.parametrize("text", [*HOSTILE, "[" * (m.MAX_CONTROL_BYTES - 10)])
def test_a_relay_control_message_that_breaks_parsers_is_a_control_error(text: str) -> None:
    with pytest.raises(m.ControlError):
        m.decode(text, m.Dial)


@pytest.mark.parametrize(
    "change",
    [
        {"layers": {"a": 1}},
        {"layers": 5},
        {"layers": [[0], [30]]},
        {"decode_tokens": {"x": 1}},
        {"decode_tokens": 2**70},
        {"bytes_in": -1},
        {"compute_ms": "fast"},
        {"compute_ms": None},
    ],
)
def test_a_signed_usage_record_with_nonsense_fields_is_flagged_and_ledgered(
    change: dict[str, object], tmp_path: object
) -> None:
    node = Identity.generate()
    hops = [Hop(node.node_id, Span(0, 30))]
    fields = {
        "node_id": node.node_id.hex(),
        "request_id": "r1",
        "layers": [0, 30],
        "prefill_tokens": 5,
        "decode_tokens": 3,
        "compute_ms": 1.5,
        "bytes_in": 10,
        "bytes_out": 20,
    }
    sound = json.dumps(fields).encode()
    assert check(UsageRecord(sound, node.node_id, node.sign(USAGE_DOMAIN, sound)), request_id="r1", hops=hops).valid
    body = json.dumps({**fields, **change}).encode()
    verdict = check(UsageRecord(body, node.node_id, node.sign(USAGE_DOMAIN, body)), request_id="r1", hops=hops)
    assert not verdict.valid and verdict.problem
    ledger = Ledger(f"{tmp_path}/ledger.sqlite")
    ledger.append(
        request_id="r1",
        model="m",
        artifact="ab" * 32,
        created=0.0,
        prompt_tokens=5,
        completion_tokens=3,
        finish_reason="stop",
        records=[verdict],
    )
    assert ledger.totals()["flagged"] == [
        {"request_id": "r1", "node_id": node.node_id.hex(), "problem": verdict.problem}
    ]


@pytest.mark.parametrize("body", HOSTILE)
def test_a_usage_record_body_that_breaks_parsers_is_flagged(body: str) -> None:
    node = Identity.generate()
    record = UsageRecord(body.encode(), node.node_id, node.sign(USAGE_DOMAIN, body.encode()))
    verdict = check(record, request_id="r1", hops=[Hop(node.node_id, Span(0, 30))])
    assert not verdict.valid


# --- relay control messages

NONCE, NODE, SIGNATURE, SESSION = b"\x01" * 32, b"\x02" * 32, b"\x03" * 64, b"\x04" * 16


@pytest.mark.parametrize(
    ("message", "text"),
    [
        (m.Challenge(NONCE), '{"type":"challenge","nonce":"' + NONCE.hex() + '"}'),
        (m.Hello(NODE, SIGNATURE), f'{{"type":"hello","node_id":"{NODE.hex()}","signature":"{SIGNATURE.hex()}"}}'),
        (m.Welcome(), '{"type":"welcome"}'),
        (m.Incoming(SESSION), '{"type":"incoming","pair":"' + SESSION.hex() + '"}'),
        (
            m.Dial(NODE, SESSION, 7, b"\xab\xcd"),
            f'{{"type":"dial","target":"{NODE.hex()}","session":"{SESSION.hex()}","epoch":7,"ticket":"abcd"}}',
        ),
        (m.Paired(), '{"type":"paired"}'),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, m.Message) else "",
)
def test_a_relay_control_message_reads_back_what_it_writes_in_the_format_peers_speak(
    message: m.Message, text: str
) -> None:
    assert message.encode() == text  # byte for byte what relays and nodes of earlier versions send
    assert m.decode(text, type(message)) == message


def _dial(**change: object) -> str:
    fields = {"type": "dial", "target": NODE.hex(), "session": SESSION.hex(), "epoch": 0, "ticket": "00", **change}
    return json.dumps({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        pytest.param(m.Hello(NODE, SIGNATURE).encode(), m.Dial, id="another-type"),
        pytest.param('{"nonce": "' + NONCE.hex() + '"}', m.Challenge, id="no-type"),
        pytest.param(_dial(target=None), m.Dial, id="missing-target"),
        pytest.param(_dial(ticket=None), m.Dial, id="missing-ticket"),
        pytest.param(_dial(epoch=None), m.Dial, id="missing-epoch"),
        pytest.param(_dial(target=5), m.Dial, id="target-not-text"),
        pytest.param(_dial(target="zz" * 32), m.Dial, id="target-not-hex"),
        pytest.param(_dial(ticket="abc"), m.Dial, id="ticket-odd-hex"),
        pytest.param(_dial(target=NODE[:31].hex()), m.Dial, id="target-short"),
        pytest.param(_dial(session=(SESSION + b"x").hex()), m.Dial, id="session-long"),
        pytest.param(_dial(epoch=-1), m.Dial, id="epoch-negative"),
        pytest.param(_dial(epoch=True), m.Dial, id="epoch-bool"),
        pytest.param(_dial(epoch=1.5), m.Dial, id="epoch-float"),
        pytest.param(_dial(epoch="3"), m.Dial, id="epoch-text"),
        pytest.param(_dial(epoch=2**64), m.Dial, id="epoch-huge"),
        pytest.param('{"type": "dial", "epoch": 1e999}', m.Dial, id="epoch-inf"),
        pytest.param(_dial(ticket="00" * (m.MAX_CONTROL_BYTES // 2)), m.Dial, id="oversized"),
        pytest.param(m.Paired().encode().encode(), m.Paired, id="binary"),
        pytest.param('{"type":"hello","node_id":"' + NODE.hex() + '"}', m.Hello, id="missing-signature"),
        pytest.param(m.Hello(NODE, SIGNATURE[:63]).encode(), m.Hello, id="signature-short"),
        pytest.param('{"type":"challenge","nonce":["01"]}', m.Challenge, id="nonce-a-list"),
        pytest.param('{"type":"incoming","pair":"ab"}', m.Incoming, id="pair-short"),
    ],
)
def test_a_malformed_relay_control_message_is_a_control_error(text: str | bytes, kind: type[m.Message]) -> None:
    with pytest.raises(m.ControlError):
        m.decode(text, kind)


# --- hops and route grants, as the tracker writes them and gateways and route clients read them

HOPS = (
    Hop(NODE, Span(0, 15), "10.0.0.1:7000", "", b"\x05" * 32),
    Hop(b"\x06" * 32, Span(15, 30), "", "wss://relay.example:443", recipe_fingerprint=b"\x07" * 8),
)


def test_hops_read_back_what_they_write_with_the_keys_gateways_expect() -> None:
    encoded = encode_hops(HOPS)
    assert encoded[1] == {
        "node_id": "06" * 32,
        "layers": [15, 30],
        "address": "",
        "relay": "wss://relay.example:443",
        "tls_cert_sha256": "",
        "recipe": "07" * 8,  # on a route that mixes recipes
    }
    assert encoded[0]["recipe"] == ""
    assert decode_hops(json.loads(json.dumps(encoded))) == HOPS
    reply = RouteReply(
        session_id=SESSION.hex(),
        epoch=0,
        ticket="abcd",
        recipe="12" * 8,
        cost_ms=1.5,
        ctx_per_session=512,
        hops=[RouteHop.of(hop) for hop in HOPS],
    )
    text = json.dumps(reply.model_dump(mode="json"))
    assert list(json.loads(text)) == [
        "session_id",
        "epoch",
        "ticket",
        "recipe",
        "cost_ms",
        "ctx_per_session",
        "hops",
        "exact",
    ]
    assert tuple(hop.hop() for hop in RouteReply.model_validate_json(text).hops) == HOPS


@pytest.mark.parametrize(
    "change",
    [
        {"node_id": "ab"},
        {"node_id": "zz" * 32},
        {"node_id": None},
        {"layers": [5, 5]},
        {"layers": [0]},
        {"layers": [-1, 3]},
        {"layers": "0:15"},
        {"address": 7},
        {"tls_cert_sha256": "xy" * 32},
        {"tls_cert_sha256": "ab"},
        {"recipe": "12" * 7},
        {"recipe": "zz" * 8},
        {"recipe": 5},
    ],
)
def test_a_malformed_hop_is_a_validation_error(change: dict[str, object]) -> None:
    hop = {**encode_hops(HOPS)[0], **change}
    with pytest.raises(pydantic.ValidationError):
        decode_hops([{k: v for k, v in hop.items() if v is not None}])


@pytest.mark.parametrize("text", [*HOSTILE, '{"hops": []}', '{"hops": 5}'])
def test_a_route_grant_that_breaks_parsers_is_a_validation_error(text: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        RouteReply.model_validate_json(text)


# --- ready lines

NODE_READY = ready.NodeReady(
    node_id=NODE.hex(),
    artifact="cd" * 32,
    n_layer=30,
    layers=(0, 15),
    recipe="ef" * 8,
    address="127.0.0.1:7000",
    relay="ws://127.0.0.1:7001",
    tls_cert_sha256="",
    slots=4,
    ctx_per_session=512,
    pid=42,
    http="http://127.0.0.1:7002",
    capability={"decode_ms": [[1, 2.5]]},
)


@pytest.mark.parametrize(
    "line",
    [
        NODE_READY,
        ready.RelayReady(url="ws://127.0.0.1:7001", port=7001, pid=43, http=""),
        ready.TrackerReady(url="http://127.0.0.1:7003", issuer_key="ab" * 32, pid=44),
        ready.GatewayReady(url="http://127.0.0.1:8080", models=("a", "b"), pid=45),
        ready.SystemReady(url="http://127.0.0.1:8080", tracker="http://127.0.0.1:7003", model="a"),
    ],
    ids=lambda line: line.PROCESS,
)
def test_a_ready_line_reads_back_what_it_writes(line: ready.Ready) -> None:
    text = ready.dump(line)
    assert text.startswith(ready.PREFIX) and "\n" not in text
    assert ready.parse(text) == line
    assert ready.expect(ready.parse(text), type(line)) == line


def test_a_node_ready_line_names_its_hop() -> None:
    assert NODE_READY.hop() == Hop(NODE, Span(0, 15), "127.0.0.1:7000", "ws://127.0.0.1:7001")


def test_a_node_ready_line_carries_the_description_its_registration_does() -> None:
    registration = Registration.of(NODE_READY, {"body": "{}", "signature": ""})
    assert registration.description() == NODE_READY.description()
    assert registration.capability == {"body": "{}", "signature": ""}


@pytest.mark.parametrize(
    "change",
    [
        {"event": "started"},
        {"process": "printer"},
        {"pid": None},
        {"pid": "42"},
        {"pid": True},
        {"n_layer": 30.0},
        {"layers": [0, 15, 30]},
        {"layers": [0, "15"]},
        {"layers": 15},
        {"capability": []},
        {"node_id": "ab"},
        {"node_id": "zz" * 32},
        {"tls_cert_sha256": "ab"},
        {"address": None},
        # bounded as a registration is: the description is one type
        {"n_layer": 0},
        {"slots": 5000},
        {"address": "nowhere"},
        {"model_name": None},
    ],
)
def test_a_malformed_ready_line_is_a_ready_error(change: dict[str, object]) -> None:
    fields = {**json.loads(ready.dump(NODE_READY)), **change}
    with pytest.raises(ready.ReadyError):
        ready.parse(json.dumps({k: v for k, v in fields.items() if v is not None}))


@pytest.mark.parametrize("text", [*HOSTILE, "", "ready"])
def test_a_ready_line_that_breaks_parsers_is_a_ready_error(text: str) -> None:
    with pytest.raises(ready.ReadyError):
        ready.parse(text)


def test_a_ready_line_of_another_process_is_a_ready_error() -> None:
    with pytest.raises(ready.ReadyError, match="relay"):
        ready.expect(NODE_READY, ready.RelayReady)
