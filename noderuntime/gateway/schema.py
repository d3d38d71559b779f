"""OpenAI-compatible request bodies (the subset this gateway serves), as pydantic models.

They generate the gateway's OpenAPI document. Fields OpenAI has and this gateway does
not implement are refused with a 400 when set to anything but their default, rather
than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from pydantic_core import PydanticCustomError

MAX_STOP = 16
# options this gateway does not implement: absent, null, false, empty, or these defaults
_UNSUPPORTED = {
    "logprobs": (),
    "top_logprobs": (),
    "logit_bias": (),
    "tools": (),
    "tool_choice": ("none", "auto"),  # with no tools, both mean plain text
    "functions": (),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "echo": (),
    "best_of": (1,),
    "suffix": ("",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
}


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=1 << 20)


class ChatMessage(BaseModel):
    """One message of a conversation."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None)
    name: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _refuse_calls(self) -> ChatMessage:
        # tools are not served, and a past call dropped from the prompt would change what
        # the model reads without a word to the client
        extra = self.model_extra or {}
        for key in ("tool_calls", "function_call"):
            if extra.get(key) not in (None, [], {}):
                raise PydanticCustomError(
                    "unsupported", "{param} in messages is not supported by this gateway", {"param": key}
                )
        return self

    def text(self) -> str:
        """The content as plain text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: role, content and, when given, name."""
        message = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        return message


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
    n: int | None = Field(default=None, ge=1, le=1)
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

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        extra = self.model_extra or {}
        for key, defaults in _UNSUPPORTED.items():
            value = extra.get(key)
            if value not in (None, False, {}, [], *defaults):
                raise PydanticCustomError("unsupported", "{param} is not supported by this gateway", {"param": key})
        stop = self.stop
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise PydanticCustomError("stop", f"at most {MAX_STOP} stop sequences", {"param": "stop"})
        if isinstance(stop, list) and any(isinstance(s, str) and not s for s in stop):
            raise PydanticCustomError("stop", "stop strings must not be empty", {"param": "stop"})
        return self

    def stop_lists(self) -> tuple[list[str], list[int]]:
        """(stop strings, stop token ids); ``stop`` may mix both (token ids are an extension)."""
        if self.stop is None:
            return [], []
        items: list[Any] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        strings = [s for s in items if isinstance(s, str) and s]
        ids = [i for i in items if isinstance(i, int) and not isinstance(i, bool)]
        return strings, ids


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    # fail_fast: a long list that is wrong stops at its first bad item, not one error per item
    prompt: (
        str
        | Annotated[list[str], Field(fail_fast=True)]
        | Annotated[list[StrictInt], Field(fail_fast=True)]
        | Annotated[list[Annotated[list[StrictInt], Field(fail_fast=True)]], Field(fail_fast=True)]
    ) = Field(max_length=1 << 22, description="text, or token ids; one prompt per request")

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
