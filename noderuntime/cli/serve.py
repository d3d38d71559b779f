"""Commands that run a process until stopped: ``up``, ``tracker``, ``gateway``, ``relay``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from noderuntime.cli.args import (
    CliError,
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
    resolve_model,
    seconds,
    seconds_or_never,
    share,
    size,
    url,
    window,
    windows_ahead,
)
from noderuntime.engine.cores import machine_cores
from noderuntime.models import catalogue as models
from noderuntime.models import fetch, manifest

if TYPE_CHECKING:  # the node's services load the engine: not for a light install's commands
    from noderuntime.services.noderun import NodeOptions

API_KEYS_ENV = "NODERUNTIME_API_KEYS"  # comma-separated; keys in argv show in `ps`
# set in the environment of a node re-executed on its device's backend: it must not do so again
DEVICE_BACKEND_ENV = "NODERUNTIME_DEVICE_BACKEND"


def _check_device(args: argparse.Namespace) -> str:
    """The backend ``--device`` needs ("cpu", "vulkan", ...); CliError for a flag that cannot be."""
    from noderuntime.engine.backends import parse_device

    try:
        kind, _index = parse_device(args.device)
    except ValueError as exc:
        raise CliError(f"--device {args.device!r}: {exc}") from None
    if kind == "cpu" and args.gpu_layers:
        raise CliError("--gpu-layers counts layers on a GPU; --device cpu holds none")
    if kind != "cpu" and (args.model is None or args.local):
        raise CliError("--device places one node's shard; give it with --model (and without --local)")
    if kind != "cpu" and args.backend == "transformers":
        raise CliError("--device takes a GPU for llama.cpp; the transformers backend runs on the CPU")
    if args.draft is not None and (kind != "cpu" or args.backend != "llama.cpp"):
        # a window's rows are exact on the CPU build of llama.cpp alone (ShardEngine.exact_windows):
        # elsewhere a node takes no windows, and a draft model would hold memory for nothing
        raise CliError("--draft drafts for windows, which a node takes on the CPU with llama.cpp only")
    return kind


def _run_on_backend(kind: str, args: argparse.Namespace) -> None:
    """Make this node process load ``kind``'s build of llama.cpp, re-executing it when it would not.

    ``noderuntime up`` starts in the environment's CPU build; a GPU backend's build lives in
    a folder of its own (:mod:`noderuntime.engine.backends`). The process replaces itself
    (same pid, same output), so whoever started it sees one node either way. The node
    checks at start that the build it loaded is ``kind``'s (``noderun``).
    """
    from noderuntime.engine import backends

    if os.environ.get(DEVICE_BACKEND_ENV) == kind:
        return  # already re-executed: the node's own check says whether that worked
    try:
        runtime = backends.runtime(kind, software=args.allow_software_gpu)
    except backends.NoDeviceError as exc:
        if kind != "vulkan" or args.allow_software_gpu:
            raise
        raise backends.NoDeviceError(f"{exc}; --allow-software-gpu lets a software renderer serve") from None
    spec = importlib.util.find_spec("llama_cpp")
    origin = Path(spec.origin).resolve().parent.parent if spec is not None and spec.origin else None
    if runtime.site is not None and origin == runtime.site.resolve():
        return  # started with the backend's folder first on its path
    env = runtime.environ()
    env[DEVICE_BACKEND_ENV] = kind
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "noderuntime", *args.argv], env)


# what a light install (the relay and the tracker only) lacks to serve a shard or a gateway
ENGINE_MISSING = (
    "this install has no engine: {what} needs the project's patched llama-cpp-python. From a clone of the "
    "project, `make bootstrap` builds and installs it (once, about 5 minutes on 2 cores); by hand: "
    "`python kernels_patch/build.py --install`, then `pip install 'noderuntime[engine]'`. A light install "
    "(`pip install noderuntime`) runs `noderuntime relay` and `noderuntime tracker` only"
)


def _need_engine(what: str) -> None:
    """CliError when llama.cpp's bindings are not installed (a light install)."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise CliError(ENGINE_MISSING.format(what=what))


def _cmd_up(args: argparse.Namespace) -> int:
    _need_engine("`noderuntime up` (a shard node, or the local system)")
    kind = _check_device(args)
    if kind != "cpu":
        _run_on_backend(kind, args)
    if args.model is None or args.local:
        if args.draft is not None:
            raise CliError("--draft is a shard node's (with --model); the local system drafts from the conversation")
        from noderuntime.services import localsystem

        return localsystem.main(args.listen or "127.0.0.1:8080", args.model or models.DEMO_MODEL)
    if args.listen is None and args.relay is None:
        raise CliError("a node needs --listen HOST:PORT, --relay URL, or both")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key go together")
    if not args.issuer_key and not args.tracker:
        raise CliError("give the route issuer's public key with --issuer-key, or a --tracker to take it from")
    from noderuntime.services import joining

    # without --layers, a node with a tracker asks it where to serve (see services.joining)
    opts = joining.JoinOptions(
        node=node_options(args),
        url=args.model if fetch.is_url(args.model) else None,
        manifest=args.manifest,
        publisher_key=args.publisher_key,
        trust_tracker_manifests=args.trust_tracker_manifests,
        max_layers=args.max_layers,
        rebalance_every=args.rebalance_every,
        tls_self_signed=args.tls_self_signed,
    )
    try:
        return joining.main(opts)
    except joining.JoinError as exc:
        raise CliError(f"{exc} (or give this node its range with --layers A:B)") from None
    except joining.OptionsError as exc:
        raise CliError(str(exc)) from None


def node_options(args: argparse.Namespace) -> NodeOptions:
    """The shard node ``noderuntime up --model`` runs, as its flags give it.

    A known model's name is pulled (once) here; for a model by URL, ``model`` is the folder
    its ranges are fetched into (see :class:`~noderuntime.services.joining.JoinOptions`).
    """
    from noderuntime.services import noderun

    data_dir = Path(args.data_dir)
    return noderun.NodeOptions(
        model=data_dir / "shards" if fetch.is_url(args.model) else resolve_model(args.model),
        layers=args.layers,
        listen=args.listen,
        data_dir=data_dir,
        issuer_keys=tuple(args.issuer_key),
        advertise=args.advertise,
        relay=args.relay,
        threads=args.threads,
        share_cores=args.share_cores,
        slots=args.slots,
        ctx_per_session=args.ctx,
        batch=args.batch,
        flash_attn=args.flash_attn,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        idle_timeout=args.idle_timeout,
        hang_timeout=args.hang_timeout,
        drain_timeout=args.drain_timeout,
        prefix_cache=args.prefix_cache,
        http=args.http,
        trackers=tuple(args.tracker),
        tracker_keys=_tracker_keys(args),
        memory_limit=args.memory_limit,
        mmap=args.mmap,
        backend=args.backend,
        device=args.device,
        gpu_layers=args.gpu_layers,
        join_secret=_join_secret(args.join_secret_file),
        insecure_plaintext_seams=args.insecure_plaintext_seams,
        draft=resolve_model(args.draft) if args.draft is not None else None,
        windows_ahead=args.windows_ahead,
    )


def _tracker_keys(args: argparse.Namespace) -> tuple[tuple[str, bytes], ...]:
    """The keys --tracker-key gives, by tracker URL."""
    from noderuntime.access.known_trackers import KnownTrackersError, parse_given

    try:
        return tuple(parse_given(args.tracker_key, args.tracker).items())
    except KnownTrackersError as exc:
        raise CliError(str(exc)) from None


TRACKER_KEY_HELP = (
    "the ticket-issuer key (64 hex digits, or a file with them) a --tracker must show, as URL=KEY (a bare KEY "
    "with one --tracker); repeatable. Pinned in the data directory's known_trackers in place of the key pinned "
    "at first contact: how to accept a tracker's new key on purpose, or to pin one before any contact"
)


def _join_secret(path: str | None) -> bytes | None:
    """The join secret in ``path`` (--join-secret-file), or None without one."""
    if path is None:
        return None
    from noderuntime.access.signing import read_join_secret

    try:
        return read_join_secret(path)
    except (OSError, ValueError) as exc:
        raise CliError(f"--join-secret-file: {exc}") from None


def _cmd_relay(args: argparse.Namespace) -> int:
    from noderuntime.services import relayrun, running
    from noderuntime.transport.grpc import parse_address

    if not args.issuer_key:
        raise CliError("give the route issuer's public key with --issuer-key (the tracker's)")
    host, port = parse_address(args.listen, listen=True)
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise CliError("--tls-cert and --tls-key go together")
        tls = running.server_tls(args.tls_cert, args.tls_key, alpn=())  # websockets: HTTP/1.1
    from relay.server import RelayLimits

    limits = RelayLimits(
        max_nodes=args.max_nodes,
        max_nodes_per_host=args.max_nodes_per_host,
        max_pairs=args.max_pairs,
        max_handshakes=args.max_handshakes,
        max_handshakes_per_host=args.max_handshakes_per_host,
    )
    return relayrun.main_relay(host, port, tuple(args.issuer_key), tls, args.http, limits)


def _load_manifests(paths: list[Path]) -> tuple[manifest.Manifest, ...]:
    """The manifests a tracker serves, each signature checked; one per artifact."""
    loaded: dict[str, manifest.Manifest] = {}
    for path in paths:
        found = manifest.load(path)
        if found.artifact in loaded and loaded[found.artifact] != found:
            raise CliError(f"--manifest {path}: another manifest of artifact {found.artifact[:16]}… was given")
        loaded[found.artifact] = found
    return tuple(loaded.values())


def _connections_per_host(p: argparse.ArgumentParser) -> None:
    from noderuntime.operations.connections import CONNECTIONS_PER_HOST

    p.add_argument(
        "--max-connections-per-host",
        type=non_negative_int,
        default=CONNECTIONS_PER_HOST,
        help="HTTP connections one address (an IPv6 /64) may hold open at once; one more is closed unanswered "
        "(0: no cap; behind a reverse proxy every client has the proxy's address)",
    )


def _cmd_tracker(args: argparse.Namespace) -> int:
    from noderuntime.services import running, trackerrun
    from noderuntime.verify.certificates import load_certificate
    from noderuntime.verify.contract import ContractError

    data_dir = Path(args.data_dir)
    try:
        mixes = tuple(load_certificate(path) for path in args.certificate)
    except ContractError as exc:
        raise CliError(f"--certificate {exc}") from None
    manifests = _load_manifests(args.manifest)
    import trio

    trio.run(
        running.run_until_signal,
        lambda **kw: trackerrun.run_tracker(
            args.listen,
            data_dir,
            api_key=args.api_key,
            expire_after=args.expire_after,
            heartbeat_seconds=args.heartbeat_seconds,
            route_rate=args.route_rate,
            route_burst=args.route_burst,
            route_concurrency=args.route_concurrency,
            referees=tuple(args.referee),
            allow_nodes=tuple(args.allow_node),
            join_secret=_join_secret(args.join_secret_file),
            probe_references=tuple(args.probe_references),
            require_probe=args.require_probe,
            probe_interval=args.probe_interval,
            probe_tolerance=args.probe_tolerance,
            mixes=mixes,
            manifests=manifests,
            status_key=args.status_key,
            local_swarm=args.local_swarm,
            connections_per_host=args.max_connections_per_host,
            **kw,
        ),
    )
    return 0


def gateway_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Keys from --api-key, --api-key-file (one a line, # comments) and $NODERUNTIME_API_KEYS."""
    keys = list(args.api_key)
    if args.api_key_file is not None:
        try:
            lines = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise CliError(f"--api-key-file: {exc}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    keys += [k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()]
    for key in keys:
        try:
            api_key(key)
        except argparse.ArgumentTypeError as exc:
            raise CliError(str(exc)) from None
    return tuple(dict.fromkeys(keys))


def _cmd_gateway(args: argparse.Namespace) -> int:
    _need_engine("the gateway (its tokenizer)")
    import trio

    from noderuntime.services import noderun, running

    served = []
    for spec in args.model:
        model_id, _, where = spec.partition("=")
        path = resolve_model(where or model_id)
        if not where and model_id not in models.KNOWN_MODELS:
            model_id = path.stem
        served.append((model_id, path))
    opts = noderun.GatewayOptions(
        trackers=tuple(args.tracker),
        listen=args.listen,
        models=tuple(served),
        api_keys=gateway_keys(args),
        cors_origins=tuple(args.cors_origin),
        tracker_api_key=args.tracker_api_key,
        data_dir=Path(args.data_dir),
        tracker_keys=_tracker_keys(args),
        request_timeout=args.request_timeout,
        ctx=args.ctx,
        queue_timeout=args.queue_timeout,
        queue_limit=args.queue_limit,
        queue_per_key=args.queue_per_key,
        running_per_key=args.running_per_key,
        ledger=Path(args.ledger),
        audit_rate=args.audit_rate,
        speculate=args.speculate,
        insecure_plaintext_seams=args.insecure_plaintext_seams,
        connections_per_host=args.max_connections_per_host,
    )
    trio.run(running.run_until_signal, lambda **kw: noderun.run_gateway(opts, **kw))
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    """Drain the node whose data directory is given: SIGTERM, then wait for it to hand over and exit."""
    import signal
    import time

    pid_file = Path(args.data_dir) / "node.pid"  # noderun.PID_FILE, read without importing the engine
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        raise CliError(f"no node runs from {args.data_dir} (no readable {pid_file})") from None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        raise CliError(f"the node of {args.data_dir} (pid {pid}) is not running") from None
    except PermissionError:
        raise CliError(f"not allowed to signal the node of {args.data_dir} (pid {pid})") from None
    print(f"node {pid}: leaving (its sessions go on through other nodes)", flush=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"node {pid}: gone", flush=True)
            return 0
        time.sleep(0.1)
    raise CliError(f"the node (pid {pid}) is still running after {args.timeout:.0f} s")


def add_commands(sub: Any) -> None:
    """Add this group's commands to the ``noderuntime`` parser's subcommands."""
    _add_up(sub)
    _add_tracker(sub)
    _add_gateway(sub)
    _add_relay(sub)
    p = sub.add_parser(
        "down", help="make a node leave politely: routes stop naming it, its sessions go on through other nodes"
    )
    p.add_argument("--data-dir", default=str(default_data_dir()), help="the node's data directory (as given to up)")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds to wait for it to exit")
    p.set_defaults(func=_cmd_down)


def _add_up(sub: Any) -> None:
    p = sub.add_parser("up", help="run a shard node (with --model), serving until Ctrl-C")
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
    p.set_defaults(func=_cmd_up)


def _add_tracker(sub: Any) -> None:
    from noderuntime.tracker.records import HEARTBEAT_SECONDS

    p = sub.add_parser("tracker", help="run a tracker: node registry, route selection, session tickets")
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
    _connections_per_host(p)
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
    p.set_defaults(func=_cmd_tracker)


def _add_gateway(sub: Any) -> None:
    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
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
    _connections_per_host(p)
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
    p.set_defaults(func=_cmd_gateway)


def _add_relay(sub: Any) -> None:
    p = sub.add_parser("relay", help="run a relay for nodes that cannot be dialled directly")
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
    p.set_defaults(func=_cmd_relay)
