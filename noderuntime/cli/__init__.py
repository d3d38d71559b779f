"""The ``noderuntime`` command line: one module per command group, parsing apart from running.

Each group module (:mod:`~noderuntime.cli.model_files`, :mod:`~noderuntime.cli.serve`,
:mod:`~noderuntime.cli.operations`) adds its commands to the parser and runs them;
:mod:`~noderuntime.cli.args` holds the argument types they share.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence

from noderuntime.cli import model_files, operations, serve
from noderuntime.cli.args import CliError
from noderuntime.engine.base import EngineError
from noderuntime.models import artifacts
from noderuntime.models import catalogue as models
from noderuntime.services.cluster import ProcessError


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="noderuntime", description="The ``noderuntime`` command line.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_files.add_commands(sub)
    serve.add_commands(sub)
    operations.add_commands(sub)
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
    # what the command was given, for a command that must run again in another environment
    # (a node on a GPU backend re-executes itself with that backend's build of llama.cpp)
    args.argv = list(sys.argv[1:] if argv is None else argv)
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
