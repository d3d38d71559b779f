"""``noderuntime status --tracker URL``: the nodes a tracker knows, their load, and the routes they form."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from noderuntime.tracker.state import NodeRecord, all_routes, route_cost


def fetch(tracker: str) -> list[dict[str, Any]]:
    """The tracker's ``/v1/nodes``."""
    with urllib.request.urlopen(tracker.rstrip("/") + "/v1/nodes", timeout=10) as response:
        nodes: list[dict[str, Any]] = json.loads(response.read())["nodes"]
    return nodes


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
        active_sessions=node["active_sessions"],
        free_slots=node["free_slots"],
        queue_depth=node["queue_depth"],
        step_ms=node["step_ms"],
        measured_step_ms=node.get("measured_step_ms", 0.0),
        probe_passed=node.get("probe_passed"),
    )


def routes(nodes: list[dict[str, Any]]) -> list[tuple[str, list[NodeRecord], float]]:
    """Every complete route per artifact, cheapest first."""
    records = [_record(n) for n in nodes]
    out = []
    for artifact in sorted({r.artifact for r in records}):
        mine = [r for r in records if r.artifact == artifact and r.probe_passed is not False]
        if mine:
            for route in all_routes(mine, mine[0].n_layer):
                out.append((artifact, route, route_cost(route)))
    return sorted(out, key=lambda item: (item[0], item[2]))


def show(tracker: str, *, as_json: bool = False) -> int:
    """Print the status table (or JSON); exit status 1 if the tracker is unreachable."""
    try:
        nodes = fetch(tracker)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"noderuntime: error: cannot read {tracker}/v1/nodes: {exc}")
        return 1
    found = routes(nodes)
    if as_json:
        print(
            json.dumps(
                {
                    "nodes": nodes,
                    "routes": [
                        {
                            "artifact": a,
                            "hops": [[r.node_id.hex()[:16], *r.layers] for r in route],
                            "cost_ms": round(c, 2),
                        }
                        for a, route, c in found
                    ],
                },
                indent=2,
            )
        )
        return 0
    header = (
        f"{'node':<16} {'model':<24} {'layers':>8} {'reach':<12} {'load':>7} {'step ms':>8} {'probe':>6} {'seen':>6}"
    )
    print(header)
    print("-" * len(header))
    for n in nodes:
        probe = {True: "ok", False: "FAIL", None: "-"}[n.get("probe_passed")]
        print(
            f"{n['node_id'][:16]:<16} {n['model_name'][:24]:<24} {n['layers'][0]:>3}:{n['layers'][1]:<4} "
            f"{n['reachability']:<12} {n['active_sessions']:>3}/{n['slots']:<3} {n['estimated_step_ms']:>8.1f} "
            f"{probe:>6} {n['seconds_since_heartbeat']:>5.1f}s"
        )
    print(f"\n{len(found)} complete route(s)")
    for artifact, route, cost in found[:20]:
        chain = " -> ".join(f"{r.node_id.hex()[:8]}[{r.layers[0]}:{r.layers[1]}]" for r in route)
        print(f"  {artifact[:12]}  {chain}  ~{cost:.1f} ms/step")
    return 0
