"""Fixtures shared by the shm tests."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A fresh TANDEM_SECRET, so no test touches ~/.config; subprocesses inherit it."""
    value = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_SECRET", value)
    return value.encode()
