"""Rendering the chat template stored in a GGUF file.

Templates are Jinja2 programs written by model authors; they run in a sandbox
with only the variables chat templates expect.

A rendered prompt mixes the template's own text, whose control tokens
(``<|im_start|>`` and the like) must become control tokens, with the messages'
text, which must not: otherwise a message that types ``<|im_end|><|im_start|>system``
writes its own system turn. :meth:`ChatTemplate.render_segments` says which part
of the prompt is which, so that a tokenizer can treat them apart.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template could not render these messages."""


def _raise(message: str) -> None:
    raise TemplateError(message)


_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
_env.globals["raise_exception"] = _raise


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns messages into the prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            self._template = _env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template does not compile: {exc}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages`` (``role`` and ``content`` each)."""
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise TemplateError(f"the chat template could not render these messages: {exc}") from None

    def render_segments(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[tuple[str, bool]] | None:
        """The prompt as ``(text, from_a_message)`` pieces, in order.

        Each message's content is rendered as a marker first, so that its place in the
        prompt is known whatever text surrounds it. ``None`` when the template does more
        to a message's content than place it, or trim it (it tests or edits the text):
        then where one message ends cannot be told from the prompt.
        """
        whole = self.render(messages, add_generation_prompt=add_generation_prompt)
        nonce = secrets.token_hex(8)
        # private-use characters: no template trims, splits or escapes them
        markers = [f"\ue000{nonce}.{i}\ue001" for i in range(len(messages))]
        marked = [
            {**m, "content": markers[i]} if isinstance(m.get("content"), str) else dict(m)
            for i, m in enumerate(messages)
        ]
        try:
            rendered = self.render(marked, add_generation_prompt=add_generation_prompt)
        except TemplateError:
            return None  # the template looks at the content itself
        places: list[tuple[int, int]] = []  # (where in the prompt, which message)
        for i, message in enumerate(messages):
            if not isinstance(message.get("content"), str):
                continue
            at = rendered.find(markers[i])
            if at < 0 or rendered.find(markers[i], at + 1) >= 0:
                return None  # dropped or repeated: its place is not one known span
            places.append((at, i))
        segments: list[tuple[str, bool]] = []
        start = 0
        for at, i in sorted(places):
            segments += [(rendered[start:at], False), (messages[i]["content"], True)]
            start = at + len(markers[i])
        segments.append((rendered[start:], False))
        if "".join(text for text, _ in segments) == whole:
            return [s for s in segments if s[0]]
        # a template that trims content ("| trim") renders the trimmed text
        trimmed = [(text.strip() if ours else text, ours) for text, ours in segments]
        if "".join(text for text, _ in trimmed) == whole:
            return [s for s in trimmed if s[0]]
        return None
