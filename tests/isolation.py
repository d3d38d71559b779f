"""Skips for tests that need root, network namespaces or cgroups, which CI turns into failures.

On a machine that can run them (CI's runs as root), a silent skip would hide a gate that
no longer runs: ``.ci/run`` sets ``NODERUNTIME_REQUIRE_ISOLATION=1``, and then a test that
cannot make its namespaces or cgroups fails, saying why.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_VARIABLE = "NODERUNTIME_REQUIRE_ISOLATION"


def skip_unless_possible(reason: str | None) -> None:
    """Skip the test for ``reason`` (None: it can run), or fail it where isolation is required."""
    if reason is None:
        return
    if os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{reason}; {REQUIRE_VARIABLE}=1 says this machine must run it")
    pytest.skip(reason)
