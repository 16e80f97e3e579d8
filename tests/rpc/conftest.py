"""Fixtures of the RPC tests: a fresh job secret (so nothing touches ~/.config)."""

from __future__ import annotations

import secrets

import pytest


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    value = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_SECRET", value)
    return value.encode()
