"""Commands on model files: ``shard``, ``models``, ``check``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from noderuntime.cli.args import (
    CliError,
    cuts,
    default_data_dir,
    layers,
    positive_int,
    public_key,
    ranges,
    resolve_model,
)
from noderuntime.models import artifacts, fetch
from noderuntime.models import catalogue as models


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
    if not fetch.is_url(args.name):
        if args.layers is not None or args.manifest is not None:
            raise CliError("--layers and --manifest go with a URL; a known model is pulled whole (then `shard split`)")
        print(models.pull(args.name, progress=not args.quiet))
        return 0
    if args.layers is None:
        raise CliError("a pull by URL fetches one layer range of the model: give it with --layers A:B")
    if args.manifest is None:
        raise CliError(fetch.NO_MANIFEST)
    pulled = fetch.pull_layers(
        args.name,
        args.layers,
        args.manifest,
        args.out or models.models_dir(),
        publisher=args.publisher_key,
        trust_source=args.trust_tracker_manifests,
        progress=not args.quiet,
    )
    how = "already fetched and verified" if pulled.reused else f"fetched {pulled.fetched_bytes / 1e6:.1f} MB"
    print(
        f"{pulled.path}  layers {pulled.layers}  {pulled.path.stat().st_size / 1e6:.1f} MB ({how})  "
        f"artifact {pulled.artifact[:16]}  manifest signed by {pulled.publisher}"
    )
    return 0


def _cmd_models_manifest(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from noderuntime.models import manifest

    publisher = manifest.load_key(args.key or default_data_dir().with_name("publisher") / "publisher.key")
    model = resolve_model(args.file)
    with tqdm(unit="B", unit_scale=True, desc=f"hash {model.name}", disable=args.quiet) as bar:
        made = manifest.make(model, publisher, progress=bar.update)
    Path(args.out).write_text(made.dumps())
    print(
        f"{args.out}  artifact {made.artifact}  {len(made.tensors)} tensors in {len(made.parts)} file(s)  "
        f"signed by {made.publisher}"
    )
    return 0


def _cmd_models_list(_args: argparse.Namespace) -> int:
    for name, model in sorted(models.KNOWN_MODELS.items()):
        path = models.path_of(name)
        state = "pulled" if path.exists() else "not pulled"
        print(f"{name:<16} {model.filename:<40} {model.size / 1e6:8.1f} MB  {model.license:<12} {state}")
    return 0


def _cmd_models_lanes(args: argparse.Namespace) -> int:
    from noderuntime.verify import lanes

    built = lanes.build(resolve_model(args.model), say=lambda text: print(text, file=sys.stderr))
    for name, lane in built.items():
        print(f"{name:<12} {lane.backend:<13} {lane.precision:<7} {lane.size_bytes() / 2**20:8.1f} MiB  {lane.path}")
    return 0


def _cmd_models_synth(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from noderuntime.models import synth

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
    from noderuntime.engine.llama import Recipe, flash_attn_choice
    from noderuntime.verify.parity import check_parity
    from noderuntime.verify.procchain import ChainError

    model = resolve_model(args.model)
    try:
        recipe = Recipe(
            n_threads=args.threads, n_ctx_per_seq=512, n_seq_max=2, flash_attn=flash_attn_choice(args.flash_attn)
        )
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


def add_commands(sub: Any) -> None:
    """Add this group's commands to the ``noderuntime`` parser's subcommands."""
    shard = sub.add_parser("shard", help="inspect and slice GGUF model files").add_subparsers(
        dest="shard_command", required=True, metavar="SUBCOMMAND"
    )
    p = shard.add_parser("inspect", help="print a model file's fingerprint and shape")
    p.add_argument("file", help="a GGUF file or a known model name")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_shard_inspect)
    p = shard.add_parser("split", help="write one GGUF file per layer range")
    p.add_argument("model", help="a GGUF file or a known model name")
    p.add_argument("--ranges", type=ranges, required=True, help="e.g. 0:10,10:20,20:30")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_shard_split)

    model_cmds = sub.add_parser("models", help="fetch and make models").add_subparsers(
        dest="models_command", required=True, metavar="SUBCOMMAND"
    )
    p = model_cmds.add_parser(
        "pull", help="fetch a known model into the user cache, or one layer range of a model at a URL"
    )
    p.add_argument(
        "name",
        nargs="?",
        default=models.DEMO_MODEL,
        help=f"a known model (default {models.DEMO_MODEL}), or the URL of a GGUF file or of its first gguf-split part",
    )
    p.add_argument("--layers", type=layers, help="with a URL: the layer range A:B to fetch, as a shard file")
    p.add_argument(
        "--manifest",
        help="with a URL: the model's signed manifest, as a file, a URL, or the URL of a tracker that serves it",
    )
    p.add_argument(
        "--publisher-key", type=public_key, help="accept only a manifest signed by this key (hex or a file with it)"
    )
    p.add_argument(
        "--trust-tracker-manifests",
        action="store_true",
        help="without --publisher-key: accept a manifest signed by any key, on the word of its --manifest source",
    )
    p.add_argument("--out", type=Path, help="with a URL: the folder of the shard file (default: the model cache)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=_cmd_models_pull)
    p = model_cmds.add_parser(
        "manifest", help="write a model's signed manifest: what nodes check the layers they fetch against"
    )
    p.add_argument("file", help="a GGUF file, the first of its gguf-split parts, or a known model name")
    p.add_argument(
        "--key",
        type=Path,
        help="the publisher's Ed25519 key (PEM), made there if missing (default: publisher.key in the user data dir)",
    )
    p.add_argument("--out", required=True, help="the manifest file to write (JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_models_manifest)
    p = model_cmds.add_parser("list", help="known models")
    p.set_defaults(func=_cmd_models_list)
    p = model_cmds.add_parser(
        "lanes", help="make (once) the Gate A lanes of a model: GGUF F32/F16/Q8_0/Q4_K_M and F32/BF16 safetensors"
    )
    p.add_argument("model", nargs="?", default=models.DEMO_MODEL, help="a GGUF file or known model name")
    p.set_defaults(func=_cmd_models_lanes)
    p = model_cmds.add_parser("synth", help="write a random-weight model of any size")
    p.add_argument("--arch", default="llama", help="llama, qwen3 or qwen3moe")
    p.add_argument("--layers", type=positive_int, required=True)
    p.add_argument("--embd", type=positive_int, required=True)
    p.add_argument("--ff", type=positive_int, required=True)
    p.add_argument("--heads", type=positive_int, required=True)
    p.add_argument("--kv-heads", type=positive_int, required=True)
    p.add_argument("--vocab", type=positive_int, required=True)
    p.add_argument("--head-dim", type=positive_int, default=0, help="size of one head (default: embd / heads)")
    p.add_argument("--experts", type=positive_int, default=0, help="experts per layer (qwen3moe)")
    p.add_argument("--experts-used", type=positive_int, default=0, help="experts each token uses (qwen3moe)")
    p.add_argument("--expert-ff", type=positive_int, default=0, help="feed-forward length of one expert (qwen3moe)")
    p.add_argument("--untied-output", action="store_true", help="an output head of its own, not the embedding")
    p.add_argument("--context", type=positive_int, default=4096)
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
    p.add_argument("--cuts", type=cuts, required=True, help="e.g. 0,10,20,30")
    p.add_argument("--tokens", type=positive_int, default=32, help="greedy decode steps")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument(
        "--flash-attn", choices=["on", "off", "auto"], default="auto", help="auto: on, as nodes run on the CPU"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_check_parity)
