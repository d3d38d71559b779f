"""The usage ledger: one entry per request, with every shard's signed usage record.

The gateway verifies each record's signature (the node's key over the record body)
and that the record belongs to the request and the route; a record that fails is
kept, flagged with the reason, and never counted. SQLite, one connection per write
(writes happen in a worker thread, once per request).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from noderuntime.access import untrusted
from noderuntime.access.identity import verify
from protocol import Hop, UsageRecord

USAGE_DOMAIN = b"noderuntime-usage-v1"

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    artifact TEXT NOT NULL,
    created REAL NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    finish_reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS records (
    request_id TEXT NOT NULL REFERENCES requests(request_id),
    node_id TEXT NOT NULL,
    layer_start INTEGER,
    layer_end INTEGER,
    prefill_tokens INTEGER,
    decode_tokens INTEGER,
    compute_ms REAL,
    bytes_in INTEGER,
    bytes_out INTEGER,
    valid INTEGER NOT NULL,
    problem TEXT NOT NULL,
    body BLOB NOT NULL,
    signature BLOB NOT NULL,
    disputed TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS records_node ON records(node_id);
"""


@attrs.frozen
class UsageBody:
    """One shard's usage of one session: the JSON a node signs and a gateway's ledger reads."""

    node_id: str  # hex
    layers: tuple[int, int]
    request_id: str
    session_id: str  # hex
    epoch: int
    artifact: str  # hex fingerprint
    prefill_tokens: int
    decode_tokens: int
    compute_ms: float
    bytes_in: int
    bytes_out: int
    started: float  # unix seconds
    ended: float
    # the hop's commitments (control/commitments.py): digests of the rows (head: token ids)
    # it took in from position digest_from on, and of what it gave out from output_from on
    # (rows; the tail's: the tokens it drew). An audit session's record says so.
    audit: bool = False
    digest_from: int = 0
    input_rows: int = 0
    input_digest: str = ""
    output_from: int = 0
    output_rows: int = 0
    output_digest: str = ""

    def encode(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces): the bytes that are signed."""
        fields = attrs.asdict(self)
        fields["layers"] = list(self.layers)
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


# what the ledger sums: a signed record is still the node's word, so each must be a count
_COUNTS = ("prefill_tokens", "decode_tokens", "bytes_in", "bytes_out")


@attrs.frozen
class CheckedRecord:
    """A usage record and the verdict on it."""

    record: UsageRecord
    fields: dict[str, Any]
    valid: bool
    problem: str


def check(record: UsageRecord, *, request_id: str, hops: Sequence[Hop]) -> CheckedRecord:
    """Verify one record against its signature, the request and the route."""
    try:
        fields = untrusted.json_object(record.body, "body")
    except ValueError as exc:
        return CheckedRecord(record, {}, False, str(exc))
    if not verify(record.node_id, USAGE_DOMAIN, record.body, record.signature):
        return CheckedRecord(record, fields, False, "signature does not verify")
    if fields.get("node_id") != record.node_id.hex():
        return CheckedRecord(record, fields, False, "record names another node")
    if fields.get("request_id") != request_id:
        return CheckedRecord(record, fields, False, "record is for another request")
    layers = fields.get("layers")
    if not any(h.node_id == record.node_id and [h.layers.start, h.layers.end] == layers for h in hops):
        return CheckedRecord(record, fields, False, "node or layers not on the request's route")
    try:
        for key in _COUNTS:
            untrusted.integer(fields.get(key), key)
        compute_ms = fields.get("compute_ms")
        if isinstance(compute_ms, bool) or not isinstance(compute_ms, int | float) or not 0 <= compute_ms < math.inf:
            raise ValueError(f"compute_ms must be a finite non-negative number, not {compute_ms!r:.40}")
        for key in ("digest_from", "input_rows", "output_from", "output_rows"):
            if key in fields:
                untrusted.integer(fields[key], key)
        for key in ("input_digest", "output_digest"):
            digest = fields.get(key, "")
            if not isinstance(digest, str) or (digest and (len(digest) != 64 or digest.strip("0123456789abcdef"))):
                raise ValueError(f"{key} must be a hex digest, not {digest!r:.40}")
    except ValueError as exc:
        return CheckedRecord(record, {}, False, str(exc))
    return CheckedRecord(record, fields, True, "")


class LedgerError(ValueError):
    """The ledger file cannot be opened or made."""


class Ledger:
    """An SQLite ledger file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Open the ledger at ``path``, made with its tables if new; :class:`LedgerError` if it cannot be."""
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.closing(self._connect()) as db, db:
                db.executescript(SCHEMA)
                columns = {row[1] for row in db.execute("PRAGMA table_info(records)")}
                if "disputed" not in columns:  # a ledger from before audits
                    db.execute("ALTER TABLE records ADD COLUMN disputed TEXT NOT NULL DEFAULT ''")
        except (OSError, sqlite3.Error) as exc:  # a directory in the way, no permission, not an SQLite file
            raise LedgerError(f"cannot use the ledger {self.path}: {exc}") from None

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        return db

    def append(
        self,
        *,
        request_id: str,
        model: str,
        artifact: str,
        created: float,
        prompt_tokens: int,
        completion_tokens: int,
        finish_reason: str,
        records: Sequence[CheckedRecord],
    ) -> None:
        """Write one request and its records (one transaction)."""
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO requests VALUES (?, ?, ?, ?, ?, ?, ?)",
                (request_id, model, artifact, created, prompt_tokens, completion_tokens, finish_reason),
            )
            for c in records:
                f = c.fields if c.valid else {}
                layers = f.get("layers") or [None, None]
                db.execute(
                    "INSERT INTO records (request_id, node_id, layer_start, layer_end, prefill_tokens, decode_tokens, "
                    "compute_ms, bytes_in, bytes_out, valid, problem, body, signature) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        request_id,
                        c.record.node_id.hex(),
                        layers[0],
                        layers[1],
                        f.get("prefill_tokens"),
                        f.get("decode_tokens"),
                        f.get("compute_ms"),
                        f.get("bytes_in"),
                        f.get("bytes_out"),
                        int(c.valid),
                        c.problem,
                        c.record.body,
                        c.record.signature,
                    ),
                )

    def dispute(self, request_id: str, node_id: bytes, why: str) -> int:
        """Mark ``node_id``'s records of ``request_id`` disputed (an audit found them false); how many."""
        with self._connect() as db:
            cursor = db.execute(
                "UPDATE records SET disputed = ? WHERE request_id = ? AND node_id = ?",
                (why or "disputed", request_id, node_id.hex()),
            )
            return cursor.rowcount

    def totals(self) -> dict[str, Any]:
        """Per-node and per-model totals (valid, undisputed records only) and the flagged and disputed ones."""
        with self._connect() as db:
            nodes = db.execute(
                "SELECT node_id, COUNT(*), SUM(prefill_tokens), SUM(decode_tokens), SUM(compute_ms), "
                "SUM(bytes_in), SUM(bytes_out) FROM records WHERE valid = 1 AND disputed = '' "
                "GROUP BY node_id ORDER BY node_id"
            ).fetchall()
            models = db.execute(
                "SELECT model, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens) FROM requests "
                "GROUP BY model ORDER BY model"
            ).fetchall()
            flagged = db.execute(
                "SELECT request_id, node_id, problem FROM records WHERE valid = 0 ORDER BY rowid"
            ).fetchall()
            disputed = db.execute(
                "SELECT request_id, node_id, disputed FROM records WHERE disputed != '' ORDER BY rowid"
            ).fetchall()
        return {
            "nodes": [
                {
                    "node_id": n,
                    "sessions": c,
                    "prefill_tokens": p or 0,
                    "decode_tokens": d or 0,
                    "compute_ms": round(ms or 0.0, 3),
                    "bytes_in": bi or 0,
                    "bytes_out": bo or 0,
                }
                for n, c, p, d, ms, bi, bo in nodes
            ],
            "models": [
                {"model": m, "requests": c, "prompt_tokens": p or 0, "completion_tokens": t or 0}
                for m, c, p, t in models
            ],
            "flagged": [{"request_id": r, "node_id": n, "problem": p} for r, n, p in flagged],
            "disputed": [{"request_id": r, "node_id": n, "why": w} for r, n, w in disputed],
        }


def show(path: str, *, as_json: bool = False) -> int:
    """``noderuntime usage --ledger PATH``."""
    if not Path(path).exists():
        raise LedgerError(f"no ledger at {path}")
    totals = Ledger(path).totals()
    if as_json:
        print(json.dumps(totals, indent=2))
        return 0
    print(
        f"{'node':<18} {'sessions':>8} {'prefill':>9} {'decode':>9} {'compute ms':>11} {'bytes in':>11} "
        f"{'bytes out':>11}"
    )
    for n in totals["nodes"]:
        print(
            f"{n['node_id'][:16]:<18} {n['sessions']:>8} {n['prefill_tokens']:>9} {n['decode_tokens']:>9} "
            f"{n['compute_ms']:>11.1f} {n['bytes_in']:>11} {n['bytes_out']:>11}"
        )
    print(f"\n{'model':<24} {'requests':>8} {'prompt':>9} {'completion':>11}")
    for m in totals["models"]:
        print(f"{m['model']:<24} {m['requests']:>8} {m['prompt_tokens']:>9} {m['completion_tokens']:>11}")
    if totals["flagged"]:
        print(f"\n{len(totals['flagged'])} record(s) flagged and not counted:")
        for f in totals["flagged"]:
            print(f"  request {f['request_id']} node {f['node_id'][:16]}: {f['problem']}")
    if totals["disputed"]:
        print(f"\n{len(totals['disputed'])} record(s) disputed by audits and not counted:")
        for d in totals["disputed"]:
            print(f"  request {d['request_id']} node {d['node_id'][:16]}: {d['why']}")
    return 0
