"""Tool calls and reasoning in a chat reply: how a template writes them, and reading them back (pure).

A chat template that renders ``tools`` itself says how its model writes a call: Qwen's
and Hermes' templates ask for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks, Llama 3.x's for a bare ``{"name": ..., "parameters": ...}`` object. A template
that does not know tools (SmolLM2's, Gemma's) gets them the Hermes way, in a system
message: the instructions models of that kind were tuned on.

:class:`ChatOutput` splits the text a reply streams into content, reasoning (a
``<think>`` block at the start, as Qwen3 writes it) and tool calls, holding back text
that may be the start of a marker, as :class:`~noderuntime.gateway.textstream.TextStream`
holds back stop strings.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

import attrs

from noderuntime.gateway.textstream import overlap

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
MAX_CALLS = 4  # calls a forced reply may make: a small model would otherwise call until its tokens run out

Syntax = Literal["hermes", "llama3"]


@attrs.frozen
class TemplateTraits:
    """What a chat template does with tools and thinking."""

    native_tools: bool  # it renders ``tools`` itself
    syntax: Syntax  # how its model writes a call
    thinks: bool  # it knows ``<think>`` blocks (Qwen3): replies may open with one


def template_traits(source: str) -> TemplateTraits:
    """Read from the template's source: whether it renders tools, how calls look, whether it thinks."""
    native = re.search(r"\btools\b", source) is not None
    syntax: Syntax = "llama3" if native and CALL_OPEN not in source else "hermes"
    return TemplateTraits(native, syntax, THINK_CLOSE in source)


def hermes_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that offers ``tools`` to a model whose template does not render them."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You are a function calling AI model. You may call one or more functions to assist with the user "
        "query. The function signatures are within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with the function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def hermes_history(messages: Sequence[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that knows no tools: calls and results written as text.

    The tools' system text leads the first system message (or is one); an assistant's
    calls follow its text as ``<tool_call>`` blocks; a tool's result becomes a user turn in
    ``<tool_response>`` tags (templates that know only user and assistant turns accept it).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        message.pop("tool_call_id", None)
        if calls:
            blocks = [
                CALL_OPEN
                + "\n"
                + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "\n"
                + CALL_CLOSE
                for c in calls
            ]
            message["content"] = "\n".join(filter(None, [message.get("content") or "", *blocks]))
        if message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        out.append(message)
    if tools:
        offer = hermes_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": offer + "\n\n" + (out[0].get("content") or "")}
        else:
            out.insert(0, {"role": "system", "content": offer})
    return out


def call_schema(tools: Sequence[Mapping[str, Any]], syntax: Syntax) -> dict[str, Any]:
    """The JSON schema of one call to one of ``tools`` (function definitions), as ``syntax`` writes it."""
    key = "parameters" if syntax == "llama3" else "arguments"
    options = []
    for tool in tools:
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool["name"]}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(call_gbnf: str, syntax: Syntax, *, several: bool) -> str:
    """The GBNF of a reply that is only calls, from the GBNF of one call's JSON (root rule ``root``)."""
    # the converter names one rule "root" and no other rule refers to it: rename it, wrap it
    body = re.sub(r"^root ::=", "tool-call-json ::=", call_gbnf, count=1, flags=re.MULTILINE)
    one = "tool-call-json" if syntax == "llama3" else '"<tool_call>\\n" tool-call-json "\\n</tool_call>"'
    root = f"root ::= {one}" + (f' ("\\n" {one}){{0,{MAX_CALLS - 1}}}' if several else "")
    return root + "\n" + body


@attrs.frozen
class ToolCall:
    """A call the model wrote: OpenAI's ``tool_calls`` entry."""

    id: str
    name: str
    arguments: str  # JSON text

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        """``{"id", "type", "function": {"name", "arguments"}}`` (with ``index`` when streamed)."""
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _parse_call(text: str, names: Collection[str]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall("call_" + uuid.uuid4().hex[:24], value["name"], json.dumps(arguments, ensure_ascii=False))


@attrs.define
class Delta:
    """What one push released: OpenAI's delta fields."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = attrs.Factory(list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class ChatOutput:
    """Splits a reply's text into content, reasoning and tool calls; see the module docstring.

    ``tool_names``: the functions the request offers (empty: no calls are read).
    ``reasoning``: a ``<think>`` block may open the reply; ``thinking``: the prompt already
    opened it, so the reply starts inside one. The newlines around a think block are
    the template's, not the model's text: dropped, as Qwen3's template drops them.
    """

    def __init__(
        self,
        *,
        tool_names: Collection[str] = (),
        syntax: Syntax = "hermes",
        reasoning: bool = False,
        thinking: bool = False,
    ) -> None:
        self.names = frozenset(tool_names)
        self.syntax = syntax
        self._mode = "reasoning" if thinking else ("start" if reasoning else "content")
        self._strip = thinking  # drop the newlines that follow a think marker
        self._held = ""
        self.content = ""
        self.reasoning = ""
        self.calls: list[ToolCall] = []
        self._bare = False  # llama3: the reply is a JSON call, read whole at the end
        self._after_call = False  # nothing but whitespace since the last call

    def push(self, text: str) -> Delta:
        """Add released text; returns what may be shown now."""
        self._held += text
        return self._release(final=False)

    def finish(self) -> Delta:
        """The reply ended: release everything (an unfinished call stays text)."""
        delta = self._release(final=True)
        if self._bare:
            text, self._held = self._held, ""
            call = _parse_call(text.strip().removeprefix(_PYTHON_TAG), self.names)
            if call is not None:
                self.calls.append(call)
                delta.calls.append(call)
            else:
                self._emit(delta, text)
        elif self._held:
            if not (self._after_call and not self._held.strip()):  # whitespace after calls is no content
                self._emit(delta, self._held)  # an unfinished call or marker: text after all
            self._held = ""
        return delta

    def _emit(self, delta: Delta, text: str) -> None:
        if self._strip:
            text = text.lstrip("\n")
            self._strip = not text
        if self._mode == "reasoning":
            self.reasoning += text
            delta.reasoning += text
        else:
            self.content += text
            delta.content += text
            self._after_call = self._after_call and not text.strip()

    def _release_upto(self, delta: Delta, marker: str, *, final: bool, trailing: str = "") -> None:
        """Release held text but what may be the start of ``marker`` (and ``trailing`` characters before it)."""
        keep = 0 if final else overlap(self._held, marker)
        if trailing and not final:
            rest = self._held[: len(self._held) - keep]
            keep += len(rest) - len(rest.rstrip(trailing))
        self._emit(delta, self._held[: len(self._held) - keep])
        self._held = self._held[len(self._held) - keep :]

    def _release(self, *, final: bool) -> Delta:
        delta = Delta()
        while self._held and not self._bare:
            if self._mode == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._held = stripped[len(THINK_OPEN) :]
                    self._mode, self._strip = "reasoning", True
                    continue
                if not final and THINK_OPEN.startswith(stripped):
                    break  # may still become "<think>"
                self._mode = "content"
                continue
            if self._mode == "reasoning":
                at = self._held.find(THINK_CLOSE)
                if at < 0:
                    self._release_upto(delta, THINK_CLOSE, final=final, trailing="\n")
                    break
                self._emit(delta, self._held[:at].rstrip("\n"))
                self._held = self._held[at + len(THINK_CLOSE) :]
                self._mode, self._strip = "content", True
                continue
            if self.names and self.syntax == "llama3" and not self.content.strip():
                lead = self._held.lstrip()
                if lead.startswith(("{", _PYTHON_TAG)):
                    self._bare = True  # a call, or JSON content: told at the end
                    break
                if not final and (not lead or _PYTHON_TAG.startswith(lead)):
                    break
            if not (self.names and self.syntax == "hermes"):
                self._emit(delta, self._held)
                self._held = ""
                break
            at = self._held.find(CALL_OPEN)
            if at < 0:
                # whitespace waits too: between calls it is no content
                self._release_upto(delta, CALL_OPEN, final=final, trailing=" \t\r\n")
                break
            if self._held[:at].strip() or not self._after_call:  # whitespace between calls is no content
                self._emit(delta, self._held[:at])
            self._held = self._held[at:]
            end = self._held.find(CALL_CLOSE)
            if end < 0:
                break  # the call is still being written
            call = _parse_call(self._held[len(CALL_OPEN) : end].strip(), self.names)
            if call is None:
                self._emit(delta, self._held[: end + len(CALL_CLOSE)])  # not a call: text
            else:
                self.calls.append(call)
                delta.calls.append(call)
                self._after_call = True
            self._held = self._held[end + len(CALL_CLOSE) :]
        return delta
