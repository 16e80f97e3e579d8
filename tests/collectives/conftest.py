"""Fixtures shared by the collectives tests.

Thread tests (``tandem.testing.run_threads``) run ranks as threads over the loopback
transport: milliseconds each. Process tests (``tandem.testing.spawn``) are few and
batched: one spawn runs many operations and returns their results for several tests.
Helpers live in ``_coll_util`` (inputs, answers, comparisons) and ``_coll_ranks``
(bodies of spawned ranks, importable by the children).
"""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A fresh TANDEM_SECRET, so no test touches ~/.config; subprocesses inherit it."""
    value = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_SECRET", value)
    return value.encode()
