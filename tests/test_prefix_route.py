"""Prefix reuse along a route: the hops agree on the shortest prefix they all hold, and the reply is unchanged.

Two real 2-shard clusters of SmolLM2 (heads A0 and B0, tails A1 and B1) trust one ticket
issuer, so a test can route a session through any head and any tail: a turn leaves its
prompt and reply in the prefix caches of the nodes that served it, and the next turn,
through other pairs of them, finds what each holds. Every reply is checked against the
same prompt run with prefix reuse off.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from noderuntime.access.identity import Identity
from noderuntime.node.prefix import BLOCK
from noderuntime.seams.client import GenerationRequest
from noderuntime.seams.dialer import open_dialer
from noderuntime.services import localsystem
from noderuntime.testing.clusters import Cluster, running_cluster
from protocol import Hop, Sampling

pytestmark = pytest.mark.slow

WORDS = [int(t) for t in range(500, 40_000, 97)]  # plain token ids, none of them special


@attrs.frozen
class Pair:
    a: Cluster
    b: Cluster

    def hops(self, head: str, tail: str) -> tuple[Hop, ...]:
        return ({"A": self.a, "B": self.b}[head].hops[0], {"A": self.a, "B": self.b}[tail].hops[1])

    def status(self, name: str) -> dict[str, Any]:
        cluster, index = {"A": self.a, "B": self.b}[name[0]], int(name[1])
        with urllib.request.urlopen(cluster.infos[index].http + "/status", timeout=5) as response:
            data: dict[str, Any] = json.loads(response.read())
            return data


@pytest.fixture(scope="module")
def pair(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    issuer = Identity.generate()
    root = tmp_path_factory.mktemp("prefix-route")
    with (
        running_cluster(smollm2, [0, 15, 30], root / "a", issuer=issuer, threads=1) as a,
        # B's nodes keep one turn's KV at most: the next one evicts it
        running_cluster(
            smollm2, [0, 15, 30], root / "b", issuer=issuer, threads=1, extra=["--prefix-cache", "1300KiB"]
        ) as b,
    ):
        yield Pair(a, b)


async def _run(pair: Pair, head: str, tail: str, prompt: list[int], *, reuse: bool = True) -> tuple[list[int], int]:
    """(the reply's tokens, the prompt positions the route took from its caches)."""
    request = GenerationRequest(tuple(prompt), 8, Sampling(temperature=0.8, seed=11), reuse_prefix=reuse)
    hops = pair.hops(head, tail)
    async with open_dialer() as dialer, pair.a.open(dialer, request, hops=hops) as gen:
        tokens: list[int] = []
        while (event := await gen.next()) is not None:
            tokens += event.token_ids
    return tokens, gen.cached_tokens


def _held(*turn: list[int]) -> int:
    """The prefix a node that served ``turn`` (a prompt, then its reply) holds: its KV.

    The reply's last token was sampled but never fed back, so the KV ends one before it.
    """
    return sum(len(part) for part in turn) - 1


async def test_the_hops_agree_on_the_shortest_prefix_they_all_hold(pair: Pair) -> None:
    x, y, z = WORDS[:40], WORDS[40:80], WORDS[80:120]
    first, cached = await _run(pair, "A", "B", x)
    assert cached == 0  # nothing held yet
    # A0 holds x and its reply; A1 nothing: the route reuses nothing, and says so
    second, cached = await _run(pair, "A", "A", [*x, *first, *y])
    assert cached == 0
    assert second == (await _run(pair, "B", "A", [*x, *first, *y], reuse=False))[0]
    # A0 holds all of the second turn; B1 only the first turn: the shorter
    prompt = [*x, *first, *y, *second, *z]
    third, cached = await _run(pair, "A", "B", prompt)
    assert cached == _held(x, first) > 0
    assert third == (await _run(pair, "B", "A", prompt, reuse=False))[0]
    # A0 (that turn) and A1 (its reference run) both hold all of this prompt: all of it is
    # reused but its last token, whose logits must be computed
    fourth, cached = await _run(pair, "A", "A", prompt)
    assert cached == len(prompt) - 1 > _held(x, first)
    assert fourth == third
    for node in ("A0", "A1", "B0", "B1"):
        status = pair.status(node)
        assert status["kv_cells"] == 0 and status["samplers_live"] == 0 and status["active_sessions"] == 0
    assert pair.status("A0")["prefix_cache"]["hits"] >= 2


async def test_a_hop_that_evicted_its_part_gets_no_short_input(pair: Pair) -> None:
    """B1's budget holds one turn: the next evicts it, and a route through B1 prefills all again."""
    old = WORDS[200:260]
    await _run(pair, "A", "B", old)  # A0 and B1 hold it now
    await _run(pair, "B", "B", WORDS[300:360])  # B1 keeps this one instead
    assert pair.status("B1")["prefix_cache"]["evictions"] >= 1
    hits = pair.status("A0")["prefix_cache"]["hits"]
    reply, cached = await _run(pair, "A", "B", [*old, *WORDS[400:420]])
    assert cached == 0  # A0 still holds the old turn, B1 no longer: nothing is reused
    assert pair.status("A0")["prefix_cache"]["hits"] == hits + 1
    assert reply == (await _run(pair, "A", "A", [*old, *WORDS[400:420]], reuse=False))[0]


def test_a_conversation_stays_on_the_route_that_holds_it(tmp_path: Path) -> None:
    """Two replicas of each shard: four routes. The gateway asks for the route that served a
    conversation's start, and every next turn prefills only what is new, as usage reports."""
    system = localsystem.start(listen="127.0.0.1:0", data_root=tmp_path, replicas=2, slots=4, ctx=1024, quiet=True)
    try:
        for c in range(4):
            messages = [
                {"role": "system", "content": f"Conversation {c}. You answer in one short sentence about the sea."},
                {"role": "user", "content": "What colour is the sea on a cloudy day?"},
            ]
            first = _chat(system, messages)
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            messages += [first["choices"][0]["message"], {"role": "user", "content": "And at night?"}]
            second = _chat(system, messages)
            # the first turn's prompt is the start of the second's: all its whole blocks are reused
            held = first["usage"]["prompt_tokens"] // BLOCK * BLOCK
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= held > 0, (c, second["usage"])
            assert second["route"] == first["route"]
    finally:
        system.stop()


def _chat(system: localsystem.LocalSystem, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": system.model_id, "messages": messages, "max_tokens": 12, "temperature": 0}
    response = httpx.post(system.gateway_url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    reply: dict[str, Any] = response.json()
    return reply
