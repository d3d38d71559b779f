"""Signed usage records of a small session, for tests and benchmarks that play a node's or an
auditor's part in the audits without running one."""

from __future__ import annotations

from typing import Any

from noderuntime.access.identity import Identity
from noderuntime.control.ledger import USAGE_DOMAIN, UsageBody
from noderuntime.tracker.messages import RecordJSON
from protocol import UsageRecord


def signed_usage(
    signer: Identity,
    *,
    layers: tuple[int, int],
    session: str,
    artifact: str,
    audit: bool = False,
    node_id: bytes | None = None,
    **commitments: Any,
) -> UsageRecord:
    """A record of ``layers`` in ``session`` (hex) of ``artifact``: 5 prompt tokens and 2 drawn, signed by
    ``signer`` in the name of ``node_id`` (its own by default: another's is a forgery the signature
    check refuses); ``commitments``: the record's digests (``input_rows``, ``input_digest``, ...)."""
    node = signer.node_id if node_id is None else node_id
    body = UsageBody(
        node_id=node.hex(),
        layers=layers,
        request_id="r",
        session_id=session,
        epoch=0,
        artifact=artifact,
        prefill_tokens=5,
        decode_tokens=2,
        compute_ms=1.0,
        bytes_in=0,
        bytes_out=0,
        started=0.0,
        ended=1.0,
        audit=audit,
        **commitments,
    ).encode()
    return UsageRecord(body, node, signer.sign(USAGE_DOMAIN, body))


def reported_usage(
    signer: Identity,
    *,
    layers: tuple[int, int],
    session: str,
    artifact: str,
    audit: bool,
    output: str,
    node_id: bytes | None = None,
) -> dict[str, Any]:
    """A record as an audit report carries it (JSON): it took in the rows every such record takes in
    and gave out ``output`` (a digest); signed as :func:`signed_usage` signs."""
    record = signed_usage(
        signer,
        layers=layers,
        session=session,
        artifact=artifact,
        audit=audit,
        node_id=node_id,
        input_rows=5,
        input_digest="11" * 32,
        output_rows=5,
        output_digest=output,
    )
    return RecordJSON.of(record).model_dump()
