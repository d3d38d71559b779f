"""The ``noderuntime`` command line."""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import logging
import math
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from noderuntime import artifacts, models
from noderuntime.cluster import ProcessError
from noderuntime.steps import EngineError


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 1."""


def _api_key(text: str) -> str:
    # an empty key (an unset variable, say) would let in every request that sends none
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError("an API key must be non-empty, without spaces around it")
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < math.inf:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text}")
    return value


def _size(text: str) -> int:
    from noderuntime.memplan import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cuts(text: str) -> list[int]:
    try:
        cuts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cuts must be comma-separated integers, got {text!r}") from None
    if len(cuts) < 2 or any(b <= a for a, b in itertools.pairwise(cuts)):
        raise argparse.ArgumentTypeError(f"cuts must be at least two increasing integers, got {text!r}")
    return cuts


def _ranges(text: str) -> list[artifacts.LayerRange]:
    try:
        return artifacts.LayerRange.parse_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def resolve_model(spec: str) -> Path:
    """A model given as a path, or as the name of a known model (pulled on first use)."""
    if spec in models.KNOWN_MODELS:
        return models.pull(spec)
    path = Path(spec)
    if not path.exists():
        known = ", ".join(sorted(models.KNOWN_MODELS))
        raise CliError(f"model {spec!r} is neither a file nor a known model ({known})")
    return path


def _cmd_shard_inspect(args: argparse.Namespace) -> int:
    info = artifacts.inspect(resolve_model(args.file))
    fields: dict[str, Any] = {
        "path": str(info.path),
        "fingerprint": info.fingerprint,
        "file_fingerprint": info.file_fingerprint,
        "architecture": info.architecture,
        "name": info.name,
        "layers": str(info.layer_range),
        "n_layer": info.n_layer,
        "n_embd": info.n_embd,
        "n_vocab": info.n_vocab,
        "quant": info.quant,
        "tensors": info.n_tensors,
        "tensor_bytes": info.tensor_bytes,
        "file_bytes": info.file_bytes,
        "shard_file": info.is_shard_file,
    }
    if args.json:
        print(json.dumps(fields, indent=2))
    else:
        width = max(len(k) for k in fields)
        for key, value in fields.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _cmd_shard_split(args: argparse.Namespace) -> int:
    written = artifacts.split(resolve_model(args.model), args.ranges, args.out, progress=not args.quiet)
    for path in written:
        info = artifacts.inspect(path, verify=False)
        print(f"{path}  layers {info.layer_range}  {info.file_bytes / 1e6:.1f} MB")
    return 0


def _cmd_models_pull(args: argparse.Namespace) -> int:
    print(models.pull(args.name, progress=not args.quiet))
    return 0


def _cmd_models_list(_args: argparse.Namespace) -> int:
    for name, model in sorted(models.KNOWN_MODELS.items()):
        path = models.path_of(name)
        state = "pulled" if path.exists() else "not pulled"
        print(f"{name:<16} {model.filename:<40} {model.size / 1e6:8.1f} MB  {model.license:<12} {state}")
    return 0


def _cmd_models_lanes(args: argparse.Namespace) -> int:
    from noderuntime import lanes

    built = lanes.build(resolve_model(args.model), say=lambda text: print(text, file=sys.stderr))
    for name, lane in built.items():
        print(f"{name:<12} {lane.backend:<13} {lane.precision:<7} {lane.size_bytes() / 2**20:8.1f} MiB  {lane.path}")
    return 0


def _cmd_models_synth(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from noderuntime import synth

    try:
        shape = synth.ModelShape(
            arch=args.arch,
            n_layer=args.layers,
            n_embd=args.embd,
            n_ff=args.ff,
            n_head=args.heads,
            n_head_kv=args.kv_heads,
            n_vocab=args.vocab,
            head_dim=args.head_dim,
            n_expert=args.experts,
            n_expert_used=args.experts_used,
            n_ff_expert=args.expert_ff,
            context_length=args.context,
            tied_output=not args.untied_output,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    with tqdm(unit="B", unit_scale=True, desc=f"synth {Path(args.out).name}", disable=args.quiet) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        path = synth.write_model(args.out, shape, quant=args.quant, seed=args.seed, progress=progress)
    info = artifacts.inspect(path)
    print(f"{path}  {info.file_bytes / 1e9:.2f} GB  {info.n_layer} layers  fingerprint {info.fingerprint[:16]}")
    return 0


def _cmd_check_parity(args: argparse.Namespace) -> int:
    from noderuntime.engine import Recipe
    from noderuntime.parity import check_parity
    from noderuntime.procchain import ChainError

    model = resolve_model(args.model)
    try:
        recipe = Recipe(n_threads=args.threads, n_ctx_per_seq=512, n_seq_max=2, flash_attn=args.flash_attn)
        report = check_parity(model, args.cuts, n_tokens=args.tokens, recipe=recipe)
    except (ValueError, ChainError) as exc:  # ChainError: a model llama.cpp cannot cut, or a shard file
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        verdict = "PARITY" if report["parity"] else "MISMATCH"
        print(
            f"{verdict}: cuts {report['cuts']}, {report['tokens']} greedy tokens, "
            f"max |Δlogits| {report['max_abs_diff_logits']:.3g}, max |Δhidden| {report['max_abs_diff_hidden']:.3g}, "
            f"greedy tokens equal: {report['greedy_tokens_equal']}"
        )
    return 0 if report["parity"] else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from noderuntime.demo import run

    return run(args.prompt, args.max_tokens)


def _address(text: str, *, listen: bool = False) -> str:
    from noderuntime.transport.grpc import parse_address

    try:
        parse_address(text, listen=listen)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _listen_address(text: str) -> str:
    return _address(text, listen=True)


def _layers(text: str) -> artifacts.LayerRange:
    try:
        return artifacts.LayerRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _public_key(text: str) -> bytes:
    from noderuntime.identity import IdentityError, load_public_key

    try:
        return load_public_key(text)
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _relay_url(text: str) -> str:
    if not text.startswith(("ws://", "wss://")):
        raise argparse.ArgumentTypeError(f"a relay URL starts with ws:// or wss://, got {text!r}")
    return text


def _default_data_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("noderuntime")) / "node"


def _cmd_up(args: argparse.Namespace) -> int:
    from noderuntime import noderun

    if args.model is None or args.local:
        from noderuntime import localsystem

        return localsystem.main(args.listen or "127.0.0.1:8080", args.model or models.DEMO_MODEL)
    if args.listen is None and args.relay is None:
        raise CliError("a node needs --listen HOST:PORT, --relay URL, or both")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key go together")
    if not args.issuer_key and not args.tracker:
        raise CliError("give the route issuer's public key with --issuer-key, or a --tracker to take it from")
    model = resolve_model(args.model)
    if args.backend == "transformers":
        if not model.is_dir():
            raise CliError(f"--backend transformers takes a safetensors model directory; {model} is a file")
        if args.memory_limit is not None:
            raise CliError("--memory-limit plans llama.cpp's buffers; the transformers backend does not take it")
    elif model.is_dir():
        raise CliError(f"{model} is a directory; give a GGUF file, or --backend transformers for safetensors")
    tls_cert, tls_key = args.tls_cert, args.tls_key
    if args.tls_self_signed:
        from noderuntime.identity import self_signed

        files = self_signed(Path(args.data_dir))
        tls_cert, tls_key = files.cert, files.key
    opts = noderun.NodeOptions(
        model=model,
        layers=args.layers,
        listen=args.listen,
        data_dir=Path(args.data_dir),
        issuer_keys=tuple(args.issuer_key),
        advertise=args.advertise,
        relay=args.relay,
        threads=args.threads,
        slots=args.slots,
        ctx_per_session=args.ctx,
        batch=args.batch,
        flash_attn=args.flash_attn,
        tls_cert=tls_cert,
        tls_key=tls_key,
        idle_timeout=args.idle_timeout,
        http=args.http,
        tracker=args.tracker,
        memory_limit=args.memory_limit,
        mmap=args.mmap,
        backend=args.backend,
    )
    return noderun.main_node(opts)


def _cmd_relay(args: argparse.Namespace) -> int:
    from noderuntime import noderun
    from noderuntime.transport.grpc import parse_address

    if not args.issuer_key:
        raise CliError("give the route issuer's public key with --issuer-key (the tracker's)")
    host, port = parse_address(args.listen, listen=True)
    tls = None
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise CliError("--tls-cert and --tls-key go together")
        tls = noderun.server_tls(args.tls_cert, args.tls_key, alpn=())  # websockets: HTTP/1.1
    from noderuntime.relay.server import RelayLimits

    limits = RelayLimits(
        max_nodes=args.max_nodes,
        max_nodes_per_host=args.max_nodes_per_host,
        max_pairs=args.max_pairs,
        max_handshakes=args.max_handshakes,
        max_handshakes_per_host=args.max_handshakes_per_host,
    )
    return noderun.main_relay(host, port, tuple(args.issuer_key), tls, args.http, limits)


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text.rstrip("/")


def _cmd_tracker(args: argparse.Namespace) -> int:
    from noderuntime import noderun

    data_dir = Path(args.data_dir)
    import trio

    trio.run(
        noderun.run_until_signal,
        lambda **kw: noderun.run_tracker(
            args.listen,
            data_dir,
            api_key=args.api_key,
            expire_after=args.expire_after,
            probe_references=tuple(args.probe_references),
            require_probe=args.require_probe,
            probe_interval=args.probe_interval,
            probe_tolerance=args.probe_tolerance,
            **kw,
        ),
    )
    return 0


API_KEYS_ENV = "NODERUNTIME_API_KEYS"  # comma-separated; keys in argv show in `ps`


def _gateway_keys(args: argparse.Namespace) -> tuple[str, ...]:
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
            _api_key(key)
        except argparse.ArgumentTypeError as exc:
            raise CliError(str(exc)) from None
    return tuple(dict.fromkeys(keys))


def _cmd_gateway(args: argparse.Namespace) -> int:
    import trio

    from noderuntime import noderun

    served = []
    for spec in args.model:
        model_id, _, where = spec.partition("=")
        path = resolve_model(where or model_id)
        if not where and model_id not in models.KNOWN_MODELS:
            model_id = path.stem
        served.append((model_id, path))
    opts = noderun.GatewayOptions(
        tracker=args.tracker,
        listen=args.listen,
        models=tuple(served),
        api_keys=_gateway_keys(args),
        cors_origins=tuple(args.cors_origin),
        tracker_key=args.tracker_key,
        request_timeout=args.request_timeout,
        ctx=args.ctx,
        queue_timeout=args.queue_timeout,
        ledger=Path(args.ledger),
    )
    trio.run(noderun.run_until_signal, lambda **kw: noderun.run_gateway(opts, **kw))
    return 0


def _cmd_usage(args: argparse.Namespace) -> int:
    from noderuntime.ledger import show

    return show(args.ledger, as_json=args.json)


def _cmd_probe_reference(args: argparse.Namespace) -> int:
    from noderuntime import admission

    entries = admission.make_references(
        resolve_model(args.model),
        [(r.start, r.end) for r in args.ranges],
        seeds=args.seeds,
        recipe_options={
            "n_threads": args.threads,
            "n_batch": args.batch,
            "n_ubatch": args.batch,
            "flash_attn": args.flash_attn,
        },
    )
    args.out.write_text(json.dumps({"references": entries}, indent=1) + "\n")
    print(f"{len(entries)} reference answers for {len(args.ranges)} range(s) written to {args.out}")
    return 0


def _cmd_probe_check(args: argparse.Namespace) -> int:
    import random
    import urllib.request

    from noderuntime import admission

    references = admission.ProbeReferences.load(args.references)
    with urllib.request.urlopen(args.node + "/status", timeout=10) as response:
        status = json.loads(response.read())
    key = (status["artifact"], (int(status["layers"][0]), int(status["layers"][1])), status["recipe"])
    seeds = references.seeds(key)
    if not seeds:
        raise CliError(f"no reference for artifact {key[0][:16]}…, layers {key[1]}, recipe {key[2]}")
    seed = random.SystemRandom().choice(seeds)
    with urllib.request.urlopen(f"{args.node}/probe?seed={seed}", timeout=120) as response:
        answer = admission.ProbeAnswer.from_json(json.loads(response.read()))
    reference = references.get(key, seed)
    assert reference is not None
    verdict = admission.compare(reference, answer, args.tolerance)
    print(
        f"node {status['node_id'][:16]} layers {key[1][0]}:{key[1][1]}: "
        f"{'PASSED' if verdict.passed else 'FAILED'} ({verdict.describe()})"
    )
    return 0 if verdict.passed else 2


def _cmd_status(args: argparse.Namespace) -> int:
    from noderuntime.status import show

    return show(args.tracker, as_json=args.json)


def _cmd_bench_verify(args: argparse.Namespace) -> int:
    from noderuntime import contract

    path: Path = args.file
    # an unreadable or malformed file is a usage problem (2); a contract that does not verify is a failure (1)
    try:
        document = contract.load(path)
    except contract.ContractError as exc:
        print(f"noderuntime: error: {exc}", file=sys.stderr)
        return 2
    try:
        signer = contract.verify_signature(document, key=args.key)
        results = contract.check(document)
    except contract.ContractError as exc:
        raise CliError(f"{path}: {exc}") from None
    print(f"contract {document['benchmark']} ({path})")
    print(f"signed by {signer.hex()}")
    print(contract.results_table(results))
    failed = [r.threshold.id for r in results if not r.passed]
    print(
        f"FAIL: {len(failed)} of {len(results)} thresholds do not hold"
        if failed
        else f"all {len(results)} thresholds hold"
    )
    if not args.rerun:
        return 1 if failed else 0
    out = path.with_suffix(".rerun.json")
    command = shlex.join(["python", "-m", document["benchmark"], *document["args"], "--out", str(out)])
    print(f"rerun: {command}", flush=True)
    try:
        # with --key the signature was checked against a key the caller trusts
        comparison = contract.compare(document, contract.rerun(document, out, trusted_signer=args.key is not None))
    except contract.ContractError as exc:
        raise CliError(str(exc)) from None
    print(contract.comparison_table(comparison))
    print("thresholds on the rerun:")
    print(contract.results_table(comparison.thresholds))
    for change in comparison.inputs:
        print(f"input {change.name} differs: sha256 {change.old or 'absent'} -> {change.new or 'absent'}")
    print(f"rerun: {'PASS' if comparison.passed else 'FAIL'}")
    return 1 if failed or not comparison.passed else 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="noderuntime", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    shard = sub.add_parser("shard", help="inspect and slice GGUF model files").add_subparsers(
        dest="shard_command", required=True, metavar="SUBCOMMAND"
    )
    p = shard.add_parser("inspect", help="print a model file's fingerprint and shape")
    p.add_argument("file", help="a GGUF file or a known model name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_shard_inspect)
    p = shard.add_parser("split", help="write one GGUF file per layer range")
    p.add_argument("model", help="a GGUF file or a known model name")
    p.add_argument("--ranges", type=_ranges, required=True, help="e.g. 0:10,10:20,20:30")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_shard_split)

    model_cmds = sub.add_parser("models", help="fetch and make models").add_subparsers(
        dest="models_command", required=True, metavar="SUBCOMMAND"
    )
    p = model_cmds.add_parser("pull", help="fetch a known model into the user cache")
    p.add_argument("name", nargs="?", default=models.DEMO_MODEL, help=f"default {models.DEMO_MODEL}")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_models_pull)
    p = model_cmds.add_parser("list", help="known models")
    p.set_defaults(func=_cmd_models_list)
    p = model_cmds.add_parser(
        "lanes", help="make (once) the Gate A lanes of a model: GGUF F32/F16/Q8_0/Q4_K_M and F32/BF16 safetensors"
    )
    p.add_argument("model", nargs="?", default=models.DEMO_MODEL, help="a GGUF file or known model name")
    p.set_defaults(func=_cmd_models_lanes)
    p = model_cmds.add_parser("synth", help="write a random-weight model of any size")
    p.add_argument("--arch", default="llama", help="llama, qwen3 or qwen3moe")
    p.add_argument("--layers", type=_positive_int, required=True)
    p.add_argument("--embd", type=_positive_int, required=True)
    p.add_argument("--ff", type=_positive_int, required=True)
    p.add_argument("--heads", type=_positive_int, required=True)
    p.add_argument("--kv-heads", type=_positive_int, required=True)
    p.add_argument("--vocab", type=_positive_int, required=True)
    p.add_argument("--head-dim", type=_positive_int, default=0, help="size of one head (default: embd / heads)")
    p.add_argument("--experts", type=_positive_int, default=0, help="experts per layer (qwen3moe)")
    p.add_argument("--experts-used", type=_positive_int, default=0, help="experts each token uses (qwen3moe)")
    p.add_argument("--expert-ff", type=_positive_int, default=0, help="feed-forward length of one expert (qwen3moe)")
    p.add_argument("--untied-output", action="store_true", help="an output head of its own, not the embedding")
    p.add_argument("--context", type=_positive_int, default=4096)
    p.add_argument("--quant", default="Q4_0", choices=["F32", "F16", "Q8_0", "Q4_0"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_models_synth)

    check = sub.add_parser("check", help="correctness checks").add_subparsers(
        dest="check_command", required=True, metavar="SUBCOMMAND"
    )
    p = check.add_parser("parity", help="shards in separate processes vs the whole model (Gate B)")
    p.add_argument("--model", default=models.DEMO_MODEL, help="a GGUF file or a known model name")
    p.add_argument("--cuts", type=_cuts, required=True, help="e.g. 0,10,20,30")
    p.add_argument("--tokens", type=_positive_int, default=32, help="greedy decode steps")
    p.add_argument("--threads", type=_positive_int, default=2)
    p.add_argument("--flash-attn", choices=["on", "off"], default="off")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_check_parity)

    p = sub.add_parser("up", help="run a shard node (with --model), serving until Ctrl-C")
    p.add_argument(
        "--model",
        help="a GGUF file (whole model or a shard file), a known model name, "
        "or with --backend transformers a safetensors model directory",
    )
    p.add_argument(
        "--backend",
        choices=["llama.cpp", "transformers"],
        default="llama.cpp",
        help="the engine: llama.cpp on GGUF (default) or Transformers on safetensors (torch, CPU)",
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="run the whole system here for --model: tracker, relay, two shard nodes, gateway",
    )
    p.add_argument("--layers", type=_layers, help="layer range A:B this node serves (default: all of the file)")
    p.add_argument(
        "--listen",
        type=_listen_address,
        help="HOST:PORT for direct gRPC seams (omit: relay only); without --model, the gateway's address",
    )
    p.add_argument("--advertise", type=_address, help="HOST:PORT peers should dial (default: the listen address)")
    p.add_argument("--relay", type=_relay_url, help="ws://HOST:PORT of a relay to be reachable through")
    p.add_argument("--data-dir", default=str(_default_data_dir()), help="where the node key lives")
    p.add_argument(
        "--issuer-key",
        type=_public_key,
        action="append",
        default=[],
        help="public key (hex or file) whose session tickets this node accepts; repeatable",
    )
    p.add_argument("--threads", type=_positive_int, default=2)
    p.add_argument("--slots", type=_positive_int, default=8, help="concurrent sessions")
    p.add_argument("--ctx", type=_positive_int, default=2048, help="context per session (multiple of 256)")
    p.add_argument("--batch", type=_positive_int, default=512, help="tokens per batch")
    p.add_argument("--flash-attn", choices=["on", "off"], default="off")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate for the gRPC listener")
    p.add_argument("--tls-key", type=Path, help="PEM key for the gRPC listener")
    p.add_argument("--tls-self-signed", action="store_true", help="make (once) and use a self-signed certificate")
    p.add_argument("--idle-timeout", type=_seconds, default=60.0, help="seconds a session may make no progress")
    p.add_argument("--http", type=_listen_address, default="127.0.0.1:0", help="HOST:PORT of /status (port 0: any)")
    p.add_argument("--tracker", type=_url, help="register with this tracker (and trust its session tickets)")
    p.add_argument(
        "--memory-limit",
        type=_size,
        help="bytes this node may hold (2.5G, 2400MiB): refuse a shard that needs more, naming what would fit",
    )
    p.add_argument(
        "--no-mmap",
        dest="mmap",
        action="store_false",
        help="read the shard's weights into memory instead of mapping the file (implied by --memory-limit)",
    )
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("tracker", help="run a tracker: node registry, route selection, session tickets")
    p.add_argument("--listen", type=_listen_address, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument("--data-dir", default=str(_default_data_dir().with_name("tracker")), help="where its key lives")
    p.add_argument("--api-key", type=_api_key, help="require this bearer key for route requests (the gateway's)")
    p.add_argument(
        "--expire-after", type=_seconds, default=10.0, help="seconds without heartbeat before a node is dropped"
    )
    p.add_argument(
        "--probe-references",
        type=Path,
        action="append",
        default=[],
        help="reference answers (from `noderuntime probe reference`); shards they cover must pass; repeatable",
    )
    p.add_argument("--require-probe", action="store_true", help="admit no shard the references do not cover")
    p.add_argument("--probe-interval", type=_seconds, default=600.0, help="seconds between probes of a node")
    p.add_argument(
        "--probe-tolerance", type=float, default=1e-3, help="relative error a probe answer may have when not exact"
    )
    p.set_defaults(func=_cmd_tracker)

    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway")
    p.add_argument("--tracker", type=_url, required=True)
    p.add_argument("--listen", type=_listen_address, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        help="a model to serve: a known name, a GGUF path, or NAME=PATH; repeatable",
    )
    p.add_argument(
        "--api-key",
        type=_api_key,
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
    p.add_argument("--tracker-key", help="bearer key for the tracker's route requests")
    p.add_argument("--request-timeout", type=_seconds, default=600.0, help="seconds a request may take")
    p.add_argument("--ctx", type=_positive_int, help="context per session the nodes offer (default: the model's)")
    p.add_argument(
        "--queue-timeout", type=_seconds, default=10.0, help="seconds a request waits for a free route before 429"
    )
    p.add_argument(
        "--ledger",
        default=str(_default_data_dir().with_name("gateway") / "ledger.sqlite"),
        help="the SQLite usage ledger (one entry per request, with every shard's signed record)",
    )
    p.set_defaults(func=_cmd_gateway)

    p = sub.add_parser("usage", help="per-node and per-model totals from a gateway's usage ledger")
    p.add_argument("--ledger", default=str(_default_data_dir().with_name("gateway") / "ledger.sqlite"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_usage)

    p = sub.add_parser("status", help="nodes, ranges, load and routes known to a tracker")
    p.add_argument("--tracker", type=_url, required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("relay", help="run a relay for nodes that cannot be dialled directly")
    p.add_argument("--listen", type=_listen_address, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument(
        "--issuer-key",
        type=_public_key,
        action="append",
        default=[],
        help="public key whose session tickets the relay accepts; repeatable",
    )
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--http", type=_listen_address, default="127.0.0.1:0", help="HOST:PORT of /status (port 0: any)")
    p.add_argument("--max-nodes", type=_positive_int, default=1024, help="node control connections held at most")
    p.add_argument(
        "--max-nodes-per-host", type=_positive_int, default=64, help="node control connections from one address"
    )
    p.add_argument("--max-pairs", type=_positive_int, default=4096, help="seams paired or pairing at most")
    p.add_argument(
        "--max-handshakes", type=_positive_int, default=1024, help="unproven connections from all addresses at most"
    )
    p.add_argument(
        "--max-handshakes-per-host",
        type=_positive_int,
        default=64,
        help="connections from one address (an IPv6 /64) that have not yet shown a key, ticket or pair",
    )
    p.set_defaults(func=_cmd_relay)

    probe_cmds = sub.add_parser("probe", help="known-answer probes of shards").add_subparsers(
        dest="probe_command", required=True, metavar="SUBCOMMAND"
    )
    p = probe_cmds.add_parser("reference", help="write reference answers from a trusted copy of a model")
    p.add_argument("--model", required=True, help="a GGUF file or a known model name")
    p.add_argument("--ranges", type=_ranges, required=True, help="layer ranges to cover, e.g. 0:15,15:30")
    p.add_argument("--seeds", type=_positive_int, default=16, help="reference inputs per range")
    p.add_argument("--batch", type=_positive_int, default=512, help="as the nodes run it (it is in the recipe)")
    p.add_argument("--flash-attn", choices=["on", "off"], default="off", help="as the nodes run it")
    p.add_argument("--threads", type=_positive_int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=_cmd_probe_reference)
    p = probe_cmds.add_parser("check", help="probe a running node (its /status URL) against references")
    p.add_argument("--node", type=_url, required=True, help="the node's HTTP address (what `up` prints as http)")
    p.add_argument("--references", type=Path, action="append", required=True)
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.set_defaults(func=_cmd_probe_check)

    bench = sub.add_parser("bench", help="signed benchmark contracts").add_subparsers(
        dest="bench_command", required=True, metavar="SUBCOMMAND"
    )
    p = bench.add_parser("verify", help="check a contract's signature and thresholds (exit 1 if any fails)")
    p.add_argument("file", type=Path, help="a contract JSON file written by a benchmark")
    p.add_argument("--key", type=_public_key, help="the signer must be this public key (hex or file)")
    p.add_argument(
        "--rerun", action="store_true", help="also run the benchmark again (into FILE.rerun.json) and compare"
    )
    p.set_defaults(func=_cmd_bench_verify)

    p = sub.add_parser("demo", help="the whole local system, asked one question through the OpenAI client")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--max-tokens", type=_positive_int, default=64)
    p.set_defaults(func=_cmd_demo)
    return parser


# Prompt activations and request bodies are buffers of hundreds of KiB. After freeing one,
# glibc raises its mmap threshold, so later ones come from the heap and stay there once
# freed: a head fed long prompts into a stalled peer rose in steps from 227 to 237 MiB
# over 96 requests (benchmarks/results/faults-before-fixed-threshold.json) and swung
# around 227 MiB with no trend at a fixed 128 KiB. An operator's MALLOC_MMAP_THRESHOLD_ wins.
MMAP_THRESHOLD = 128 << 10
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h


def _fix_mmap_threshold() -> None:
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    try:
        if platform.libc_ver()[0] == "glibc":
            ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass  # an unusual libc: its own default stands


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``noderuntime`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _fix_mmap_threshold()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        for chatty in ("noderuntime.llama_cpp", "httpx", "httpx2", "hpack", "hypercorn"):
            logging.getLogger(chatty).setLevel(logging.WARNING)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except _INPUT_ERRORS as exc:
        return _report(exc, args.verbose)
    except BaseExceptionGroup as group:
        # a server that refuses its input while starting raises from inside its nursery
        matched, rest = group.split(_INPUT_ERRORS)
        if matched is None or rest is not None:
            raise
        for leaf in _leaves(matched):
            _report(leaf, args.verbose)
        return 1


# What bad input raises (OSError: a path given on the command line that cannot be read or
# written; EngineError: a model llama.cpp cannot load; ProcessError: a child that did not
# start): one error line each, exit status 1; the traceback only in the --verbose log. Not
# RuntimeError as such, so that a defect still shows its traceback.
_INPUT_ERRORS = (
    CliError,
    artifacts.ArtifactError,
    models.ModelError,
    EngineError,
    ProcessError,
    ValueError,
    OSError,
)


def _report(exc: BaseException, verbose: bool) -> int:
    if verbose:
        logging.getLogger(__name__).debug("the error in full", exc_info=exc)
    print(f"noderuntime: error: {exc}", file=sys.stderr)
    return 1


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    return [
        leaf for exc in group.exceptions for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]


if __name__ == "__main__":
    sys.exit(main())
