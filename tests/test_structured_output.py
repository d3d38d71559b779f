"""Structured output: decoding constrained by a JSON schema or a grammar, end to end.

The official ``openai`` client talks to a real local system (tracker, relay, two
SmolLM2 shard nodes, gateway); the tail's llama.cpp sampler chain carries a grammar
sampler built from the request, so every reply parses and validates.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI

from noderuntime.services import localsystem
from protocol import Sampling, StatusCode
from tests.protocol_helpers import older_peers_refusal

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "colour", "address", "tags"],
    "additionalProperties": False,
}
FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PROMPTS = [
    f"Describe a {kind} as a JSON person record."
    for kind in (
        "baker",
        "sailor",
        "teacher",
        "pilot",
        "farmer",
        "poet",
        "doctor",
        "child",
        "painter",
        "miner",
        "judge",
        "chef",
        "nurse",
        "singer",
        "clown",
        "tailor",
        "soldier",
        "monk",
        "gardener",
        "runner",
    )
]


@pytest.fixture(scope="module")
def system(smol_system: localsystem.LocalSystem) -> localsystem.LocalSystem:
    return smol_system


@pytest.fixture
def client(system: localsystem.LocalSystem) -> OpenAI:
    return OpenAI(base_url=system.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(client: OpenAI, model: str, content: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=300, **extra
    )


def test_every_reply_validates_against_the_schema(client: OpenAI, system: localsystem.LocalSystem) -> None:
    # greedy and sampled, 20 prompts, 8 at a time
    def one(i: int) -> Any:
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}
        return _ask(client, system.model_id, PROMPTS[i], response_format=FORMAT, **sampling)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(len(PROMPTS))))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice  # the grammar ended the reply, not max_tokens
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_structured_reply_equals_the_whole_one(client: OpenAI, system: localsystem.LocalSystem) -> None:
    whole = _ask(client, system.model_id, PROMPTS[0], response_format=FORMAT, temperature=0)
    stream = client.chat.completions.create(
        model=system.model_id,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        max_tokens=300,
        response_format=FORMAT,
        temperature=0,
        stream=True,
    )
    text = "".join(choice.delta.content or "" for chunk in stream for choice in chunk.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_mode_gives_an_object(client: OpenAI, system: localsystem.LocalSystem) -> None:
    # a short object asked for, greedy: any JSON object may run past max_tokens (a sampled
    # one about cats once did, at 300), and a truncated reply cannot parse
    question = 'Reply with a JSON object whose only key is "ok", set to true.'
    reply = _ask(client, system.model_id, question, response_format={"type": "json_object"}, temperature=0)
    assert reply.choices[0].finish_reason == "stop", reply.choices[0]
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "extra",
    [
        {"grammar": 'root ::= "yes" | "no"'},  # llama.cpp's spelling
        {"guided_grammar": 'root ::= "yes" | "no"'},  # vLLM's
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"choice": ["yes", "no"]}},
    ],
    ids=["grammar", "guided_grammar", "guided_choice", "structured_outputs.choice"],
)
def test_peer_spellings_of_a_constraint_are_followed(
    client: OpenAI, system: localsystem.LocalSystem, extra: dict[str, Any]
) -> None:
    reply = _ask(client, system.model_id, "Is the sky green?", extra_body=extra, temperature=0.9, seed=3)
    assert reply.choices[0].message.content in ("yes", "no")


def test_a_schema_given_as_text_is_followed(client: OpenAI, system: localsystem.LocalSystem) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = _ask(client, system.model_id, "Are you ok?", extra_body={"guided_json": json.dumps(schema)}, temperature=0)
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    done = client.completions.create(
        model=system.model_id, prompt="A person:", max_tokens=300, extra_body={"json_schema": PERSON}, temperature=0
    )
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"grammar": "root ::= ["}, "grammar"),
        ({"grammar": 'start ::= "a"'}, "grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "[a-z]+"}, "guided_regex"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        ({"grammar": 'root ::= "a"', "guided_choice": ["a"]}, "guided_choice"),
    ],
    ids=["bad-schema", "no-schema", "bad-gbnf", "no-root", "bad-schema-text", "regex", "so-regex", "two"],
)
def test_bad_constraints_are_400s_that_reach_no_node(
    system: localsystem.LocalSystem, body: dict[str, Any], param: str
) -> None:
    nodes = [p.info.http for p in system.processes if p.name.startswith("node")]
    before = [httpx.get(u + "/metrics", timeout=10).text.count("sessions_opened") for u in nodes]
    request = {"model": system.model_id, "messages": [{"role": "user", "content": "hi"}], **body}
    response = httpx.post(system.gateway_url + "/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    after = [httpx.get(u + "/metrics", timeout=10).text.count("sessions_opened") for u in nodes]
    assert before == after


def test_logit_bias_bans_and_forces_tokens(client: OpenAI, system: localsystem.LocalSystem) -> None:
    ask = {"model": system.model_id, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    plain = client.completions.create(**ask)  # type: ignore[call-overload]
    tokenize = httpx.post(system.gateway_url + "/tokenize", json={"content": plain.choices[0].text}, timeout=10)
    first = tokenize.json()["tokens"][0]
    banned = client.completions.create(**ask, logit_bias={str(first): -100})  # type: ignore[call-overload]
    assert banned.choices[0].text and not banned.choices[0].text.startswith(plain.choices[0].text)
    forced = client.completions.create(**ask, logit_bias={"42": 100})  # type: ignore[call-overload]
    detokenize = httpx.post(system.gateway_url + "/detokenize", json={"tokens": [42] * 4}, timeout=10)
    assert forced.choices[0].text == detokenize.json()["content"]
    refused = httpx.post(system.gateway_url + "/v1/completions", json={**ask, "logit_bias": {"1000000": 5}}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"


def test_a_string_in_a_schema_admits_no_raw_control_character(client: OpenAI, system: localsystem.LocalSystem) -> None:
    # newline and tab pushed up as far as logit_bias goes: the grammar must still keep them
    # out of the string, where JSON allows them only escaped
    tokenize = httpx.post(system.gateway_url + "/tokenize", json={"content": "\n\t"}, timeout=10)
    forced = {str(token): 100 for token in tokenize.json()["tokens"]}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}
    reply = _ask(
        client,
        system.model_id,
        "Name a pet.",
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}},
        logit_bias=forced,
        temperature=0,
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)  # json.loads refuses raw control characters in strings


# --- the seam: a peer below schema 1.1 would ignore a grammar, so it is refused


def test_a_peer_that_predates_grammars_is_refused_for_a_grammar_session() -> None:
    for sampling, refused in (
        (Sampling(grammar='root ::= "a"'), True),
        (Sampling(logit_bias=((7, -100.0),)), True),
        (Sampling(), False),
    ):
        refusal = older_peers_refusal(sampling, minor=0)
        if refused:
            assert refusal is not None and refusal.code is StatusCode.UNIMPLEMENTED and "1.1" in refusal.message
        else:
            assert refusal is None


def test_a_grammar_session_cancelled_mid_reply_frees_its_grammar(system: localsystem.LocalSystem) -> None:
    body = {
        "model": system.model_id,
        "messages": [{"role": "user", "content": PROMPTS[3]}],
        "max_tokens": 300,
        "response_format": FORMAT,
        "stream": True,
    }
    with httpx.stream("POST", system.gateway_url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # hang up mid-reply
    urls = [p.info.http + "/status" for p in system.processes if p.name.startswith("node")]
    deadline = time.monotonic() + 20
    while True:
        states = [httpx.get(u, timeout=10).json() for u in urls]
        if all(s["active_sessions"] == 0 and s["kv_cells"] == 0 for s in states):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.1)
    # the tail's sampler chain, grammar state and all, is freed with the session
    assert [s["samplers_live"] for s in states] == [0, 0]


def test_a_grammar_no_token_can_follow_ends_the_reply_not_the_node(
    client: OpenAI, system: localsystem.LocalSystem
) -> None:
    # no token's piece starts with a NUL: the grammar allows nothing, from the first token on
    dead = _ask(client, system.model_id, "Say something.", extra_body={"grammar": 'root ::= "\\x00"'})
    assert dead.choices[0].message.content == "" and dead.choices[0].finish_reason == "stop"
    alive = _ask(client, system.model_id, "Is the sky green?", extra_body={"guided_choice": ["yes", "no"]})
    assert alive.choices[0].message.content in ("yes", "no")
