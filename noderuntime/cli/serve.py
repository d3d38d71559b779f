"""Commands that run a process until stopped: ``up``, ``tracker``, ``gateway``, ``relay``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from noderuntime.cli import serve_flags
from noderuntime.cli.args import (
    CliError,
    api_key,
    default_data_dir,
    resolve_model,
    seconds,
)
from noderuntime.cli.serve_flags import API_KEYS_ENV
from noderuntime.models import catalogue as models
from noderuntime.models import fetch, manifest

if TYPE_CHECKING:  # the node's services load the engine: not for a light install's commands
    from noderuntime.services.noderun import NodeOptions

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
    p = sub.add_parser("up", help="run a shard node (with --model), serving until Ctrl-C")
    serve_flags.up(p)
    p.set_defaults(func=_cmd_up)
    p = sub.add_parser("tracker", help="run a tracker: node registry, route selection, session tickets")
    serve_flags.tracker(p)
    p.set_defaults(func=_cmd_tracker)
    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    serve_flags.gateway(p)
    p.set_defaults(func=_cmd_gateway)
    p = sub.add_parser("relay", help="run a relay for nodes that cannot be dialled directly")
    serve_flags.relay(p)
    p.set_defaults(func=_cmd_relay)
    p = sub.add_parser(
        "down", help="make a node leave politely: routes stop naming it, its sessions go on through other nodes"
    )
    p.add_argument("--data-dir", default=str(default_data_dir()), help="the node's data directory (as given to up)")
    p.add_argument("--timeout", type=seconds, default=30.0, help="seconds to wait for it to exit")
    p.set_defaults(func=_cmd_down)
