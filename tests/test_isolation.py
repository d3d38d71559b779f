"""The skip that CI turns into a failure (tests/isolation.py)."""

from __future__ import annotations

import pytest

from .isolation import REQUIRE_VARIABLE, skip_unless_possible


def test_a_missing_namespace_skips_here_and_fails_where_required(monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_possible(None)  # possible: nothing happens
    monkeypatch.delenv(REQUIRE_VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no root"):
        skip_unless_possible("no root")
    monkeypatch.setenv(REQUIRE_VARIABLE, "1")
    with pytest.raises(pytest.fail.Exception, match="must run it"):
        skip_unless_possible("no root")
