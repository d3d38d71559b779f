"""Reading JSON that a peer wrote: tickets, relay control messages, signed records.

``json.loads`` raises ``RecursionError`` on deeply nested input and turns ``1e999`` into
``inf``, on which ``int()`` raises ``OverflowError``; neither is a ``ValueError``, so a
caller that catches only that lets a few bytes from anyone end its task (or, unhandled,
its process). Everything here raises :class:`ValueError` and nothing else.
"""

from __future__ import annotations

import json
from typing import Any


def json_object(text: str | bytes, what: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; :class:`ValueError` naming ``what`` otherwise."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise ValueError(f"{what} is not JSON (or is nested too deeply)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} is not a JSON object")
    return data


def integer(value: Any, what: str, *, low: int = 0, high: int = (1 << 63) - 1) -> int:
    """``value`` if it is a JSON integer in ``[low, high]``; :class:`ValueError` otherwise."""
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], not {value!r:.40}")
    return value
