"""``make demo``: the whole system on this machine, used through the official OpenAI client.

Starts the local system (tracker, relay, two shard nodes of the demo model, gateway),
streams one chat completion with the ``openai`` package, prints the text as it comes,
the speed, which node served which layers, one structured-output reply (JSON that a
schema constrains as it is decoded), the nodes' measured capability and probe
results, and the signed usage in the ledger, then stops everything.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from openai import OpenAI

from noderuntime.control import ledger
from noderuntime.models import catalogue as models
from noderuntime.services import localsystem
from noderuntime.tracker import status


def run(prompt: str, max_tokens: int, model_name: str = models.DEMO_MODEL) -> int:
    """Run the demo; the exit status."""
    print("starting tracker, relay, two shard nodes and the gateway...", flush=True)
    system = localsystem.start(model_name=model_name, listen="127.0.0.1:0")
    print(
        f"\nopen in a browser while the demo runs (`noderuntime up` keeps them until Ctrl-C):\n"
        f"{localsystem.pages(system)}"
    )
    try:
        client = OpenAI(base_url=system.gateway_url + "/v1", api_key="not-needed")
        print(f"\nuser: {prompt}\nassistant: ", end="", flush=True)
        started = time.perf_counter()
        first = None
        pieces = 0
        route: list[dict[str, Any]] = []
        stream = client.chat.completions.create(
            model=system.model_id,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        completion_tokens = 0
        for chunk in stream:
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
            extra = chunk.model_extra or {}
            if extra.get("route"):
                route = extra["route"]
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    if first is None:
                        first = time.perf_counter()
                    pieces += 1
                    sys.stdout.write(choice.delta.content)
                    sys.stdout.flush()
        ended = time.perf_counter()
        print("\n")
        if first is not None and completion_tokens > 1:
            rate = (completion_tokens - 1) / max(1e-9, ended - first)
            print(
                f"{completion_tokens} tokens; first token after {(first - started) * 1e3:.0f} ms; "
                f"{rate:.1f} tokens/s after that"
            )
        for hop in route:
            print(
                f"  layers {hop['layers'][0]:>2}:{hop['layers'][1]:<2} served by node {hop['node_id']} ({hop['via']})"
            )
        structured(client, system.model_id)
        print("\nthe nodes, as the tracker sees them (measured at start, probed before routing):")
        status.show(system.tracker_url)
        print(f"\nusage ledger ({system.ledger}):")
        ledger.show(str(system.ledger))
    finally:
        print("\nstopping the local system", flush=True)
        system.stop()
    return 0


CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 32},
        "country": {"type": "string", "maxLength": 32},
        "population_millions": {"type": "number"},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["city", "country", "landmarks"],
    "additionalProperties": False,
}


def structured(client: OpenAI, model: str) -> None:
    """One reply constrained by a JSON schema (the tail's grammar sampler), parsed."""
    question = "Describe Paris as JSON."
    print(f"\nstructured output (response_format json_schema)\nuser: {question}\nassistant: ", end="", flush=True)
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}},
    )
    text = reply.choices[0].message.content or ""
    print(text)
    parsed = json.loads(text)  # decoding followed the schema, so the reply parses
    print(f"  parsed: keys {sorted(parsed)}, finish_reason {reply.choices[0].finish_reason}")
