"""Fixtures shared by the torch-backend tests.

The rank processes (``tandem.testing.launch`` with ``init=False``) join torch.distributed
themselves, with the backend "tandem" and, as the oracle, gloo; ``_tb_util`` holds
what they share.
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
