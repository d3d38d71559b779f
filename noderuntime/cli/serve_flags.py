"""The flags of the serving commands (``up``, ``tracker``, ``gateway``, ``relay``): each
function adds one command's flags to its parser, with their types, defaults and help."""

from __future__ import annotations

import argparse
from pathlib import Path

from noderuntime.cli.args import (
    address,
    api_key,
    default_data_dir,
    heartbeat_seconds,
    layers,
    listen_address,
    non_negative_int,
    per_second,
    positive_int,
    public_key,
    relay_url,
    seconds,
    seconds_or_never,
    share,
    size,
    url,
    window,
    windows_ahead,
)
from noderuntime.engine.cores import machine_cores

API_KEYS_ENV = "NODERUNTIME_API_KEYS"  # comma-separated; keys in argv show in `ps`
TRACKER_KEY_HELP = (
    "the ticket-issuer key (64 hex digits, or a file with them) a --tracker must show, as URL=KEY (a bare KEY "
    "with one --tracker); repeatable. Pinned in the data directory's known_trackers in place of the key pinned "
    "at first contact: how to accept a tracker's new key on purpose, or to pin one before any contact"
)


def connections_per_host(p: argparse.ArgumentParser) -> None:
    """``--max-connections-per-host``, for the commands that serve HTTP."""
    from noderuntime.operations.connections import CONNECTIONS_PER_HOST

    p.add_argument(
        "--max-connections-per-host",
        type=non_negative_int,
        default=CONNECTIONS_PER_HOST,
        help="HTTP connections one address (an IPv6 /64) may hold open at once; one more is closed unanswered "
        "(0: no cap; behind a reverse proxy every client has the proxy's address)",
    )


def up(p: argparse.ArgumentParser) -> None:
    """A shard node's flags."""
    p.add_argument(
        "--model",
        help="a GGUF file (whole model or a shard file), a known model name, the URL of a GGUF file "
        "(with --layers: that range alone is fetched, checked against its manifest), "
        "or with --backend transformers a safetensors model directory",
    )
    p.add_argument(
        "--backend",
        choices=["llama.cpp", "transformers"],
        default="llama.cpp",
        help="the engine: llama.cpp on GGUF (default) or Transformers on safetensors (torch, CPU)",
    )
    p.add_argument(
        "--draft",
        metavar="MODEL",
        help="speculative decoding: a small whole model with the same vocabulary (a GGUF file or a known "
        "name) that drafts for the routes this node heads, in place of drafting from the conversation; "
        "the tail keeps only what the session's own sampler picks, so replies are unchanged",
    )
    p.add_argument(
        "--windows-ahead",
        type=windows_ahead,
        default=3,
        metavar="N",
        help="speculative decoding on a long route: up to N windows may follow one in flight through this "
        "node, each drafted as if the one before were kept whole (default 3; 0: one window at a time)",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="run the whole system here for --model: tracker, relay, two shard nodes, gateway",
    )
    p.add_argument(
        "--layers",
        type=layers,
        help="layer range A:B this node serves (default: with --tracker, the range the tracker gives it for as "
        "many layers as fit --memory-limit or the memory free now; without, all of the file)",
    )
    p.add_argument(
        "--listen",
        type=listen_address,
        help="HOST:PORT for direct gRPC seams (omit: relay only); without --model, the gateway's address",
    )
    p.add_argument("--advertise", type=address, help="HOST:PORT peers should dial (default: the listen address)")
    p.add_argument("--relay", type=relay_url, help="ws://HOST:PORT of a relay to be reachable through")
    p.add_argument("--data-dir", default=str(default_data_dir()), help="where the node key lives")
    p.add_argument(
        "--issuer-key",
        type=public_key,
        action="append",
        default=[],
        help="public key (hex or file) whose session tickets this node accepts; repeatable (given, the node trusts "
        "these keys alone, not the ones its --trackers name)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=len(machine_cores()),
        help="the engine's OpenMP threads (default: every core this process may run on)",
    )
    p.add_argument(
        "--own-cores",
        dest="share_cores",
        action="store_false",
        help="this node's cores are its own (pinned apart from other nodes): do not take turns on them",
    )
    p.add_argument(
        "--join-secret-file",
        metavar="PATH",
        help="a private swarm's join secret (the file its tracker was given): the node proves it holds it",
    )
    p.add_argument("--slots", type=positive_int, default=8, help="concurrent sessions")
    p.add_argument("--ctx", type=positive_int, default=2048, help="context per session (multiple of 256)")
    p.add_argument("--batch", type=positive_int, default=512, help="tokens per batch")
    p.add_argument(
        "--flash-attn", choices=["on", "off", "auto"], default="auto", help="auto: on for the CPU, off on a GPU"
    )
    p.add_argument("--tls-cert", type=Path, help="PEM certificate for the gRPC listener")
    p.add_argument("--tls-key", type=Path, help="PEM key for the gRPC listener")
    p.add_argument("--tls-self-signed", action="store_true", help="make (once) and use a self-signed certificate")
    p.add_argument(
        "--insecure-plaintext-seams",
        action="store_true",
        help="leave seams, direct and relayed, unencrypted and unauthenticated, to measure what sealing costs; "
        "every peer must be started with it too (the others refuse such seams)",
    )
    p.add_argument("--idle-timeout", type=seconds, default=60.0, help="seconds a session may make no progress")
    p.add_argument(
        "--prefix-cache",
        type=size,
        default=None,
        help="memory for finished sessions' KV, reused by new sessions that begin alike (a chat's next turn, "
        "a shared system prompt); counted in --memory-limit; 0: none (default 256MiB, or under --memory-limit "
        "what the shard leaves of it, up to 256MiB)",
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds,
        default=10.0,
        help="on SIGTERM or `noderuntime down`, seconds to wait for live sessions to be handed over",
    )
    p.add_argument(
        "--hang-timeout",
        type=seconds,
        default=2.0,
        help="seconds a next hop may send nothing, not even a heartbeat, before it counts as hung",
    )
    p.add_argument("--http", type=listen_address, default="127.0.0.1:0", help="HOST:PORT of /status (port 0: any)")
    p.add_argument(
        "--tracker",
        type=url,
        action="append",
        default=[],
        help="register with this tracker and trust its session tickets; repeatable: the node registers and "
        "heartbeats with each (one that is down does not stop it starting with the others), and a node "
        "without --layers asks the first that answers where to serve",
    )
    p.add_argument("--tracker-key", action="append", default=[], metavar="[URL=]KEY", help=TRACKER_KEY_HELP)
    p.add_argument(
        "--max-layers",
        type=positive_int,
        help="without --layers: hold at most this many layers, however many fit (default: as many as fit)",
    )
    p.add_argument(
        "--rebalance-every",
        type=seconds_or_never,
        default=60.0,
        help="without --layers: seconds between asking the tracker whether to move to layers that serve the "
        "swarm better (with a fifth of jitter; 0: never). A move loads the new layers beside the old, serves "
        "them, then drains the old; the tracker moves a node only for a gain of its margin, then not for its hold-down",
    )
    p.add_argument(
        "--memory-limit",
        type=size,
        help="host memory this node may hold (2.5G, 2400MiB): refuse a shard that needs more, naming what would "
        "fit (a shard on a GPU is also planned against the memory its device has free)",
    )
    p.add_argument(
        "--no-mmap",
        dest="mmap",
        action="store_false",
        help="read the shard's weights into memory instead of mapping the file (implied by --memory-limit)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="where the shard's layers and KV live: cpu (default), or one GPU as vulkan:N, cuda:N or hip:N "
        "(runs the node with that backend's build of llama.cpp: kernels_patch/build.py --backend ... --install)",
    )
    p.add_argument(
        "--gpu-layers",
        type=non_negative_int,
        help="on a GPU, how many of the shard's layers it holds, counted from the end (default: all)",
    )
    p.add_argument(
        "--allow-software-gpu",
        action="store_true",
        help="let --device vulkan:N name a software renderer (Mesa's llvmpipe): Vulkan's code path on the CPU",
    )
    p.add_argument(
        "--manifest",
        help="with --model URL: the signed manifest it is checked against, as a file, a URL, or a tracker's URL "
        "(default: the --tracker)",
    )
    p.add_argument(
        "--publisher-key",
        type=public_key,
        help="with --model URL: accept only a manifest signed by this key (hex or a file with it)",
    )
    p.add_argument(
        "--trust-tracker-manifests",
        action="store_true",
        help="with --model URL and no --publisher-key: accept a manifest signed by any key, on the word of the "
        "tracker (or --manifest) that serves it",
    )


def tracker(p: argparse.ArgumentParser) -> None:
    """A tracker's flags."""
    from noderuntime.tracker.records import HEARTBEAT_SECONDS

    p.add_argument("--listen", type=listen_address, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument("--data-dir", default=str(default_data_dir().with_name("tracker")), help="where its key lives")
    p.add_argument("--api-key", type=api_key, help="require this bearer key for route requests (the gateway's)")
    p.add_argument(
        "--status-key",
        type=api_key,
        help="require this key to read the swarm map (/) and the node lists (/v1/status, /v1/status/nodes, "
        "/v1/nodes): Authorization: Bearer KEY, or ?key=KEY (default: they are open, and hold nothing secret)",
    )
    p.add_argument(
        "--expire-after",
        type=seconds,
        default=10.0,
        help="seconds without a heartbeat before a node is dropped, at the least (a large swarm's nodes beat less "
        "often and are dropped after three of their intervals)",
    )
    p.add_argument(
        "--heartbeat-seconds",
        type=heartbeat_seconds,
        default=HEARTBEAT_SECONDS,
        help="how often a small swarm's nodes heartbeat (0.5 to 60 s; a large swarm's beat less often): with "
        "--expire-after, how soon a node that died stops being routed to",
    )
    p.add_argument(
        "--route-rate",
        type=per_second,
        default=50.0,
        help="route, repair, audit and placement grants one client (an address, a key) may take a second in the "
        "long run; beyond, 429",
    )
    p.add_argument(
        "--route-burst",
        type=positive_int,
        default=200,
        help="of those grants, how many one client may take at once before --route-rate paces it",
    )
    p.add_argument(
        "--route-concurrency",
        type=positive_int,
        default=4096,
        help="route grants one client (an address, a key) may hold at once, each until its ticket expires; beyond, 429",
    )
    connections_per_host(p)
    p.add_argument(
        "--referee",
        type=public_key,
        action="append",
        default=[],
        metavar="NODE_ID",
        help="a node this tracker's operator trusts to re-execute audited sessions; a node is excluded only when "
        "a referee's re-execution confirms two auditors (without one, audits never exclude); repeatable",
    )
    p.add_argument(
        "--allow-node",
        type=public_key,
        action="append",
        default=[],
        metavar="NODE_ID",
        help="a private swarm: admit this node's key; repeatable (with neither this nor --join-secret-file, "
        "the swarm is open to any node)",
    )
    p.add_argument(
        "--join-secret-file",
        metavar="PATH",
        help="a private swarm: admit nodes that prove they hold the secret in this file (given to `up` likewise)",
    )
    p.add_argument(
        "--probe-references",
        type=Path,
        action="append",
        default=[],
        help="reference answers (from `noderuntime probe reference`); shards they cover must pass; repeatable",
    )
    p.add_argument("--require-probe", action="store_true", help="admit no shard the references do not cover")
    p.add_argument("--probe-interval", type=seconds, default=600.0, help="seconds between probes of a node")
    p.add_argument(
        "--probe-tolerance", type=float, default=1e-3, help="relative error a probe answer may have when not exact"
    )
    p.add_argument(
        "--certificate",
        type=Path,
        action="append",
        default=[],
        help="a mixed-route certificate (from `python -m benchmarks.backends`): routes may mix the pair of "
        "recipes it covers; repeatable",
    )
    p.add_argument(
        "--manifest",
        type=Path,
        action="append",
        default=[],
        help="a signed manifest (from `noderuntime models manifest`) to serve at /v1/manifests/ARTIFACT, "
        "for nodes that fetch only their layers; repeatable",
    )
    p.add_argument(
        "--local-swarm",
        action="store_true",
        help="the swarm runs on this machine or one private network: nodes may register loopback, private and "
        "link-local addresses, and the tickets this tracker signs let nodes and gateways dial them (without it "
        "such registrations are refused, and a node's direct address must be a literal public IP)",
    )


def gateway(p: argparse.ArgumentParser) -> None:
    """A gateway's flags."""
    p.add_argument(
        "--tracker",
        type=url,
        action="append",
        required=True,
        help="the tracker to ask for routes; repeatable, in order of preference: each request goes to the first "
        "that answers, and one that does not is passed over for a back-off (1 s, doubling to 30 s)",
    )
    p.add_argument("--listen", type=listen_address, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="a model to serve: a known name, a GGUF path, or NAME=PATH; repeatable",
    )
    p.add_argument(
        "--api-key",
        type=api_key,
        action="append",
        default=[],
        help=f"accepted client bearer key; repeatable (argv shows in ps: prefer --api-key-file or ${API_KEYS_ENV})",
    )
    p.add_argument("--api-key-file", help="a file of accepted client keys, one a line")
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="an origin browsers may call the API from (e.g. https://app.example); repeatable, '*' for any",
    )
    p.add_argument("--tracker-key", action="append", default=[], metavar="[URL=]KEY", help=TRACKER_KEY_HELP)
    p.add_argument(
        "--tracker-api-key", help="bearer key for route requests to the trackers (the same for each; their --api-key)"
    )
    p.add_argument(
        "--data-dir",
        default=str(default_data_dir().with_name("gateway")),
        help="where the gateway keeps the keys its trackers showed at first contact (known_trackers)",
    )
    p.add_argument("--request-timeout", type=seconds, default=600.0, help="seconds a request may take")
    p.add_argument("--ctx", type=positive_int, help="context per session the nodes offer (default: the model's)")
    p.add_argument(
        "--queue-timeout",
        type=seconds,
        default=10.0,
        help="seconds a request waits in line for a free slot when every route is full, before 429",
    )
    p.add_argument(
        "--queue-limit",
        type=non_negative_int,
        default=256,
        help="requests that may wait in line for a slot; one more is refused at once (429; 0: none wait)",
    )
    p.add_argument(
        "--queue-per-key",
        type=non_negative_int,
        default=64,
        help="of the requests waiting in line, how many under one API key (turns go round the keys)",
    )
    p.add_argument(
        "--running-per-key",
        type=positive_int,
        default=256,
        help="sessions one API key (or, with no keys, one client address) may run at once; one more is refused (429)",
    )
    connections_per_host(p)
    p.add_argument(
        "--audit-rate",
        type=share,
        default=0.03,
        help="the share of sessions recomputed by other nodes after they end, to catch a node that computes "
        "something else than its recipe (default 0.03; 0: none)",
    )
    p.add_argument(
        "--speculate",
        type=window,
        default=8,
        metavar="K",
        help="speculative decoding: each decode step of a route may carry up to K tokens the head drafts "
        "from the conversation; the tail keeps those its own sampler picks, so replies are unchanged "
        "(default 8; 0: none)",
    )
    p.add_argument(
        "--ledger",
        default=str(default_data_dir().with_name("gateway") / "ledger.sqlite"),
        help="the SQLite usage ledger (one entry per request, with every shard's signed record)",
    )
    p.add_argument(
        "--insecure-plaintext-seams",
        action="store_true",
        help="open seams to heads unencrypted and unauthenticated, to measure what sealing costs; only heads "
        "started with it answer",
    )


def relay(p: argparse.ArgumentParser) -> None:
    """A relay's flags."""
    p.add_argument("--listen", type=listen_address, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument(
        "--issuer-key",
        type=public_key,
        action="append",
        default=[],
        help="public key whose session tickets the relay accepts; repeatable",
    )
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--http", type=listen_address, default="127.0.0.1:0", help="HOST:PORT of /status (port 0: any)")
    p.add_argument("--max-nodes", type=positive_int, default=1024, help="node control connections held at most")
    p.add_argument(
        "--max-nodes-per-host", type=positive_int, default=64, help="node control connections from one address"
    )
    p.add_argument("--max-pairs", type=positive_int, default=4096, help="seams paired or pairing at most")
    p.add_argument(
        "--max-handshakes", type=positive_int, default=1024, help="unproven connections from all addresses at most"
    )
    p.add_argument(
        "--max-handshakes-per-host",
        type=positive_int,
        default=64,
        help="connections from one address (an IPv6 /64) that have not yet shown a key, ticket or pair",
    )
