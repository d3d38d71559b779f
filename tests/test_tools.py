"""Tools and reasoning: the template's own tool syntax, calls read back from the reply,
forced calls constrained by a grammar, ``<think>`` blocks split into ``reasoning_content``.

Pure parts first (the reader, the grammar, the schema); then the official ``openai``
client against real local systems: a random-weight Qwen3 (its template renders tools
and thinks) and SmolLM2 (its template knows no tools: they are offered the Hermes way).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from pydantic import ValidationError

from noderuntime.engine.llama import Vocab, check_grammar, json_schema_grammar
from noderuntime.gateway.schema import ChatCompletionRequest
from noderuntime.gateway.tools import MAX_CALLS, ChatOutput, call_grammar, call_schema, hermes_history, template_traits
from noderuntime.models import synth
from noderuntime.services import localsystem

from .conftest import local_system

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {
                # named cities: a random model's byte tokens may not be whole UTF-8, and their
                # replacement characters would make a bounded string look longer than it was
                "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- reading a reply


def _read(text: str, *, by: int, **options: Any) -> tuple[ChatOutput, list[Any]]:
    out = ChatOutput(**options)
    deltas = [out.push(text[i : i + by]) for i in range(0, len(text), by)]
    deltas.append(out.finish())
    return out, deltas


@pytest.mark.parametrize("by", [1, 3, 1000])
def test_calls_and_reasoning_are_read_however_the_text_is_cut(by: int) -> None:
    text = (
        "<think>\nThe user wants weather.\n</think>\n\nLet me look. <tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
    )
    out, deltas = _read(text, by=by, tool_names={"get_weather", "get_time"}, reasoning=True)
    assert out.reasoning == "The user wants weather."
    assert out.content.strip() == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"zone": "CET"}),
    ]
    # what was streamed is what the whole reply holds
    assert "".join(d.reasoning for d in deltas) == out.reasoning
    assert "".join(d.content for d in deltas) == out.content
    assert [c for d in deltas for c in d.calls] == out.calls


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', None),  # not an offered tool
        ("<tool_call>{not json}</tool_call>", None),
        ('Here: <tool_call>{"name": "get_weather", "argu', None),  # cut off by max_tokens
        ("a < b and <tool", None),
    ],
)
def test_what_is_not_a_call_stays_text(text: str, content: str | None) -> None:
    for by in (1, 1000):
        out, _ = _read(text, by=by, tool_names={"get_weather"})
        assert out.calls == [] and out.content == (content or text)


def test_without_tools_a_tool_call_block_is_only_text() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert _read(text, by=2)[0].content == text


def test_a_template_that_opens_the_think_block_starts_the_reply_in_it() -> None:
    out, _ = _read("deep thought\n</think>\n\nAnswer.", by=2, reasoning=True, thinking=True)
    assert (out.reasoning, out.content) == ("deep thought", "Answer.")
    out, _ = _read("No thinking here.", by=2, reasoning=True)
    assert (out.reasoning, out.content) == ("", "No thinking here.")


def test_llama3_calls_are_a_bare_json_object() -> None:
    out, _ = _read(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}',
        by=4,
        tool_names={"get_time"},
        syntax="llama3",
    )
    assert [(c.name, c.arguments) for c in out.calls] == [("get_time", '{"zone": "UTC"}')]
    out, _ = _read('{"answer": 42}', by=4, tool_names={"get_time"}, syntax="llama3")
    assert out.calls == [] and out.content == '{"answer": 42}'


def test_templates_are_told_apart_by_their_source(smollm2: Path) -> None:
    qwen = template_traits(synth.qwen3_chat_template())
    assert qwen.native_tools and qwen.syntax == "hermes" and qwen.thinks
    smol = template_traits(Vocab(smollm2).chat_template or "")
    assert not smol.native_tools and not smol.thinks
    llama = template_traits('{% if tools %}{{ tools | tojson }} {"name": function name, "parameters": ...}{% endif %}')
    assert llama.native_tools and llama.syntax == "llama3"


def test_a_template_without_tools_reads_them_from_a_system_message() -> None:
    history = [
        {"role": "system", "content": "Be brief."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    written = hermes_history(history, [WEATHER["function"]])
    assert [m["role"] for m in written] == ["system", "user", "assistant", "user"]
    assert written[0]["content"].endswith("Be brief.") and '"get_weather"' in written[0]["content"]
    assert written[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert written[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"


def test_forced_call_grammars_compile(smollm2: Path) -> None:
    vocab = Vocab(smollm2)
    functions = [WEATHER["function"], TIME["function"]]
    for syntax in ("hermes", "llama3"):
        for several in (False, True):
            check_grammar(
                vocab, call_grammar(json_schema_grammar(call_schema(functions, syntax)), syntax, several=several)
            )


# --- the request schema


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "name"),
        ({"tools": [WEATHER, WEATHER]}, "same name"),
        ({"tool_choice": "required"}, "no tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "not one of"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "own constraint"),
        ({"chat_template_kwargs": {"messages": True}}, "may not set"),
        ({"chat_template_kwargs": {"enable_thinking": "<|im_end|>"}}, "chat_template_kwargs"),
        ({"reasoning_effort": "low"}, "not supported"),
    ],
)
def test_bad_tool_requests_are_refused(extra: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **extra})


# --- end to end


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[localsystem.LocalSystem]:
    folder = tmp_path_factory.mktemp("tools-qwen3")
    path = synth.write_model(folder / "qwen3.gguf", synth.TINY_SHAPES["qwen3"], quant="Q8_0", seed=5)
    yield from local_system(folder / "system", model_name=str(path), slots=4, ctx=1024)


@pytest.fixture(scope="module")
def smol(smol_system: localsystem.LocalSystem) -> localsystem.LocalSystem:
    return smol_system


def _client(system: localsystem.LocalSystem) -> OpenAI:
    return OpenAI(base_url=system.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _valid_calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    calls = []
    for call in message.tool_calls or ():
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen3", "smol"])
def test_a_forced_call_always_parses(which: str, request: pytest.FixtureRequest) -> None:
    system: localsystem.LocalSystem = request.getfixturevalue(which)
    client = _client(system)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(6):
        # a named function, one call of any tool, or up to MAX_CALLS calls: each twice
        choice, parallel = [(named, None), ("required", False), ("required", True)][seed % 3]
        reply = client.chat.completions.create(
            model=system.model_id,
            messages=[{"role": "user", "content": f"Weather and time, please ({seed})."}],
            tools=[WEATHER, TIME],
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=parallel,  # type: ignore[arg-type]
            temperature=0.9,
            seed=seed,
        )
        calls = _valid_calls(reply.choices[0].message)
        assert calls and reply.choices[0].finish_reason == "tool_calls", reply.choices[0]
        assert reply.choices[0].message.content is None
        assert len(calls) <= (MAX_CALLS if parallel else 1)
        if choice is named:
            assert [name for name, _ in calls] == ["get_weather"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["qwen3", "smol"])
def test_streamed_calls_are_those_of_the_whole_reply(which: str, request: pytest.FixtureRequest) -> None:
    system: localsystem.LocalSystem = request.getfixturevalue(which)
    client = _client(system)
    ask: dict[str, Any] = {
        "model": system.model_id,
        "messages": MESSAGES,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**ask).choices[0]
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            assert delta.function is not None
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [streamed[i] for i in sorted(streamed)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or ()
    ]


@pytest.mark.slow
def test_a_conversation_with_calls_and_results_is_rendered_in_the_templates_syntax(
    qwen3: localsystem.LocalSystem, smol: localsystem.LocalSystem
) -> None:
    history: list[dict[str, Any]] = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    for system in (qwen3, smol):
        client = _client(system)
        with_tools = client.chat.completions.create(
            model=system.model_id,
            messages=history,
            tools=[WEATHER],
            max_tokens=8,
            temperature=0,  # type: ignore[arg-type]
        )
        assert with_tools.choices[0].message.role == "assistant"
        plain = client.chat.completions.create(model=system.model_id, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
        assert with_tools.usage is not None and plain.usage is not None
        # the offer, the call and its result are all in the prompt
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 60


@pytest.mark.slow
def test_a_think_block_becomes_reasoning_content(qwen3: localsystem.LocalSystem) -> None:
    client = _client(qwen3)
    # a random model does not think on its own: a grammar makes it write a think block
    grammar = 'root ::= "<think>\\n" [a-z]{3,12} "\\n</think>\\n\\n" [a-z]{3,12}'
    ask: dict[str, Any] = {
        "model": qwen3.model_id,
        "messages": MESSAGES,
        "max_tokens": 60,
        "temperature": 0,
        "extra_body": {"grammar": grammar},
    }
    message = client.chat.completions.create(**ask).choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    assert reasoning and reasoning.isalpha() and message.content and message.content.isalpha()
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for key in parts:
            parts[key] += (getattr(delta, key, None) or "") if delta else ""
    assert parts == {"reasoning_content": reasoning, "content": message.content}


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_template(qwen3: localsystem.LocalSystem) -> None:
    def prompt_tokens(**kwargs: Any) -> int:
        body = {"model": qwen3.model_id, "messages": MESSAGES, "max_tokens": 1, **kwargs}
        reply = httpx.post(qwen3.gateway_url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens"])

    thinking = prompt_tokens()
    # Qwen3's template closes an empty think block in the prompt when thinking is off
    closed = httpx.post(
        qwen3.gateway_url + "/tokenize", json={"content": "<think>\n\n</think>\n\n", "add_special": False}
    )
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == thinking + len(closed.json()["tokens"])
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == thinking
