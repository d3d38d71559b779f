"""Rendering the chat template stored in a GGUF file.

Templates are Jinja2 programs written by model authors; they run in a sandbox
with only the variables chat templates expect.
"""

from __future__ import annotations

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
