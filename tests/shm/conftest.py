"""Fixtures shared by the shm tests."""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A fresh TANDEM_SECRET, so no test touches ~/.config; subprocesses inherit it."""
    value = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_SECRET", value)
    return value.encode()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (needs root); unmounted afterwards."""
    where = tmp_path / "tiny"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield where
    subprocess.run(["umount", str(where)], check=False)
