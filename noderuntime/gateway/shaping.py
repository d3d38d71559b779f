"""Replies in OpenAI's format: whole or as chunks, their logprobs, tool calls and reasoning (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from noderuntime.control.ledger import CheckedRecord
from noderuntime.gateway.logprobs import CompletionLogprobs, chat_entries
from noderuntime.gateway.served import ServedModel
from noderuntime.gateway.tools import (
    ChatOutput,
)
from noderuntime.runner.policy import bad_route
from noderuntime.seams.client import GenerationRequest
from protocol import TokenLogprob, Tokens


@attrs.define
class Generated:
    """What a finished (or stopped) generation produced."""

    text: str
    completion_tokens: int
    finish_reason: str
    route: list[dict[str, Any]]
    records: list[CheckedRecord] = attrs.Factory(list)
    logprobs: list[TokenLogprob] = attrs.Factory(list)  # of the reply's tokens, when asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # of the prompt's tokens but the first, when asked
    # each time the route failed mid-generation and the session went on on another: where,
    # why, the new route, the stall, and whether the continuation stayed bit-exact
    repairs: list[dict[str, Any]] = attrs.Factory(list)
    cached_tokens: int = 0  # prompt positions the route took from its nodes' prefix caches
    # speculative decoding: tokens the route's head drafted, and of them those the tail kept
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@attrs.frozen
class Emitted:
    """What a generation yields: text that may be shown, its tokens' logprobs, and once finished, all."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    done: Generated | None = None
    fingerprint: str = ""  # OpenAI's system_fingerprint of the serving route
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # on the first item, when asked


@attrs.define
class ReplyShape:
    """How one request's choices look in OpenAI's format, whole or as chunks."""

    ident: str
    created: int
    model: ServedModel
    chat: bool
    prompt: tuple[int, ...]
    top: int
    logprobs: bool
    echo: str | None
    output: ChatOutput  # chat: splits content, reasoning and tool calls
    index: int = 0  # of the choice
    _completion: CompletionLogprobs | None = None

    def __attrs_post_init__(self) -> None:
        if not self.chat and self.logprobs:
            self._completion = CompletionLogprobs(self.model.vocab.piece, self.top)

    def envelope(self, kind: str, fingerprint: str) -> dict[str, Any]:
        """The fields every reply and chunk has."""
        return {
            "id": self.ident,
            "object": kind,
            "created": self.created,
            "model": self.model.model_id,
            "system_fingerprint": fingerprint,
        }

    def _chat_logprobs(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": chat_entries(self.model.vocab.piece, entries, self.top), "refusal": None}

    def _completion_logprobs(
        self, entries: Sequence[TokenLogprob], prompt_logprobs: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any] | None:
        track = self._completion
        if track is None:
            return None
        if prompt_logprobs:
            track.add(self.prompt[0], None)  # the first prompt token has no context
            for e in prompt_logprobs:
                track.add(e.token, e)
        for e in entries:
            track.add(e.token, e)
        return track.take()

    def whole_choice(self, result: Generated) -> dict[str, Any]:
        """The one choice of a whole reply."""
        choice: dict[str, Any] = {"index": self.index, "finish_reason": result.finish_reason}
        if self.chat:
            self.output.push(result.text)
            self.output.finish()
            choice["message"] = self._message()
            choice["finish_reason"] = self.finish_reason(result.finish_reason)
            choice["logprobs"] = self._chat_logprobs(result.logprobs)
        else:
            choice["text"] = (self.echo or "") + result.text
            choice["logprobs"] = self._completion_logprobs(result.logprobs, result.prompt_logprobs)
        return choice

    def _message(self) -> dict[str, Any]:
        out = self.output
        message: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.reasoning:
            message["reasoning_content"] = out.reasoning
        if out.calls:
            message["tool_calls"] = [c.as_dict() for c in out.calls]
            if not out.content.strip():
                message["content"] = None  # a reply that is only calls, as OpenAI sends it
        return message

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` for a reply that ended after calling, else the route's reason."""
        return "tool_calls" if self.output.calls and reason == "stop" else reason

    def chunk_choice(
        self,
        *,
        text: str = "",
        logprobs: Sequence[TokenLogprob] = (),
        prompt_logprobs: Sequence[TokenLogprob] = (),
        role: bool = False,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """The one choice of a streamed chunk."""
        choice: dict[str, Any] = {"index": self.index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            told = self.output.finish() if finish is not None else self.output.push(text)
            if finish is not None:
                choice["finish_reason"] = self.finish_reason(finish)
            if told.content:
                delta["content"] = told.content
            if told.reasoning:
                delta["reasoning_content"] = told.reasoning
            if told.calls:
                first = len(self.output.calls) - len(told.calls)
                delta["tool_calls"] = [c.as_dict(first + i) for i, c in enumerate(told.calls)]
            choice["delta"] = delta
            if logprobs:
                choice["logprobs"] = self._chat_logprobs(logprobs)
        else:
            choice["text"] = text
            if logprobs or prompt_logprobs:
                choice["logprobs"] = self._completion_logprobs(logprobs, prompt_logprobs)
        return choice


def check_logprobs(model: ServedModel, request: GenerationRequest, event: Tokens, *, prompt: bool) -> None:
    """The route's logprobs must be those asked for, of the tokens sent, inside the vocabulary."""
    sampling = request.sampling
    if sampling.logprobs and len(event.logprobs) != len(event.token_ids):
        raise bad_route("it sent tokens without the logprobs asked for")
    entries = list(zip(event.token_ids, event.logprobs, strict=False))
    if prompt and sampling.prompt_logprobs:
        if len(event.prompt_logprobs) != len(request.prompt_tokens) - 1:
            raise bad_route("it sent no logprobs for the prompt, or not one for each token")
        entries += zip(request.prompt_tokens[1:], event.prompt_logprobs, strict=True)
    for token, entry in entries:
        if entry.token != token or len(entry.top) > sampling.top_logprobs:
            raise bad_route("its logprobs are not those of the tokens sent")
        if any(not 0 <= t < model.vocab.n_vocab for t, _ in entry.top):
            raise bad_route("its logprobs name tokens outside the vocabulary")


def usage_counts(prompt: int, completion: int, cached: int = 0, drafted: int = 0, accepted: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached``: prompt tokens whose KV the route reused (as OpenAI reports them).

    ``drafted`` and ``accepted``: speculative decoding's drafts, and those kept, in OpenAI's
    fields for predicted tokens (``completion_tokens_details``); the completion's count is its
    tokens alone, as without speculation.
    """
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {
            "accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": drafted - accepted,
        },
    }
