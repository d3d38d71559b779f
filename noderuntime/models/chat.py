"""Chat prompts: the chat template stored in a GGUF file, rendered and tokenized.

Templates are Jinja2 programs written by model authors; they run in a sandbox
with only the variables chat templates expect.

A rendered prompt mixes the template's own text, whose special tokens
(``<|im_start|>`` and the like) must become those tokens, with the messages'
text, which must not: otherwise a message that types ``<|im_end|><|im_start|>system``
writes its own system turn. :func:`prompt_tokens` renders each message's text as a
marker first, to learn where it lies in the prompt, then splits the prompt only at
the special tokens of the template's own text, exactly where llama.cpp splits a
prompt, and tokenizes the text between them as plain text. An honest conversation
gets the tokens the whole prompt would get; one that types a special token gets it
as text.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The template could not render these messages."""


class MessageTextError(TemplateError):
    """A message's text would become one of the template's special tokens."""


def _raise(message: str) -> None:
    raise TemplateError(message)


# loop controls ({% break %}) are part of the environment templates are written for
_env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_env.globals["raise_exception"] = _raise

# what a template reads from a message and a client writes freely
MESSAGE_TEXT_FIELDS = ("content", "name", "reasoning_content")
_WHITESPACE = " \t\n\v\f\r"  # what llama.cpp strips beside a token marked lstrip/rstrip


class Tokenizer(Protocol):
    """What :func:`prompt_tokens` needs of a vocabulary (``engine.Vocab`` has it)."""

    @property
    def add_bos(self) -> bool:
        """Whether prompts start with ``bos``."""
        ...

    @property
    def bos(self) -> int:
        """The beginning-of-text token (-1: none)."""
        ...

    @property
    def special_tokens(self) -> Mapping[int, tuple[str, bool, bool]]:
        """Tokens matched as whole strings: id -> (text, strips space before, strips space after)."""
        ...

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to token ids."""
        ...


class ChatTemplate:
    """A compiled chat template; :meth:`render` turns messages into the prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            self._template = _env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the model's chat template does not compile: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for ``messages`` (``role`` and ``content`` each).

        ``tools``: OpenAI's ``tools`` entries, for templates that render them; ``variables``:
        more the template reads (``enable_thinking``), never overriding the names above.
        """
        try:
            return self._template.render(
                **(variables or {}),
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise TemplateError(f"the chat template could not render these messages: {exc}") from None

    def render_marked(self, messages: Sequence[Mapping[str, Any]], **context: Any) -> tuple[str, dict[str, str]] | None:
        """The prompt with each message's text fields rendered as markers, and each marker's text.

        ``None`` when the template cannot render the markers (it tests the text itself).
        """
        nonce = secrets.token_hex(8)
        texts: dict[str, str] = {}
        marked = []
        for i, message in enumerate(messages):
            copy = dict(message)
            for field in MESSAGE_TEXT_FIELDS:
                if isinstance(copy.get(field), str):
                    # private-use characters: no template trims, splits or escapes them
                    marker = f"\ue000{nonce}.{i}.{field}\ue001"
                    texts[marker] = copy[field]
                    copy[field] = marker
            marked.append(copy)
        try:
            return self.render(marked, **context), texts
        except TemplateError:
            return None

    def render_segments(self, messages: Sequence[Mapping[str, Any]], **context: Any) -> list[tuple[str, bool]] | None:
        """The prompt as ``(text, from_a_message)`` pieces, in order.

        ``None`` when the template does more to a message's text than place it, or trim
        it (it tests, edits or repeats the text): then where a message's text lies cannot
        be told from the prompt.
        """
        whole = self.render(messages, **context)
        rendered = self.render_marked(messages, **context)
        if rendered is None:
            return None
        text, texts = rendered
        places: list[tuple[int, str]] = []
        for marker in texts:
            at = text.find(marker)
            if at >= 0 and text.find(marker, at + 1) >= 0:
                return None  # repeated: one message's text would be two spans
            if at >= 0:
                places.append((at, marker))
        segments: list[tuple[str, bool]] = []
        start = 0
        for at, marker in sorted(places):
            segments += [(text[start:at], False), (texts[marker], True)]
            start = at + len(marker)
        segments.append((text[start:], False))
        if "".join(t for t, _ in segments) == whole:
            return [s for s in segments if s[0]]
        # a template that trims text ("| trim") renders the trimmed text
        trimmed = [(t.strip() if ours else t, ours) for t, ours in segments]
        if "".join(t for t, _ in trimmed) == whole:
            return [s for s in trimmed if s[0]]
        return None


def prompt_tokens(
    template: ChatTemplate, vocab: Tokenizer, messages: Sequence[Mapping[str, Any]], **context: Any
) -> list[int]:
    """The tokens of a conversation's prompt; special tokens come from the template only.

    ``context``: ``tools`` and ``variables``, as :meth:`ChatTemplate.render` takes them.

    Raises :class:`MessageTextError` for a message whose text cannot be kept as text:
    it types a special token that the template writes itself and that the vocabulary
    matches even in plain text (llama.cpp's user-defined tokens), or the template edits
    message text so that where it lies is unknown, and the prompt holds special tokens
    the template alone would not write.
    """
    segments = template.render_segments(messages, **context)
    try:
        tokens = None if segments is None else _split_tokenize(vocab, segments)
    except _Unplaced:
        tokens = None
    if tokens is None:
        tokens = _unsegmented(template, vocab, messages, context)
    if vocab.add_bos and vocab.bos >= 0 and tokens[:1] != [vocab.bos]:
        tokens = [vocab.bos, *tokens]  # a template that writes bos_token itself gets no second one
    return tokens


class _Unplaced(Exception):
    """A special token the tokenizer found in the template's text is not where its text is."""


def _split_tokenize(vocab: Tokenizer, segments: Sequence[tuple[str, bool]]) -> list[int]:
    tokens: list[int] = []
    run: list[str] = []  # plain text since the last special token: the template's and the messages'
    strip_start = False
    own: set[int] = set()
    found: dict[str, list[str | int]] = {}
    for text, from_message in segments:
        if from_message:
            run.append(text)
            continue
        if text not in found:
            found[text] = list(_split_special(vocab, text))
        for part in found[text]:
            if isinstance(part, str):
                run.append(part)
                continue
            _, lstrip, rstrip = vocab.special_tokens[part]
            tokens += _plain(vocab, "".join(run), strip_start, lstrip)
            tokens.append(part)
            own.add(part)
            run, strip_start = [], rstrip
    tokens += _plain(vocab, "".join(run), strip_start, False)
    # plain text still yields user-defined tokens; those the template writes must come from it alone
    per_text = {text: sum(1 for p in parts if isinstance(p, int)) for text, parts in found.items()}
    written = sum(per_text[text] for text, ours in segments if not ours)
    if sum(1 for t in tokens if t in own) != written:
        raise MessageTextError("a message types one of the special tokens of this model's chat template")
    return tokens


def _split_special(vocab: Tokenizer, text: str) -> Iterator[str | int]:
    """``text`` as plain strings and the special tokens llama.cpp finds in it, in order."""
    start = 0
    for token in vocab.tokenize(text, add_special=False, parse_special=True):
        if token not in vocab.special_tokens:
            continue
        word = vocab.special_tokens[token][0]
        at = text.find(word, start)
        if at < 0:
            raise _Unplaced(word)
        if at > start:
            yield text[start:at]
        yield token
        start = at + len(word)
    if start < len(text):
        yield text[start:]


def _plain(vocab: Tokenizer, text: str, strip_start: bool, strip_end: bool) -> list[int]:
    if strip_start:
        text = text.lstrip(_WHITESPACE)
    if strip_end:
        text = text.rstrip(_WHITESPACE)
    return vocab.tokenize(text, add_special=False, parse_special=False) if text else []


def _unsegmented(
    template: ChatTemplate, vocab: Tokenizer, messages: Sequence[Mapping[str, Any]], context: Mapping[str, Any]
) -> list[int]:
    """The prompt tokenized whole, when its special tokens are those the template writes alone."""
    whole = vocab.tokenize(template.render(messages, **context), add_special=False, parse_special=True)
    marked = template.render_marked(messages, **context)
    if marked is None:
        # a template that refuses markers: only messages whose text holds no special token,
        # nor the start or the end of one (two texts side by side could make one whole)
        typed = [text for m in messages for f in MESSAGE_TEXT_FIELDS if isinstance(text := m.get(f), str)]
        if any(_specials(vocab, text) or _holds_part_of_special(vocab, text) for text in typed):
            raise MessageTextError(
                "a message holds the text of a special token, and this model's chat template tests message "
                "text, so it cannot be kept apart from the template's own special tokens"
            )
        return whole
    if _specials(vocab, whole) != _specials(vocab, marked[0]):
        raise MessageTextError(
            "this model's chat template edits message text, and with this text the prompt holds special "
            "tokens the template alone would not write"
        )
    return whole


def _holds_part_of_special(vocab: Tokenizer, text: str) -> bool:
    for word, _, _ in vocab.special_tokens.values():
        for cut in range(1, len(word)):
            if text.endswith(word[:cut]) or text.startswith(word[cut:]):
                return True
    return False


def _specials(vocab: Tokenizer, text_or_tokens: str | list[int]) -> list[int]:
    tokens = text_or_tokens
    if isinstance(tokens, str):
        tokens = vocab.tokenize(tokens, add_special=False, parse_special=True)
    return [t for t in tokens if t in vocab.special_tokens]
