"""A route client run as its own process (inside a test host's network namespace).

    python -m tests.route_client SPEC.json

SPEC holds the hops, ticket, fingerprints and request, and ``client_key``: the PEM key
file of the client the ticket names (the head serves only it); optionally ``kill_pid`` and
``kill_after`` (tokens): the client SIGKILLs that process after that many tokens and
reports how long the route took to report the failure. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import trio

from noderuntime.access.identity import load_or_create_key
from noderuntime.seams.client import GenerationRequest, RouteError, open_route_generation
from noderuntime.seams.dialer import open_dialer
from noderuntime.tracker.messages import decode_hops


async def main(spec: dict) -> dict:  # type: ignore[type-arg]
    hops = decode_hops(spec["hops"])
    request = GenerationRequest(tuple(spec["prompt"]), spec["max_tokens"])
    killed_at = None
    tokens: list[int] = []
    try:
        async with (
            open_dialer(identity=load_or_create_key(spec["client_key"])) as dialer,
            open_route_generation(
                dialer,
                hops,
                request,
                artifact=bytes.fromhex(spec["artifact"]),
                recipe=bytes.fromhex(spec["recipe"]),
                ticket=bytes.fromhex(spec["ticket"]),
                session_id=bytes.fromhex(spec["session_id"]),
            ) as gen,
        ):
            while (event := await gen.next()) is not None:
                tokens.extend(event.token_ids)
                if spec.get("kill_pid") and killed_at is None and len(tokens) >= spec["kill_after"]:
                    os.kill(spec["kill_pid"], signal.SIGKILL)
                    killed_at = time.monotonic()
    except RouteError as exc:
        return {
            "error": str(exc),
            "code": int(exc.code),
            "tokens": tokens,
            "seconds_after_kill": time.monotonic() - killed_at if killed_at else None,
        }
    return {"tokens": tokens, "reason": gen.finish_reason}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = trio.run(main, json.load(f))
    print(json.dumps(result), flush=True)
