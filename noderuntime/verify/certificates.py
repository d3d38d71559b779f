"""Mixed-route certificates, read back: which pair of recipes of one artifact may share a route.

``benchmarks.backends`` measures a route of a CPU shard, a GPU shard and a CPU shard
against the whole model on the CPU (:mod:`noderuntime.verify.mixed`) and signs the figures,
their thresholds and the pair of recipe fingerprints they cover. A tracker given such a
file builds routes that mix those two recipes, and no others; this module reads the file
without loading an engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from noderuntime.verify import contract
from noderuntime.verify.contract import ContractError

BENCHMARK = "benchmarks.backends"


@attrs.frozen
class CoveredPair:
    """What a mixed-route certificate covers: one artifact, a CPU recipe and a GPU recipe."""

    artifact: str
    cpu_recipe: str
    gpu_recipe: str

    @property
    def recipes(self) -> frozenset[str]:
        """Both recipe fingerprints."""
        return frozenset((self.cpu_recipe, self.gpu_recipe))


def covered_pair(document: Mapping[str, Any]) -> CoveredPair:
    """The pair of recipes a certificate covers (its ``"covers"``); ContractError when it names none.

    Read this only from a document whose signature checked out
    (:func:`noderuntime.verify.contract.verify_signature`): ``covers`` is signed with the figures.
    """
    if document.get("benchmark") != BENCHMARK:
        raise ContractError(f"not a mixed-route certificate: written by {document.get('benchmark')!r:.60}")
    covers = document.get("covers")
    fields = ("artifact", "cpu_recipe", "gpu_recipe")
    if not isinstance(covers, Mapping) or not all(isinstance(covers.get(f), str) for f in fields):
        raise ContractError(f"a mixed-route certificate names its {', '.join(fields)} under 'covers'")
    return CoveredPair(covers["artifact"], covers["cpu_recipe"], covers["gpu_recipe"])


def load_certificate(path: str | os.PathLike[str]) -> CoveredPair:
    """The pair a certificate file covers, once its signature verifies and every threshold holds.

    What a tracker mixes on: :class:`ContractError`, naming the file, for anything less.
    """
    where = os.fspath(path)
    document = contract.load(path)
    try:
        contract.verify_signature(document)
        pair = covered_pair(document)
    except ContractError as exc:
        raise ContractError(f"{where}: {exc}") from None
    missed = [result.threshold for result in contract.check(document) if not result.passed]
    if missed:
        claims = ", ".join(f"{t.id}: {t.left} {t.op} {t.right_side}" for t in missed)
        raise ContractError(f"{where}: its figures miss its own thresholds ({claims})")
    return pair


__all__ = ["BENCHMARK", "CoveredPair", "covered_pair", "load_certificate"]
