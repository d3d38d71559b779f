"""Grammars for structured output: compiling GBNF with llama.cpp, and the GBNF of a JSON schema.

A tail's sampler chain masks its logits with a grammar (``engine.llama.sampling``); the
gateway checks a request's grammar here before it sends it down a route.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from noderuntime.engine.base import GrammarError
from noderuntime.engine.llama.binding import grammar_converter, llama_cpp

if TYPE_CHECKING:
    from noderuntime.engine.llama.vocab import Vocab

__all__ = ["check_grammar", "grammar_sampler", "integer_range_gbnf", "json_schema_grammar"]


def grammar_sampler(vocab: Any, grammar: str) -> Any:
    """llama.cpp's grammar sampler, or :class:`GrammarError` (llama.cpp returns NULL on a bad grammar)."""
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:
        raise GrammarError("the grammar does not compile (GBNF with a 'root' rule expected)")
    return sampler


def check_grammar(vocab: Vocab, grammar: str) -> None:
    """Raise :class:`GrammarError` unless ``grammar`` compiles against ``vocab``: what a tail would build."""
    llama_cpp.llama_sampler_free(grammar_sampler(vocab.handle, grammar))


def json_schema_grammar(schema: Any) -> str:
    """The GBNF that accepts exactly the JSON documents ``schema`` allows (``None``: any JSON object).

    llama-cpp-python's converter is pure Python; the binding hands it over, because importing
    it loads the llama_cpp package, which only the binding does.
    """
    llama_grammar = grammar_converter()

    if schema is None:
        return str(llama_grammar.JSON_GBNF)

    base: Any = llama_grammar.SchemaConverter  # untyped upstream

    class Converter(base):  # type: ignore[misc]
        """The converter, with integer bounds, which it leaves unchecked."""

        def _add_primitive(self, name: str, rule: Any) -> Any:
            # upstream's string character admits raw control characters, which JSON forbids
            # (RFC 8259, 7): a model that wrote a newline inside a string broke the client's parser
            if name == "char":
                rule = llama_grammar.BuiltinRule(_JSON_CHAR, [])
            return super()._add_primitive(name, rule)

        def visit(self, schema: Any, name: str) -> Any:
            bounds = _integer_bounds(schema) if isinstance(schema, dict) else None
            if bounds is None:
                return super().visit(schema, name)
            rule = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
            return self._add_rule(rule, integer_range_gbnf(*bounds) + " space")

    try:
        converter: Any = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "stdin"), "")
        return str(converter.format_grammar())
    except (ValueError, TypeError, KeyError, AssertionError, RecursionError, NotImplementedError) as exc:
        # the converter asserts and raises on schemas it does not handle: all are the client's
        raise GrammarError(f"the JSON schema cannot be turned into a grammar: {type(exc).__name__}: {exc}") from None


_JSON_CHAR = r'[^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
_INT_DIGITS = 16  # the converter's own bound on an integer's digits


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None] | None:
    """(lowest, highest) an integer schema allows, when it bounds it; else None."""
    if schema.get("type") != "integer" or any(k in schema for k in ("enum", "const", "$ref", "anyOf", "oneOf")):
        return None
    low, high = schema.get("minimum"), schema.get("maximum")
    ex_low, ex_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if isinstance(ex_low, bool) or isinstance(ex_high, bool):  # draft 4: flags beside the bounds
        low = low + 1 if ex_low is True and low is not None else low
        high = high - 1 if ex_high is True and high is not None else high
        ex_low = ex_high = None
    bounds = [low, high, ex_low, ex_high]
    if all(b is None for b in bounds):
        return None
    if any(b is not None and (isinstance(b, bool) or not isinstance(b, int | float)) for b in bounds):
        raise ValueError("integer bounds must be numbers")
    lows = [math.ceil(low)] if low is not None else []
    lows += [math.floor(ex_low) + 1] if ex_low is not None else []
    highs = [math.floor(high)] if high is not None else []
    highs += [math.ceil(ex_high) - 1] if ex_high is not None else []
    lo, hi = (max(lows) if lows else None), (min(highs) if highs else None)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"no integer lies between {lo} and {hi}")
    return lo, hi


def integer_range_gbnf(lo: int | None, hi: int | None) -> str:
    """A GBNF expression for the decimal integers in [lo, hi] (None: unbounded), no leading zeros."""
    limit = 10**_INT_DIGITS - 1
    lo = -limit if lo is None else max(lo, -limit)
    hi = limit if hi is None else min(hi, limit)
    parts = []
    if lo < 0:  # the negative ones: "-" and a positive range
        parts.append('"-" ' + _natural_range(max(1, -hi), -lo))
    if hi >= 0:
        parts.append(_natural_range(max(0, lo), hi))
    return parts[0] if len(parts) == 1 else "(" + " | ".join(parts) + ")"


def _natural_range(lo: int, hi: int) -> str:
    """Decimal strings of the integers in [lo, hi], 0 <= lo <= hi."""
    options = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        first = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        last = min(hi, 10**digits - 1)
        if first <= last:
            options.append(_same_length(str(first), str(last)))
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _same_length(a: str, b: str) -> str:
    """Decimal strings between a and b, which have as many digits."""
    if not a:
        return ""
    if a[0] == b[0]:
        rest = _same_length(a[1:], b[1:])
        return f'"{a[0]}"' + (" " + rest if rest else "")
    n = len(a) - 1
    any_rest = " [0-9]" * n
    if a[1:] == "0" * n and b[1:] == "9" * n:
        return f"[{a[0]}-{b[0]}]" + any_rest
    options = [f'"{a[0]}"' + (" " + _same_length(a[1:], "9" * n) if n else "")]
    if int(a[0]) + 1 <= int(b[0]) - 1:
        options.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + any_rest)
    options.append(f'"{b[0]}"' + (" " + _same_length("0" * n, b[1:]) if n else ""))
    return "(" + " | ".join(options) + ")"
