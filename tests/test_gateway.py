"""The whole system through the official OpenAI client: tracker, relay, two nodes, gateway."""

from __future__ import annotations

import collections
import json
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from noderuntime.engine.llama import Vocab
from noderuntime.services import localsystem
from noderuntime.services.cluster import ManagedProcess, start_all, stop_all
from noderuntime.services.ready import GatewayReady, NodeReady, R, TrackerReady, expect
from noderuntime.testing.clusters import local_gateway_args, local_tracker_args

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "max_tokens": 24}
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def system(smol_system: localsystem.LocalSystem) -> localsystem.LocalSystem:
    return smol_system


@pytest.fixture(scope="module")
def endless(smollm2: Path) -> dict[str, float]:
    """A ``logit_bias`` that bans every end-of-generation token: a request runs to its max_tokens.

    A test that must still be generating when its client leaves cannot rely on a prompt's
    answer being long: the model's answer to one changes with the low bits of its kernels.
    """
    return {str(token): -100.0 for token in Vocab(smollm2).eog_tokens}


@pytest.fixture
def client(system: localsystem.LocalSystem) -> OpenAI:
    return OpenAI(base_url=system.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
        return data


def _wait_nodes_idle(system: localsystem.LocalSystem, within: float = 20.0) -> None:
    urls = [p.info.http for p in system.processes if p.name.startswith("node")]
    deadline = time.monotonic() + within
    while True:
        states = [_get(u + "/status") for u in urls]
        if all(s["active_sessions"] == 0 and s["slots_leased"] == 0 and s["kv_cells"] == 0 for s in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def test_models_are_listed(client: OpenAI, system: localsystem.LocalSystem) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [system.model_id]


def test_chat_stream_and_non_stream_agree(client: OpenAI, system: localsystem.LocalSystem) -> None:
    whole = client.chat.completions.create(model=system.model_id, messages=MESSAGES, **GREEDY)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens <= 24 and whole.usage.prompt_tokens > 5
    streamed = client.chat.completions.create(
        model=system.model_id, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    pieces, finish, usage = [], None, None
    for chunk in streamed:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_text_completions(client: OpenAI, system: localsystem.LocalSystem) -> None:
    done = client.completions.create(
        model=system.model_id, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert done.choices[0].text and done.choices[0].finish_reason == "length"
    assert done.usage is not None and done.usage.completion_tokens == 8


def test_stop_strings_and_max_tokens(client: OpenAI, system: localsystem.LocalSystem) -> None:
    full = client.completions.create(model=system.model_id, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length"
    word = text.strip().split()[2]  # stop at the third item the model writes
    cut = client.completions.create(
        model=system.model_id, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[word]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(word)]
    short = client.completions.create(model=system.model_id, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0)
    assert short.usage is not None and short.usage.completion_tokens == 3


def test_unsupported_options_at_their_defaults_are_accepted(system: localsystem.LocalSystem) -> None:
    body = {
        "model": system.model_id,
        "messages": MESSAGES,
        "max_tokens": 4,
        "stream": None,
        "top_p": 0,
        "response_format": {"type": "text"},
        "tool_choice": "none",
    }
    response = httpx.post(system.gateway_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_same_seed_same_text(client: OpenAI, system: localsystem.LocalSystem) -> None:
    def sample(seed: int) -> str:
        done = client.chat.completions.create(
            model=system.model_id, messages=MESSAGES, temperature=0.9, max_tokens=20, seed=seed, top_p=0.95
        )
        return done.choices[0].message.content or ""

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": MESSAGES, "temperature": 3}, 400, "temperature"),
        ({"messages": []}, 400, "messages"),
        ({"messages": MESSAGES, "n": 9}, 400, "n"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"messages": MESSAGES, "max_tokens": 100000}, 400, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ({"model": "no-such-model", "messages": MESSAGES}, 404, "model"),
    ],
)
def test_bad_requests_get_openai_errors(
    system: localsystem.LocalSystem, body: dict[str, Any], status: int, param: str | None
) -> None:
    request = {"model": system.model_id, **body}
    response = httpx.post(system.gateway_url + "/v1/chat/completions", json=request, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


def test_bad_json_and_the_official_client_errors(client: OpenAI, system: localsystem.LocalSystem) -> None:
    raw = httpx.post(
        system.gateway_url + "/v1/chat/completions",
        content=b"{not json",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert raw.status_code == 400 and "error" in raw.json()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=system.model_id, messages=MESSAGES, top_p=1.5)


def test_many_concurrent_clients(client: OpenAI, system: localsystem.LocalSystem) -> None:
    def one(i: int) -> str:
        done = client.chat.completions.create(
            model=system.model_id,
            temperature=0,
            max_tokens=12,
            messages=[{"role": "user", "content": f"Count to {i}."}],
        )
        return done.choices[0].message.content or ""

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(one, range(12)))
    assert all(answers)
    assert answers[3] == one(3)  # batched or alone, the same greedy text
    _wait_nodes_idle(system)


def test_a_client_that_disconnects_mid_stream_frees_every_node(
    system: localsystem.LocalSystem, endless: dict[str, float]
) -> None:
    request = {"model": system.model_id, "messages": MESSAGES, "max_tokens": 600, "temperature": 0, "stream": True}
    request["logit_bias"] = endless
    with httpx.stream("POST", system.gateway_url + "/v1/chat/completions", json=request, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(12):
            next(lines)
        busy = [_get(p.info.http + "/status") for p in system.processes if p.name.startswith("node")]
        assert all(s["active_sessions"] == 1 for s in busy)
    # the connection is closed here, in the middle of the generation
    _wait_nodes_idle(system, within=10)


def test_a_client_that_gives_up_on_a_non_streaming_request_frees_every_node(
    system: localsystem.LocalSystem, endless: dict[str, float]
) -> None:
    _wait_nodes_idle(system)
    request = {"model": system.model_id, "messages": MESSAGES, "max_tokens": 600, "temperature": 0}
    request["logit_bias"] = endless
    # the client times out reading and closes the connection, the generation far from done
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(system.gateway_url + "/v1/chat/completions", json=request, timeout=httpx.Timeout(10, read=1.5))
    _wait_nodes_idle(system, within=3)
    assert _get(system.gateway_url + "/status")["counters"]["cancelled"] >= 1


# seconds without a heartbeat before the tracker drops a node, in the route-around test,
# and the interval its nodes beat at: a node is dropped EXPIRE - BEAT to EXPIRE s after it died
EXPIRE = 4
BEAT = 1


def _wait_dropped(tracker_url: str, node_id: str, within: float) -> None:
    deadline = time.monotonic() + within
    while any(n["node_id"] == node_id for n in _get(tracker_url + "/v1/nodes")["nodes"]):
        assert time.monotonic() < deadline, f"the tracker kept {node_id[:12]} {within} s after it was killed"
        time.sleep(0.2)


def test_killed_nodes_are_routed_around_then_no_route_is_503(smollm2: Path, tmp_path: Path) -> None:
    processes: list[ManagedProcess] = []

    def launch(name: str, args: list[str], kind: type[R]) -> R:
        process = ManagedProcess(name, args)
        processes.append(process)
        return expect(process.start(90), kind)

    try:
        tracker = launch(
            "tracker",
            local_tracker_args(tmp_path / "t", "--expire-after", str(EXPIRE), "--heartbeat-seconds", str(BEAT)),
            TrackerReady,
        )
        # the four nodes start together, as a local system's do
        nodes = []
        for name, layers in (("a", "0:15"), ("b", "15:30"), ("c", "0:15"), ("d", "15:30")):
            args = ["up", "--model", str(smollm2), "--layers", layers, "--listen", "127.0.0.1:0"]
            args += ["--tracker", tracker.url, "--data-dir", str(tmp_path / name), "--slots", "4", "--ctx", "512"]
            nodes.append(ManagedProcess(name, args))
        processes.extend(nodes)
        ids = {node.name: expect(line, NodeReady).node_id for node, line in zip(nodes, start_all(nodes), strict=True)}
        gateway = launch(
            "gateway",
            [
                "gateway",
                "--data-dir",
                str(tmp_path / "gateway"),
                "--tracker",
                tracker.url,
                "--listen",
                "127.0.0.1:0",
                "--model",
                f"smollm2-135m={smollm2}",
                "--ctx",
                "512",
            ],
            GatewayReady,
        )
        url = gateway.url

        def ask() -> httpx.Response:
            # no prefix reuse: the same prompt would keep to the route that holds it
            body = {"model": "smollm2-135m", "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
            return httpx.post(url + "/v1/chat/completions", timeout=60, json={**body, "cache_prompt": False})

        first = ask()
        assert first.status_code == 200
        served_at = time.time()
        # kill the tail the tracker costs cheapest: it picks among routes within 10 % of the
        # cheapest, and a tail measured slower at start, or one that reported the slow ticks
        # of a request it served, might never be chosen while the other lives. Costs are read
        # once both tails have heartbeated since that request: the killed one's stays frozen.
        while True:
            tails = [n for n in _get(tracker.url + "/v1/nodes")["nodes"] if n["layers"] == [15, 30]]
            if all(time.time() - n["seconds_since_heartbeat"] > served_at for n in tails):
                break
            assert time.time() - served_at < 10, f"the tails did not heartbeat: {tails}"
            time.sleep(0.2)
        cheapest = min(tails, key=lambda n: n["estimated_step_ms"])["node_id"]
        killed, other = ("b", "d") if ids["b"] == cheapest else ("d", "b")
        by_name = {p.name: p for p in processes}
        retries_before = _get(url + "/status")["counters"]["retries"]
        by_name[killed].signal(signal.SIGKILL)
        killed_at = time.monotonic()
        # before the tracker notices (it keeps the killed node for EXPIRE seconds after its
        # last heartbeat), a route through it fails before its first token and the gateway
        # retries elsewhere: ask until a request has met it, each one served
        results: list[int] = []
        while _get(url + "/status")["counters"]["retries"] == retries_before:
            assert time.monotonic() - killed_at < EXPIRE - BEAT, f"no request met the killed tail: {results}"
            results.append(ask().status_code)
            assert results[-1] == 200, results
        _wait_dropped(tracker.url, ids[killed], within=EXPIRE + 3)  # its heartbeats lapse
        assert all(ask().status_code == 200 for _ in range(4))
        by_name[other].signal(signal.SIGKILL)
        _wait_dropped(tracker.url, ids[other], within=EXPIRE + 3)
        gone = ask()
        assert gone.status_code == 503
        assert gone.json()["error"]["code"] == "no_route"
    finally:
        stop_all(processes)


def test_generated_requests_never_get_a_server_error(system: localsystem.LocalSystem) -> None:
    """Schemathesis cases from the gateway's own OpenAPI document: no 5xx, whatever they send."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(system.gateway_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/models", "/v1/chat/completions", "/v1/completions"}
    statuses: list[int] = []
    for operation in operations:
        # 30 per operation here; benchmarks.fuzz_network (also in make test) sends more
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy(), real_model=st.booleans())
        def run(case: Any, real_model: bool) -> None:
            if real_model and isinstance(case.body, dict):
                # half the cases name the served model, so they reach tokenizing, routing and generating
                case.body["model"] = system.model_id
                for key in ("max_tokens", "max_completion_tokens"):
                    if isinstance(case.body.get(key), int):
                        case.body[key] = 1 + case.body[key] % 16
                if all(case.body.get(k) is None for k in ("max_tokens", "max_completion_tokens")):
                    # an open-ended reply would run to the end of the context: the same checks, far slower
                    case.body["max_tokens"] = 16
            response = case.call(base_url=system.gateway_url, timeout=120)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text[:500])

        run()
    assert len(statuses) >= 30
    seen = collections.Counter(statuses)
    assert seen[200] > 0 and seen[400] > 0 and seen[404] > 0, seen  # every kind of path was reached
    _wait_nodes_idle(system)


def test_a_full_route_waits_briefly_then_answers_429(smollm2: Path, tmp_path: Path) -> None:
    processes: list[ManagedProcess] = []
    try:
        tracker = ManagedProcess("tracker", local_tracker_args(tmp_path / "t"))
        processes.append(tracker)
        tracker_url = expect(tracker.start(), TrackerReady).url
        node = ManagedProcess(
            "node",
            [
                "up",
                "--model",
                str(smollm2),
                "--listen",
                "127.0.0.1:0",
                "--tracker",
                tracker_url,
                "--data-dir",
                str(tmp_path / "n"),
                "--slots",
                "1",
                "--ctx",
                "1024",
            ],
        )
        processes.append(node)
        node.start()
        gateway = ManagedProcess(
            "gateway",
            local_gateway_args(
                tmp_path / "gateway", tracker_url, f"smollm2-135m={smollm2}", "--ctx", "1024", "--queue-timeout", "1"
            ),
        )
        processes.append(gateway)
        url = expect(gateway.start(), GatewayReady).url
        # counting goes on for the whole max_tokens: the slot stays taken
        busy = {"model": "smollm2-135m", "prompt": "1, 2, 3, 4,", "max_tokens": 900, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=busy, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # held: a dropped iterator closes the connection
            next(lines)
            refused = httpx.post(
                url + "/v1/chat/completions",
                timeout=60,
                json={"model": "smollm2-135m", "messages": MESSAGES, "max_tokens": 4},
            )
            assert refused.status_code == 429
            assert refused.json()["error"]["code"] == "routes_full"
        time.sleep(3)  # the slot drains and a heartbeat reports it free
        assert (
            httpx.post(
                url + "/v1/chat/completions",
                timeout=60,
                json={"model": "smollm2-135m", "messages": MESSAGES, "max_tokens": 4},
            ).status_code
            == 200
        )
    finally:
        stop_all(processes)


def test_replies_carry_a_system_fingerprint_of_the_model_and_recipe(
    client: OpenAI, system: localsystem.LocalSystem
) -> None:
    whole = client.chat.completions.create(model=system.model_id, messages=MESSAGES, **GREEDY)
    streamed = client.chat.completions.create(model=system.model_id, messages=MESSAGES, stream=True, **GREEDY)
    fingerprints = {chunk.system_fingerprint for chunk in streamed}
    # one model file, one recipe on every route of this system: one fingerprint everywhere
    assert fingerprints == {whole.system_fingerprint}
    assert whole.system_fingerprint is not None and whole.system_fingerprint.startswith("fp_")


def test_n_choices_are_n_sessions_with_their_own_seeds(client: OpenAI, system: localsystem.LocalSystem) -> None:
    ask: dict[str, Any] = {
        "model": system.model_id,
        "messages": MESSAGES,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 11,
        "n": 3,
    }
    whole = client.chat.completions.create(**ask)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1  # seeds 11, 12, 13
    assert whole.usage is not None and whole.usage.completion_tokens <= 3 * 12
    # the first choice is what the same request with n = 1 gives; the second, with seed 12
    single = client.chat.completions.create(**{**ask, "n": 1, "seed": 12})
    assert single.choices[0].message.content == texts[1]
    streamed = ["", "", ""]
    finishes: dict[int, str] = {}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert streamed == texts and sorted(finishes) == [0, 1, 2]
    text = client.completions.create(model=system.model_id, prompt="Once", max_tokens=5, temperature=0, n=2)
    assert [c.index for c in text.choices] == [0, 1] and text.choices[0].text == text.choices[1].text


def test_a_grounded_reply_goes_in_windows_and_is_the_whole_models(
    system: localsystem.LocalSystem, smollm2: Path
) -> None:
    """Speculation is on by default: a reply that repeats its prompt comes in windows, over the
    system's sealed seams and its relay, and is the whole model's greedy reply all the same."""
    from noderuntime.seams.client import GenerationRequest

    from .test_node_core import solo_greedy
    from .test_speculative import _grounded

    prompt = _grounded(smollm2)
    body = {"model": system.model_id, "prompt": list(prompt), "max_tokens": 40, "temperature": 0}
    reply = httpx.post(system.gateway_url + "/v1/completions", json=body, timeout=120).json()
    details = reply["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0, reply["usage"]
    vocab = Vocab(smollm2)
    expected = solo_greedy(smollm2, GenerationRequest(prompt, 40))
    ends = [i for i, token in enumerate(expected) if token in vocab.eog_tokens]
    text = b"".join(vocab.piece(t) for t in expected[: ends[0] if ends else None]).decode()
    assert reply["choices"][0]["text"] == text
    assert reply["usage"]["completion_tokens"] == (ends[0] + 1 if ends else 40)


def _choices(reply: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What a reply says, choice by choice: its text, why it ended, its logprobs."""
    return [
        (c["index"], c.get("text", (c.get("message") or {}).get("content")), c["finish_reason"], c.get("logprobs"))
        for c in reply["choices"]
    ]


def test_speculation_changes_no_byte_of_schema_several_seeded_and_logprob_replies(
    system: localsystem.LocalSystem, smollm2: Path, tmp_path: Path
) -> None:
    """The same requests through the system's gateway, which drafts, and a second one on the same
    nodes that does not (``--speculate 0``): json_schema, n = 3 seeded, logprobs, byte for byte."""
    from .test_speculative import PASSAGE

    plain = ManagedProcess(
        "gateway-plain",
        local_gateway_args(
            tmp_path, system.tracker_url, f"{system.model_id}={smollm2}", "--ctx", "1024", "--speculate", "0"
        ),
    )
    plain_url = expect(plain.start(), GatewayReady).url
    record = {"river": PASSAGE.split(";")[0], "ferry": {"arrives": 7, "leaves": 8}, "children": "wait"}
    schema = {
        "type": "object",
        "properties": {
            "river": {"type": "string"},
            "ferry": {
                "type": "object",
                "properties": {"arrives": {"type": "integer"}, "leaves": {"type": "integer"}},
                "required": ["arrives", "leaves"],
            },
            "children": {"type": "string"},
        },
        "required": ["river", "ferry", "children"],
    }
    copy = [{"role": "user", "content": f"Copy this JSON object exactly:\n{json.dumps(record)}"}]
    repeat = [{"role": "user", "content": f"Repeat this text exactly, twice:\n{PASSAGE}"}]
    bodies = [
        {
            "messages": copy,
            "max_tokens": 80,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}},
        },
        {"messages": repeat, "max_tokens": 48, "temperature": 0.8, "seed": 11, "n": 3},
        {"messages": repeat, "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 3},
    ]
    try:
        replies = []
        for body in bodies:
            body = {"model": system.model_id, **body}
            drafted = httpx.post(system.gateway_url + "/v1/chat/completions", json=body, timeout=120).json()
            alone = httpx.post(plain_url + "/v1/chat/completions", json=body, timeout=120).json()
            assert _choices(drafted) == _choices(alone), body
            assert drafted["usage"]["completion_tokens"] == alone["usage"]["completion_tokens"]
            assert alone["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
            # windows went, and were kept, in each (json: 37 of 51 tokens, n = 3: 33 of 87, logprobs: 24 of 36)
            assert drafted["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0, body
            replies.append(drafted)
        jsonschema.validate(json.loads(replies[0]["choices"][0]["message"]["content"]), schema)
        assert len({c["message"]["content"] for c in replies[1]["choices"]}) > 1  # three draws, not one thrice
    finally:
        plain.stop()
