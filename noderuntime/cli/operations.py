"""Commands an operator runs against a running system: ``usage``, ``status``, ``probe``, ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from noderuntime.cli.args import (
    CliError,
    api_key,
    default_data_dir,
    positive_int,
    public_key,
    ranges,
    resolve_model,
    url,
)


def _cmd_usage(args: argparse.Namespace) -> int:
    from noderuntime.control.ledger import show

    return show(args.ledger, as_json=args.json)


def _cmd_probe_reference(args: argparse.Namespace) -> int:
    from noderuntime.control import admission
    from noderuntime.engine.llama import flash_attn_choice

    entries = admission.make_references(
        resolve_model(args.model),
        [(r.start, r.end) for r in args.ranges],
        seeds=args.seeds,
        recipe_options={
            "n_threads": args.threads,
            "n_batch": args.batch,
            "n_ubatch": args.batch,
            "flash_attn": flash_attn_choice(args.flash_attn),
        },
    )
    args.out.write_text(json.dumps({"references": entries}, indent=1) + "\n")
    print(f"{len(entries)} reference answers for {len(args.ranges)} range(s) written to {args.out}")
    return 0


def _cmd_probe_check(args: argparse.Namespace) -> int:
    import random
    import urllib.request

    from noderuntime.control import admission

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
    from noderuntime.tracker.status import show

    # each tracker's view is its own (what its nodes told it): the first that answers, as a gateway asks
    for tracker in args.tracker:
        if show(tracker, as_json=args.json, status_key=args.status_key) == 0:
            return 0
    return 1


def _cmd_bench_verify(args: argparse.Namespace) -> int:
    from noderuntime.verify import contract

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


def _cmd_demo(args: argparse.Namespace) -> int:
    from noderuntime.services.demo import run

    return run(args.prompt, args.max_tokens)


def add_commands(sub: Any) -> None:
    """Add this group's commands to the ``noderuntime`` parser's subcommands."""
    p = sub.add_parser("usage", help="per-node and per-model totals from a gateway's usage ledger")
    p.add_argument("--ledger", default=str(default_data_dir().with_name("gateway") / "ledger.sqlite"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_usage)

    p = sub.add_parser("status", help="nodes, ranges, load and routes known to a tracker")
    p.add_argument(
        "--tracker",
        type=url,
        action="append",
        required=True,
        help="the tracker to read; repeatable: the first that answers is shown (each says why it did not)",
    )
    p.add_argument("--status-key", type=api_key, help="the tracker's status key, if it has one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_status)

    probe_cmds = sub.add_parser("probe", help="known-answer probes of shards").add_subparsers(
        dest="probe_command", required=True, metavar="SUBCOMMAND"
    )
    p = probe_cmds.add_parser("reference", help="write reference answers from a trusted copy of a model")
    p.add_argument("--model", required=True, help="a GGUF file or a known model name")
    p.add_argument("--ranges", type=ranges, required=True, help="layer ranges to cover, e.g. 0:15,15:30")
    p.add_argument("--seeds", type=positive_int, default=16, help="reference inputs per range")
    p.add_argument("--batch", type=positive_int, default=512, help="as the nodes run it (it is in the recipe)")
    p.add_argument("--flash-attn", choices=["on", "off", "auto"], default="auto", help="as the nodes run it")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(func=_cmd_probe_reference)
    p = probe_cmds.add_parser("check", help="probe a running node (its /status URL) against references")
    p.add_argument("--node", type=url, required=True, help="the node's HTTP address (what `up` prints as http)")
    p.add_argument("--references", type=Path, action="append", required=True)
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.set_defaults(func=_cmd_probe_check)

    bench = sub.add_parser("bench", help="signed benchmark contracts").add_subparsers(
        dest="bench_command", required=True, metavar="SUBCOMMAND"
    )
    p = bench.add_parser("verify", help="check a contract's signature and thresholds (exit 1 if any fails)")
    p.add_argument("file", type=Path, help="a contract JSON file written by a benchmark")
    p.add_argument("--key", type=public_key, help="the signer must be this public key (hex or file)")
    p.add_argument(
        "--rerun", action="store_true", help="also run the benchmark again (into FILE.rerun.json) and compare"
    )
    p.set_defaults(func=_cmd_bench_verify)

    p = sub.add_parser("demo", help="the whole local system, asked one question through the OpenAI client")
    p.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.set_defaults(func=_cmd_demo)
