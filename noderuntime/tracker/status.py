"""``noderuntime status --tracker URL``: the nodes a tracker knows, their load, and the routes they form."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping
from typing import Any

from noderuntime.control.admission import Capability
from noderuntime.tracker.records import NodeRecord
from noderuntime.tracker.routechoice import all_routes, route_cost, unmixed


def fetch(tracker: str, status_key: str | None = None) -> tuple[list[dict[str, Any]], dict[str, set[frozenset[str]]]]:
    """The tracker's ``/v1/nodes``: the nodes, and by artifact the recipe pairs routes may mix.

    ``status_key``: the tracker's, when it has one.
    """
    request = urllib.request.Request(tracker.rstrip("/") + "/v1/nodes")
    if status_key is not None:
        request.add_header("Authorization", f"Bearer {status_key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        try:
            answer = json.loads(response.read())
            nodes: list[dict[str, Any]] = answer["nodes"]
            mixes: dict[str, set[frozenset[str]]] = {}
            for mix in answer.get("mixes", ()):  # absent from older trackers: none
                mixes.setdefault(str(mix["artifact"]), set()).add(frozenset(str(r) for r in mix["recipes"]))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise ValueError(f"{tracker} did not answer /v1/nodes with a node list") from None
    if not isinstance(nodes, list) or not all(isinstance(n, dict) for n in nodes):
        raise ValueError(f"{tracker} did not answer /v1/nodes with a node list")
    return nodes, mixes


def _record(node: dict[str, Any]) -> NodeRecord:
    return NodeRecord(
        node_id=bytes.fromhex(node["node_id"]),
        artifact=node["artifact"],
        n_layer=node["n_layer"],
        layers=(int(node["layers"][0]), int(node["layers"][1])),
        recipe=node["recipe"],
        address=node["address"],
        relay=node["relay"],
        tls_cert_sha256=b"",
        slots=node["slots"],
        ctx_per_session=node["ctx_per_session"],
        model_name=node["model_name"],
        device=str(node.get("device", "cpu")),
        kernel_class=str(node.get("kernel_class", "")),
        active_sessions=node["active_sessions"],
        free_slots=node["free_slots"],
        queue_depth=node["queue_depth"],
        step_ms=node["step_ms"],
        measured=Capability.from_json(node["capability"]) if node.get("capability") else None,
        probe_required=bool(node.get("probe_required")),
        probe_passed=node.get("probe_passed"),
        audit_failed=str(node.get("audit_failed") or ""),
    )


def _decode(node: dict[str, Any]) -> str:
    capability = node.get("capability")
    if not capability:
        return "-"
    return "/".join(f"{float(t):.1f}" for _, t in sorted(capability["decode_ms"].items(), key=lambda i: int(i[0])))


def _prefill(node: dict[str, Any]) -> str:
    capability = node.get("capability")
    if not capability:
        return "-"
    return f"{1e3 / float(capability['prefill_ms_per_token']):.0f}"


def _probe(node: dict[str, Any]) -> str:
    if node.get("audit_failed"):
        return "AUDIT"
    passed = node.get("probe_passed")
    if passed is True:
        return "ok"
    if passed is False:
        return "FAIL"
    return "pending" if node.get("probe_required") else "-"


def _records(nodes: list[dict[str, Any]]) -> list[NodeRecord]:
    try:
        return [_record(n) for n in nodes]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # AdmissionError is a ValueError
        raise ValueError(
            f"the tracker's node list is not what this version reads: {type(exc).__name__}: {exc}"
        ) from None


def routes(
    nodes: list[dict[str, Any]], mixes: Mapping[str, Collection[frozenset[str]]] | None = None
) -> list[tuple[str, list[NodeRecord], float]]:
    """Every complete route per artifact, cheapest first (``mixes``: the recipe pairs that may share one)."""
    records = _records(nodes)
    out = []
    for artifact in sorted({r.artifact for r in records}):
        mine = [r for r in records if r.artifact == artifact and r.admitted]
        if mine:
            for route in all_routes(mine, mine[0].n_layer, (mixes or {}).get(artifact, ())):
                out.append((artifact, route, route_cost(route)))
    return sorted(out, key=lambda item: (item[0], item[2]))


def show(tracker: str, *, as_json: bool = False, status_key: str | None = None) -> int:
    """Print the status table (or JSON); exit status 1 if the tracker is unreachable."""
    try:
        nodes, mixes = fetch(tracker, status_key)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"noderuntime: error: cannot read {tracker}/v1/nodes: {exc}", file=sys.stderr)
        return 1
    found = routes(nodes, mixes)
    apart = unmixed(_records(nodes), mixes)
    if as_json:
        print(
            json.dumps(
                {
                    "nodes": nodes,
                    "routes": [
                        {
                            "artifact": a,
                            "hops": [[r.node_id.hex()[:16], *r.layers, r.device] for r in route],
                            "cost_ms": round(c, 2),
                        }
                        for a, route, c in found
                    ],
                    "unmixed": apart,
                },
                indent=2,
            )
        )
        return 0
    header = (
        f"{'node':<12} {'model':<20} {'layers':>8} {'recipe':<8} {'device':<9} {'reach':<12} {'load':>7} {'cap':>4} "
        f"{'decode ms b1/b8':>16} {'prefill t/s':>11} {'now ms':>7} {'probe':>7} {'seen':>6}"
    )
    print(header)
    print("-" * len(header))
    for n in nodes:
        print(
            f"{n['node_id'][:12]:<12} {n['model_name'][:20]:<20} {n['layers'][0]:>3}:{n['layers'][1]:<4} "
            f"{n['recipe'][:8]:<8} {str(n.get('device', 'cpu'))[:9]:<9} {n['reachability']:<12} "
            f"{n['active_sessions']:>3}/{n['slots']:<3} "
            f"{n.get('capacity', n['slots']):>4} {_decode(n):>16} {_prefill(n):>11} {n['estimated_step_ms']:>7.1f} "
            f"{_probe(n):>7} {n['seconds_since_heartbeat']:>5.1f}s"
        )
    for n in nodes:
        if n.get("audit_failed"):
            print(f"  {n['node_id'][:12]} is excluded from routes by audits: {n['audit_failed']}")
    print(f"\n{len(found)} complete route(s)")
    for artifact, route, cost in found[:20]:
        chain = " -> ".join(f"{r.node_id.hex()[:8]}[{r.layers[0]}:{r.layers[1]}]" for r in route)
        if len({r.recipe for r in route}) > 1:  # a route across devices: say which hop runs where
            chain += "  mixed: " + " / ".join(r.device for r in route)
        print(f"  {artifact[:12]}  {chain}  ~{cost:.1f} ms/step")
    for line in apart:
        print(f"  not mixed: {line}")
    return 0
