"""Argument types and checks shared by the command groups: bad input is a clear error."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

from noderuntime.models import artifacts
from noderuntime.models import catalogue as models
from protocol import Limits


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 1."""


def api_key(text: str) -> str:
    # an empty key (an unset variable, say) would let in every request that sends none
    if not text.strip() or text != text.strip():
        raise argparse.ArgumentTypeError("an API key must be non-empty, without spaces around it")
    return text


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def window(text: str) -> int:
    """Drafted tokens a speculative decode window may carry: 0 (none) to the protocol's bound."""
    value = non_negative_int(text)
    if value > (bound := Limits().max_window):
        raise argparse.ArgumentTypeError(f"a window carries at most {bound} drafted tokens, not {value}")
    return value


def windows_ahead(text: str) -> int:
    """Decode windows that may follow one in flight: 0 (one at a time) to the protocol's bound."""
    value = non_negative_int(text)
    if value > (bound := Limits().max_ahead):
        raise argparse.ArgumentTypeError(f"at most {bound} windows may follow one in flight, not {value}")
    return value


def _positive_finite(text: str, unit: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number {unit}, got {text!r}") from None
    if not 0 < value < math.inf:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive, finite number {unit}, got {text}")
    return value


def seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    return _positive_finite(text, "of seconds")


def heartbeat_seconds(text: str) -> float:
    """A heartbeat interval: 0.5 to 60 seconds (faster would spend the tracker on heartbeats)."""
    value = seconds(text)
    if not 0.5 <= value <= 60.0:
        raise argparse.ArgumentTypeError(f"a heartbeat interval is 0.5 to 60 seconds, not {text!r}")
    return value


def per_second(text: str) -> float:
    """A positive, finite rate, per second."""
    return _positive_finite(text, "per second")


def seconds_or_never(text: str) -> float:
    """A positive number of seconds, or 0 for never."""
    return 0.0 if text.strip() in ("0", "0.0") else seconds(text)


def share(text: str) -> float:
    """A share between 0 and 1 (``0.03``, ``3%``)."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a share: {text!r} (0.03 or 3%)") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share is between 0 and 1 (0% and 100%), not {text!r}")
    return value


def size(text: str) -> int:
    from noderuntime.engine.memplan import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cuts(text: str) -> list[int]:
    try:
        cuts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cuts must be comma-separated integers, got {text!r}") from None
    if len(cuts) < 2 or any(b <= a for a, b in itertools.pairwise(cuts)):
        raise argparse.ArgumentTypeError(f"cuts must be at least two increasing integers, got {text!r}")
    return cuts


def ranges(text: str) -> list[artifacts.LayerRange]:
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


def address(text: str, *, listen: bool = False) -> str:
    from noderuntime.transport.grpc import parse_address

    try:
        parse_address(text, listen=listen)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def listen_address(text: str) -> str:
    return address(text, listen=True)


def layers(text: str) -> artifacts.LayerRange:
    try:
        return artifacts.LayerRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def public_key(text: str) -> bytes:
    from noderuntime.access.identity import IdentityError, load_public_key

    try:
        return load_public_key(text)
    except IdentityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def relay_url(text: str) -> str:
    if not text.startswith(("ws://", "wss://")):
        raise argparse.ArgumentTypeError(f"a relay URL starts with ws:// or wss://, got {text!r}")
    return text


def default_data_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("noderuntime")) / "node"


def url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text.rstrip("/")
