"""OpenAI-compatible request bodies (the subset this gateway serves), as pydantic models.

They generate the gateway's OpenAPI document. One rule for fields: a field this gateway
implements works; a field of OpenAI's API or of a peer's extensions (llama.cpp's, vLLM's)
that it does not implement is refused with a 400 naming it when set to anything but its
default; a field nobody here knows is ignored and logged once.
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from protocol import MAX_TOP_LOGPROBS

log = logging.getLogger(__name__)

MAX_STOP = 16
MAX_CHOICES = 8  # each choice is a route session: a bound on what one request may hold
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for text completions
# options this gateway does not implement: absent, null, false, empty, or these defaults
_UNSUPPORTED = {
    "functions": (),
    "function_call": ("none", "auto"),
    "guided_regex": (),  # vLLM's: llama.cpp's grammar sampler has no regular expressions
    "guided_whitespace_pattern": (),
    "best_of": (1,),
    "suffix": ("",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    # OpenAI's, not implemented: refused when they would change the reply
    "reasoning_effort": (),  # a template's switch is chat_template_kwargs (enable_thinking), not an effort
    "web_search_options": (),
    # peers' sampling and template extensions this gateway does not implement
    "min_tokens": (0,),
    "ignore_eos": (),
    "repetition_penalty": (1.0,),
    "typical_p": (1.0,),
    "mirostat": (0,),
    "n_probs": (0,),
    "continue_final_message": (),
    "include_stop_str_in_output": (),
}
# fields that change nothing in a reply: OpenAI's bookkeeping, llama.cpp's cache hint
_HARMLESS = frozenset({"store", "metadata", "service_tier"})
_logged_unknown: set[str] = set()  # names of unknown fields already logged, at most _MAX_LOGGED
_MAX_LOGGED = 256


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=1 << 20)


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class CalledFunction(BaseModel):
    """The function a past call named, and its arguments as JSON text."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(default="{}", max_length=1 << 20)

    @model_validator(mode="after")
    def _arguments_are_json(self) -> CalledFunction:
        try:
            value = json.loads(self.arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            message = "a tool call's arguments must be the JSON text of an object"
            raise PydanticCustomError("tool_calls", message, {"param": "messages"})
        return self


class MessageToolCall(BaseModel):
    """A call an assistant message made (OpenAI's ``tool_calls`` entry)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None)
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[MessageToolCall] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=256)
    reasoning_content: str | None = Field(default=None, max_length=1 << 20)

    @model_validator(mode="after")
    def _refuse_calls(self) -> ChatMessage:
        # the legacy single call is not served, and a past call dropped from the prompt
        # would change what the model reads without a word to the client
        extra = self.model_extra or {}
        if extra.get("function_call") not in (None, [], {}):
            raise PydanticCustomError(
                "unsupported",
                "{param} in messages is not supported by this gateway: use tool_calls",
                {"param": "function_call"},
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls", "only assistant messages make tool calls", {"param": "messages"})
        return self

    def text(self) -> str:
        """The content as plain text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: role, content and, when given, name, calls, reasoning.

        A call's arguments go as an object, so that templates write them with ``tojson``,
        which escapes ``<`` and ``>``: a client's text never spells a special token there.
        """
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


# what chat templates are given by this gateway itself
_TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"})
MAX_GRAMMAR_CHARS = 128 << 10  # GBNF or a schema's JSON: a schema's grammar runs to tens of KiB


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's structured output."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(default="response", min_length=1, max_length=64)
    description: str | None = Field(default=None, max_length=1 << 12)
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: plain text, any JSON object, or JSON that validates against a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            message = "json_schema goes with type json_schema, and only there"
            raise PydanticCustomError("response_format", message, {"param": "response_format"})
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of json, grammar, choice (regex is refused)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    json_object: bool | None = None
    regex: str | None = Field(default=None, description="refused: llama.cpp's grammar sampler has no regexes")

    @model_validator(mode="after")
    def _refuse_regex(self) -> StructuredOutputs:
        if self.regex is not None:
            message = "{param} is not supported by this gateway: llama.cpp's grammar sampler has no regexes"
            raise PydanticCustomError("unsupported", message, {"param": "structured_outputs.regex"})
        return self


@attrs.frozen
class Constraint:
    """What decoding must follow: a JSON schema (``None``: any JSON object), GBNF, one of some
    strings, or calls to tools ((function definitions, their syntax, whether several))."""

    kind: Literal["json", "gbnf", "choice", "tools"]
    value: Any
    param: str  # the request field it came from, for errors


class StreamOptions(BaseModel):
    """``stream_options``."""

    include_usage: bool = False


class SamplingFields(BaseModel):
    """Parameters shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES, description="choices: one route session each")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str | StrictInt] | None = Field(default=None)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    top_k: int | None = Field(default=None, ge=0, le=1 << 20, description="extension: keep the k most likely tokens")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="extension: drop tokens below p x the top")
    repeat_penalty: float | None = Field(default=None, gt=0.0, le=10.0, description="extension")
    user: str | None = Field(default=None, max_length=256)
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=1024, description="token id (as a string) -> bias added to its logit"
    )
    grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS, description="llama.cpp's: GBNF")
    json_schema: dict[str, Any] | None = Field(default=None, description="llama.cpp's: a JSON schema")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="vLLM's: a JSON schema")
    guided_grammar: str | None = Field(default=None, max_length=MAX_GRAMMAR_CHARS, description="vLLM's: GBNF")
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=1024, description="vLLM's")
    structured_outputs: StructuredOutputs | None = None
    cache_prompt: bool | None = Field(
        default=None,
        description="llama.cpp's: false keeps the route from taking the prompt's start from its nodes' prefix caches",
    )

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        extra = self.model_extra or {}
        for key, defaults in _UNSUPPORTED.items():
            value = extra.get(key)
            if value not in (None, False, {}, [], *defaults):
                raise PydanticCustomError("unsupported", "{param} is not supported by this gateway", {"param": key})
        for key in extra.keys() - _UNSUPPORTED.keys() - _HARMLESS:
            # a vendor field nobody here knows: ignored, and said once per name (a bounded set)
            if key not in _logged_unknown and len(_logged_unknown) < _MAX_LOGGED:
                _logged_unknown.add(key)
                log.warning("ignoring the unknown request field %r (said once per field)", key[:64])
        stop = self.stop
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise PydanticCustomError("stop", f"at most {MAX_STOP} stop sequences", {"param": "stop"})
        if isinstance(stop, list) and any(isinstance(s, str) and not s for s in stop):
            raise PydanticCustomError("stop", "stop strings must not be empty", {"param": "stop"})
        self.constraint()  # one constraint at most, and schemas given as text must parse
        self.logit_biases()
        return self

    def logprob_request(self) -> tuple[bool, int, bool]:
        """(logprobs of the sampled tokens, how many alternatives each, logprobs of the prompt)."""
        return False, 0, False

    def logit_biases(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs, in token order; a 400 for a key that is no token id."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or len(key) > 9:
                message = "logit_bias keys are token ids (decimal strings), not {key!r}"
                raise PydanticCustomError("logit_bias", message, {"param": "logit_bias", "key": key[:40]})
            pairs.append((int(key), float(bias)))
        return tuple(sorted(pairs))

    def constraint(self) -> Constraint | None:
        """The one decoding constraint the request asks for, in whichever spelling; a 400 for two."""
        found: list[Constraint] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(Constraint("json", None, "response_format"))
        if fmt is not None and fmt.json_schema is not None:
            found.append(Constraint("json", fmt.json_schema.schema_, "response_format"))
        if self.grammar is not None:
            found.append(Constraint("gbnf", self.grammar, "grammar"))
        if self.json_schema is not None:
            found.append(Constraint("json", self.json_schema, "json_schema"))
        if self.guided_json is not None:
            found.append(Constraint("json", _schema_value(self.guided_json, "guided_json"), "guided_json"))
        if self.guided_grammar is not None:
            found.append(Constraint("gbnf", self.guided_grammar, "guided_grammar"))
        if self.guided_choice is not None:
            found.append(Constraint("choice", self.guided_choice, "guided_choice"))
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                found.append(Constraint("json", _schema_value(so.json_, "structured_outputs"), "structured_outputs"))
            if so.json_object:
                found.append(Constraint("json", None, "structured_outputs"))
            if so.grammar is not None:
                found.append(Constraint("gbnf", so.grammar, "structured_outputs"))
            if so.choice is not None:
                found.append(Constraint("choice", so.choice, "structured_outputs"))
        if len(found) > 1:
            names = ", ".join(sorted({c.param for c in found}))
            raise PydanticCustomError(
                "constraint",
                "give one decoding constraint, not several ({names})",
                {"param": found[1].param, "names": names},
            )
        return found[0] if found else None

    def stop_lists(self) -> tuple[list[str], list[int]]:
        """(stop strings, stop token ids); ``stop`` may mix both (token ids are an extension)."""
        if self.stop is None:
            return [], []
        items: list[Any] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        strings = [s for s in items if isinstance(s, str) and s]
        ids = [i for i in items if isinstance(i, int) and not isinstance(i, bool)]
        return strings, ids


def _schema_value(value: dict[str, Any] | str, param: str) -> Any:
    """A schema given as an object or as its JSON text (vLLM takes both)."""
    if isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except ValueError:
        message = "{param} is neither a JSON schema nor its JSON text"
        raise PydanticCustomError("schema", message, {"param": param}) from None


class FunctionDefinition(BaseModel):
    """A function a tool offers: its name, what it does, its parameters' JSON schema."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(default=None, max_length=1 << 14)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """One of ``tools``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(BaseModel):
    """The function a named ``tool_choice`` names."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the reply is a call to it."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: ChosenFunction


# what a template may be given beside the conversation: switches, not text a client
# could spell special tokens with
TemplateValue = bool | int | float | None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(default=None, description="more than one call in a reply (default)")
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(
        default=None, max_length=32, description="extension: variables for the chat template (enable_thinking)"
    )
    logprobs: bool | None = Field(default=False, description="each reply token's log-probability")
    top_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_TOP_LOGPROBS, description="and this many most likely tokens at its place"
    )

    @model_validator(mode="after")
    def _top_with_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            message = "top_logprobs needs logprobs: true"
            raise PydanticCustomError("logprobs", message, {"param": "top_logprobs"})
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise PydanticCustomError("tools", "two tools have the same name", {"param": "tools"})
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise PydanticCustomError(
                "tool_choice", "tool_choice asks for a call, and no tools are given", {"param": "tool_choice"}
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            message = "tool_choice names {name!r}, which is not one of the tools"
            raise PydanticCustomError("tool_choice", message, {"param": "tool_choice", "name": choice.function.name})
        if choice not in (None, "none", "auto") and self.constraint() is not None:
            message = "a forced tool call is its own constraint: not with response_format or a grammar"
            raise PydanticCustomError("tool_choice", message, {"param": "tool_choice"})
        for key in self.chat_template_kwargs or {}:
            if not key.isidentifier() or key in _TEMPLATE_OWN:
                message = "chat_template_kwargs may not set {key!r}"
                raise PydanticCustomError(
                    "chat_template_kwargs", message, {"param": "chat_template_kwargs", "key": key[:40]}
                )
        return self

    def offered_tools(self) -> list[dict[str, Any]]:
        """The functions a reply may call: none when ``tool_choice`` is ``none``."""
        if self.tool_choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools or ()]

    def forced_tools(self) -> list[dict[str, Any]] | None:
        """The functions the reply must call one of (``required`` or named), else None."""
        offered = self.offered_tools()
        if self.tool_choice == "required":
            return offered
        if isinstance(self.tool_choice, NamedToolChoice):
            return [f for f in offered if f["name"] == self.tool_choice.function.name]
        return None

    def logprob_request(self) -> tuple[bool, int, bool]:
        """(logprobs of the sampled tokens, how many alternatives each, logprobs of the prompt)."""
        return bool(self.logprobs), self.top_logprobs or 0, False


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    # fail_fast: a long list that is wrong stops at its first bad item, not one error per item
    prompt: (
        str
        | Annotated[list[str], Field(fail_fast=True)]
        | Annotated[list[StrictInt], Field(fail_fast=True)]
        | Annotated[list[Annotated[list[StrictInt], Field(fail_fast=True)]], Field(fail_fast=True)]
    ) = Field(max_length=1 << 22, description="text, or token ids; one prompt per request")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="log-probabilities, with this many alternatives"
    )
    echo: bool | None = Field(default=False, description="the prompt leads the text (and its logprobs, if asked)")

    def logprob_request(self) -> tuple[bool, int, bool]:
        """(logprobs of the sampled tokens, how many alternatives each, logprobs of the prompt)."""
        wanted = self.logprobs is not None
        return wanted, self.logprobs or 0, wanted and bool(self.echo)

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return self  # a list of token ids is one prompt
        if isinstance(prompt, list) and len(prompt) != 1:
            raise PydanticCustomError("prompt", "exactly one prompt per request", {"param": "prompt"})
        return self

    def prompt_tokens(self) -> list[int] | None:
        """The prompt's token ids when it was given as ids, else None."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            return list(prompt[0])
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return [t for t in prompt if isinstance(t, int)]
        return None

    def prompt_text(self) -> str:
        """The prompt given as text."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        return prompt[0] if prompt and isinstance(prompt[0], str) else ""


class TokenizeRequest(BaseModel):
    """``POST /tokenize``, as llama-server names it (``model`` may be left out when one is served)."""

    model_config = ConfigDict(extra="forbid")
    content: str = Field(max_length=1 << 22)
    add_special: bool = False
    with_pieces: bool = False
    model: str | None = Field(default=None, max_length=256)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``, as llama-server names it."""

    model_config = ConfigDict(extra="forbid")
    tokens: Annotated[list[StrictInt], Field(fail_fast=True, max_length=1 << 20)]
    model: str | None = Field(default=None, max_length=256)
