"""Fixtures shared by the store tests: a per-test job secret and spawned children."""

from __future__ import annotations

import multiprocessing
import secrets
from typing import Any, Callable, Iterator

import pytest


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A fresh TANDEM_SECRET, so no test touches ~/.config; spawned children inherit it."""
    value = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_SECRET", value)
    return value.encode()


Spawn = Callable[..., multiprocessing.process.BaseProcess]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``spawn(target, *args)`` starts a spawned process; every one is killed at teardown."""
    ctx = multiprocessing.get_context("spawn")
    procs: list[multiprocessing.process.BaseProcess] = []

    def start(target: Callable[..., Any], *args: Any) -> multiprocessing.process.BaseProcess:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)


@pytest.fixture
def mp_queue() -> Any:
    return multiprocessing.get_context("spawn").Queue()
