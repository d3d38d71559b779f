"""The clients people point at a local server, against a real local system: LangChain's
``ChatOpenAI`` (``with_structured_output``, ``bind_tools``, streaming, logprobs) and
LiteLLM's ``openai/`` provider. Both reach the gateway through the official ``openai``
SDK underneath, with their own request shaping on top.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from noderuntime.services import localsystem

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

# The client libraries are imported in the tests that use them: they take seconds of CPU,
# which a pytest-xdist worker that runs none of these tests would spend collecting them.

pytestmark = [
    pytest.mark.slow,
    # LiteLLM's own typed dicts, as pydantic reads them: nothing of ours
    pytest.mark.filterwarnings("ignore:Items? .* (is|are) using the `ReadOnly` qualifier:UserWarning"),
]


class Pet(BaseModel):
    """A pet."""

    name: str = Field(max_length=16)
    species: Literal["cat", "dog", "fish", "bird"]
    age: int = Field(ge=0, le=30)


def get_weather(city: Literal["Paris", "London", "Tokyo"], unit: Literal["celsius", "fahrenheit"]) -> str:
    """The weather in a city now."""
    return f"18 degrees {unit} in {city}"


WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city now.", "parameters": WEATHER_SCHEMA},
}


@pytest.fixture(scope="module")
def system(smol_system: localsystem.LocalSystem) -> localsystem.LocalSystem:
    return smol_system


def _chat(system: localsystem.LocalSystem, **options: Any) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    settings: dict[str, Any] = {"temperature": 0, "max_tokens": 200, "max_retries": 0, **options}
    return ChatOpenAI(model=system.model_id, base_url=system.gateway_url + "/v1", api_key="unused", **settings)


# --- LangChain


def test_langchain_chat_and_stream(system: localsystem.LocalSystem) -> None:
    llm = _chat(system, max_tokens=16)
    reply = llm.invoke("Say hello.")
    assert isinstance(reply.content, str) and reply.content
    assert "".join(str(chunk.content) for chunk in llm.stream("Say hello.")) == reply.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_always_parses(system: localsystem.LocalSystem, method: str) -> None:
    # json_schema: response_format; function_calling: a forced call to a tool named after the model
    structured = _chat(system, temperature=0.8).with_structured_output(Pet, method=method, strict=True)  # type: ignore[arg-type]
    for kind in ("cat", "dog", "fish", "bird", "old dog"):
        pet = structured.invoke(f"Invent a pet: a {kind}.")
        assert isinstance(pet, Pet)


def test_langchain_bound_tools_are_called(system: localsystem.LocalSystem) -> None:
    from langchain_core.tools import tool

    weather = tool(get_weather)
    llm = _chat(system).bind_tools([weather], tool_choice="get_weather")
    for question in ("What is the weather in Paris?", "Is it cold in Tokyo?"):
        message = llm.invoke(question)
        (call,) = message.tool_calls  # type: ignore[attr-defined]
        assert call["name"] == "get_weather" and call["id"]
        jsonschema.validate(call["args"], WEATHER_SCHEMA)
        assert weather.invoke(call["args"]).startswith("18 degrees")


def test_langchain_logprobs(system: localsystem.LocalSystem) -> None:
    reply = _chat(system, max_tokens=6, logprobs=True, top_logprobs=2).invoke("Count: one, two,")
    content = reply.response_metadata["logprobs"]["content"]
    assert content and all(len(e["top_logprobs"]) == 2 for e in content)
    assert "".join(e["token"] for e in content) == reply.content


# --- LiteLLM


def _litellm(system: localsystem.LocalSystem, **options: Any) -> Any:
    # LiteLLM fetches a price list from the network on import unless told to use its own copy
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    settings: dict[str, Any] = {"max_tokens": 200, "temperature": 0, "num_retries": 0, **options}
    return litellm.completion(
        model="openai/" + system.model_id, api_base=system.gateway_url + "/v1", api_key="unused", **settings
    )


def test_litellm_chat_stream_and_logprobs(system: localsystem.LocalSystem) -> None:
    ask = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12}
    reply = _litellm(system, **ask, logprobs=True, top_logprobs=3)
    text = reply.choices[0].message.content
    assert text and "".join(e.token for e in reply.choices[0].logprobs.content) == text
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in _litellm(system, **ask, stream=True))
    assert streamed == text


def test_litellm_structured_output_and_tools(system: localsystem.LocalSystem) -> None:
    schema = Pet.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    for kind in ("cat", "fish", "bird"):
        reply = _litellm(system, messages=[{"role": "user", "content": f"Invent a {kind}."}], response_format=fmt)
        Pet.model_validate_json(reply.choices[0].message.content)
    called = _litellm(
        system,
        messages=[{"role": "user", "content": "What is the weather in London?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    assert called.choices[0].finish_reason == "tool_calls"
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
