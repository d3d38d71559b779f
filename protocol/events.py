"""Typed events of the seam protocol: what the codec turns frames into, and back.

Small frozen attrs classes; protobuf objects never leave this package.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from typing import TypeAlias

import attrs
import numpy as np

from protocol.errors import StatusCode

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 7
# the most likely tokens a TokenLogprob may list beside the chosen one (OpenAI's bound)
MAX_TOP_LOGPROBS = 20


class Phase(enum.IntEnum):
    """Where a frame is in its session's life."""

    UNSPECIFIED = 0
    PREFILL = 1
    DECODE = 2
    RELEASE = 3
    CANCEL = 4


class Encoding(enum.IntEnum):
    """How tensor elements travel; they are float32 once decoded."""

    F32 = 1
    F16 = 2
    BF16 = 3
    Q8 = 4


@attrs.frozen
class Span:
    """A half-open range ``[start, end)`` of layers or token positions."""

    start: int = 0
    end: int = 0

    def __len__(self) -> int:
        return max(0, self.end - self.start)


@attrs.frozen
class Identity:
    """What names a session on one seam; the same on every frame of the session."""

    request_id: str
    session_id: bytes
    epoch: int
    artifact_fingerprint: bytes
    recipe_fingerprint: bytes
    shard: Span

    def at(self, shard: Span) -> Identity:
        """The same session as the hop at ``shard`` names it (each end of a seam names its own range)."""
        return attrs.evolve(self, shard=shard)


@attrs.frozen
class Header:
    """Identity plus what changes from frame to frame."""

    identity: Identity
    phase: Phase
    step_id: int
    positions: Span = Span()
    cache_expectation: int = 0
    schema_major: int = SCHEMA_MAJOR
    schema_minor: int = SCHEMA_MINOR


@attrs.frozen
class Hop:
    """One shard of a route plan."""

    node_id: bytes
    layers: Span
    address: str = ""
    relay: str = ""
    tls_cert_sha256: bytes = b""
    # on a route that mixes recipes, the one this hop runs; empty: the Identity's
    recipe_fingerprint: bytes = b""


_MIXED_ROUTE_DOMAIN = b"noderuntime-mixed-route-v1\0"


def route_recipe(recipes: Sequence[bytes]) -> bytes:
    """The recipe fingerprint a session's :class:`Identity` names on a route whose hops run ``recipes``.

    One recipe on every hop: that recipe, as on any route. Several (a route across devices
    that a certificate covers): 8 bytes digested from all of them in hop order, so every
    seam of the session names the same route recipe, and a hop told another plan notices.
    """
    if not recipes:
        raise ValueError("a route has at least one hop")
    if len(set(recipes)) == 1:
        return recipes[0]
    digest = hashlib.sha256(_MIXED_ROUTE_DOMAIN)
    for recipe in recipes:
        digest.update(len(recipe).to_bytes(2, "big") + recipe)
    return digest.digest()[:8]


@attrs.frozen
class Sampling:
    """Sampling parameters of a session (temperature 0: greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    grammar: str = ""  # GBNF, root rule "root"; empty: unconstrained (needs schema 1.1 on every hop)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias added to its logit); needs 1.1 too
    logprobs: bool = False  # each sampled token's log-probability comes back with it; needs 1.2
    top_logprobs: int = 0  # and this many most likely tokens at its position (<= MAX_TOP_LOGPROBS)
    prompt_logprobs: bool = False  # and those of the prompt's tokens, in the first Tokens frame


@attrs.frozen
class OpenRoute:
    """Opens a route session on every hop; the head starts prefill on receipt."""

    header: Header
    hops: tuple[Hop, ...]
    sampling: Sampling
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    deadline_unix_ms: int = 0
    ticket: bytes = b""
    # a resumed session (since 1.3): prompt_tokens[:prompt_length] is the prompt, the rest
    # was generated already; 0 for a new session, whose prompt_tokens are all prompt
    prompt_length: int = 0
    # prompt positions the hops so far can take from their prefix caches (since 1.4; 0: none)
    prefix_offer: int = 0
    # an audit (since 1.5): a teacher-forced recomputation of a served session, whose hops
    # commit to the rows from audit_from on (see seam.proto)
    audit: bool = False
    audit_from: int = 0
    # the most drafted tokens a decode window may carry (since 1.6; 0: no speculation)
    speculate: int = 0

    @property
    def prompt(self) -> tuple[int, ...]:
        """The prompt itself."""
        return self.prompt_tokens[: self.prompt_length] if self.prompt_length else self.prompt_tokens

    @property
    def generated(self) -> tuple[int, ...]:
        """Tokens a resumed session generated before (none for a new session)."""
        return self.prompt_tokens[self.prompt_length :] if self.prompt_length else ()


@attrs.frozen(eq=False)
class NamedTensor:
    """A float32 tensor with a name (``hidden_states`` for the residual stream)."""

    name: str
    array: np.ndarray
    encoding: Encoding = Encoding.F32


@attrs.frozen(eq=False)
class Activations:
    """Tensors flowing downstream for the positions in the header."""

    header: Header
    tensors: tuple[NamedTensor, ...]
    # a decode window's drafted tokens, the input tokens of its rows 1.. (since 1.6)
    draft: tuple[int, ...] = ()
    # the window follows the one before it while that one is in flight: its first row's
    # input is a guess at that window's last draw, listed first in ``draft`` (since 1.7)
    follows: bool = False

    def tensor(self, name: str) -> np.ndarray:
        """The array of the tensor called ``name``; ``KeyError`` if absent."""
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor.array
        raise KeyError(name)


@attrs.frozen
class TokenLogprob:
    """A token's log-probability under the model, and the most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


@attrs.frozen
class Tokens:
    """Tokens sampled by the tail, flowing upstream."""

    header: Header
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the session asked (1.2)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.., in the first frame (1.2)
    # speculation (1.6): the most drafted tokens a window may carry as far as the hops below
    # take windows; for a window, how many tokens it drafted and how many the tail kept
    window: int = 0
    drafted: int = 0
    accepted: int = 0
    # windows that may follow one in flight, as far as the hops below take them (1.7)
    ahead: int = 0


@attrs.frozen
class Release:
    """The session ended normally: free its KV."""

    header: Header
    reason: str = ""


@attrs.frozen
class Cancel:
    """The session was abandoned: free its KV, stop work."""

    header: Header
    reason: str = ""


@attrs.frozen
class Error:
    """A hop failed the session."""

    header: Header
    code: StatusCode
    message: str
    node_id: bytes = b""


@attrs.frozen
class Credit:
    """A heartbeat upstream (since 1.3): the sender is alive, though it has nothing to say.

    ``frames`` was meant for flow control and is honoured by nobody (backpressure comes
    from the transports); hops send 0.
    """

    header: Header
    frames: int


@attrs.frozen
class UsageRecord:
    """One shard's signed usage of one session."""

    body: bytes
    node_id: bytes
    signature: bytes


@attrs.frozen
class Usage:
    """Signed usage records travelling back up the route."""

    header: Header
    records: tuple[UsageRecord, ...]


@attrs.frozen
class Prefix:
    """Upstream, first (since 1.4): the prompt positions every hop restored from its prefix cache."""

    header: Header
    positions: int


Event: TypeAlias = OpenRoute | Activations | Tokens | Release | Cancel | Error | Credit | Usage | Prefix
