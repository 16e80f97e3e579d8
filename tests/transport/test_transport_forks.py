"""Fork hooks go with their transport: one hook per process, transports enter and leave.

A transport registers with :mod:`tandem.transport.forks` (a forked child closes its
copies of the connections); closing the transport removes it, so re-initialising
many times in one process leaves no hook or transport behind.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from typing import Any

import pytest

from tandem.store.hash import HashStore
from tandem.transport import forks
from tandem.transport.tcp import TcpTransport

pytestmark = pytest.mark.timeout(60)


def _pair() -> list[Any]:
    store = HashStore()
    made: list[Any] = [None, None]

    def build(rank: int) -> None:
        made[rank] = TcpTransport(rank, 2, store, "127.0.0.1", b"forks", 30.0, 1 << 30, "h")

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return made


def test_closing_a_transport_removes_its_fork_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[Any] = []
    real = os.register_at_fork
    monkeypatch.setattr(os, "register_at_fork",
                        lambda **kw: (registered.append(kw), real(**kw))[1])
    before = forks.tracked()
    refs = []
    for _ in range(5):
        pair = _pair()
        assert forks.tracked() == before + 2
        for transport in pair:
            transport.close()
        assert forks.tracked() == before
        refs += [weakref.ref(t) for t in pair]
        del pair, transport
    gc.collect()
    assert len(registered) <= 1, "a hook per transport accumulates with every re-init"
    assert not [r for r in refs if r() is not None], "a closed transport is kept alive"
