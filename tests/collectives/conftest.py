"""Fixtures shared by the collectives tests.

Thread tests (``tandem.testing.run_threads``) run ranks as threads over the loopback
transport: milliseconds each. Process tests (``tandem.testing.spawn``) are few and
batched: one spawn runs many operations and returns their results for several tests.
Helpers live in ``_coll_util`` (inputs, answers, comparisons) and ``_coll_ranks``
(bodies of spawned ranks, importable by the children).
"""

from __future__ import annotations

import secrets
from typing import Any, Iterator

import pytest


@pytest.fixture(autouse=True)
def job_secret(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A fresh TANDEM_SECRET, so no test touches ~/.config; subprocesses inherit it."""
    value = secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_SECRET", value)
    return value.encode()


@pytest.fixture
def solo(job_secret: bytes) -> Iterator[None]:
    """A one-rank job in this process (rank 0 of 1 on tcp, through a HashStore)."""
    import tandem

    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if tandem.is_initialized():
            tandem.destroy_process_group()


@pytest.fixture
def lonely() -> Any:
    """Rank 1 of a 3-rank loopback group whose other ranks never run, with a 1 s deadline.

    A call whose argument check were missing would start communicating and end in a
    timeout, instead of the ``ArgumentError`` a bad-input test expects.
    """
    from tandem.collectives.group import ProcessGroup
    from tandem.config import Settings
    from tandem.transport.loopback import LoopbackHub

    from _coll_util import LONELY_SIZE

    hub = LoopbackHub(LONELY_SIZE)
    return ProcessGroup(hub.transports[1], list(range(LONELY_SIZE)), 0, "lonely", 1.0,
                        Settings(), "loopback")
