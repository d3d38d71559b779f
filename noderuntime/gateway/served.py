"""A model the gateway serves (its tokenizer, chat template and artifact), and the grammar
a request's constraint compiles to."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import attrs

from noderuntime.engine.llama import GrammarError, Vocab, check_grammar, json_schema_grammar
from noderuntime.gateway.errors import ApiError
from noderuntime.gateway.schema import (
    Constraint,
)
from noderuntime.gateway.tools import (
    TemplateTraits,
    call_grammar,
    call_schema,
    template_traits,
)
from noderuntime.models.chat import ChatTemplate, TemplateError, prompt_tokens
from noderuntime.runner.runner import Target


def system_fingerprint(artifact: str, recipe: bytes) -> str:
    """OpenAI's ``system_fingerprint``: the same model file run the same way gives the same one."""
    return "fp_" + hashlib.sha256(f"{artifact}:{recipe.hex()}".encode()).hexdigest()[:16]


def _gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return '"' + escaped.replace("\t", "\\t") + '"'


def constraint_grammar(vocab: Vocab, constraint: Constraint | None) -> str:
    """The GBNF a session's tail follows for ``constraint``, compiled here first: a 400, not a failed route."""
    if constraint is None:
        return ""
    try:
        if constraint.kind == "json":
            text = json_schema_grammar(constraint.value)
        elif constraint.kind == "tools":
            tools, syntax, several = constraint.value
            text = call_grammar(json_schema_grammar(call_schema(tools, syntax)), syntax, several=several)
        elif constraint.kind == "choice":
            text = "root ::= " + " | ".join(_gbnf_literal(option) for option in constraint.value)
        else:
            text = str(constraint.value)
        check_grammar(vocab, text)
    except GrammarError as exc:
        raise ApiError(400, f"{constraint.param}: {exc}", param=constraint.param) from None
    return text


@attrs.define(slots=False)  # slots off: a cached property needs the instance's dict
class ServedModel:
    """A model this gateway serves: its tokenizer and template, and its artifact."""

    model_id: str
    artifact: str
    vocab: Vocab
    template: ChatTemplate | None
    created: int
    n_ctx: int

    def stop_tokens(self) -> tuple[int, ...]:
        """Tokens that always end a generation (end of text, end of turn)."""
        return tuple(sorted(self.vocab.eog_tokens))

    def card(self) -> dict[str, Any]:
        """The model as ``/v1/models`` lists it."""
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "noderuntime"}

    @functools.cached_property
    def target(self) -> Target:
        """What its routes run, and what the runner checks of what they send."""
        return Target(self.artifact, self.n_ctx, self.vocab.n_vocab)

    @functools.cached_property
    def traits(self) -> TemplateTraits:
        """What the chat template does with tools and thinking."""
        return template_traits(self.template.source if self.template is not None else "")

    def chat_prompt(self, messages: Sequence[dict[str, Any]], **context: Any) -> list[int]:
        """The prompt tokens of a conversation; text a message types stays text (see ``chat``).

        ``context``: ``tools`` and ``variables`` for the template.
        """
        assert self.template is not None
        try:
            return prompt_tokens(self.template, self.vocab, messages, **context)
        except TemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except UnicodeEncodeError:
            raise ApiError(400, "message text is not valid Unicode (a lone surrogate?)", param="messages") from None

    def text_prompt(self, text: str) -> list[int]:
        """The tokens of a text completion's prompt; special-token text stays text."""
        try:
            return self.vocab.tokenize(text, add_special=self.vocab.add_bos, parse_special=False)
        except UnicodeEncodeError:
            raise ApiError(400, "the prompt is not valid Unicode (a lone surrogate?)", param="prompt") from None
