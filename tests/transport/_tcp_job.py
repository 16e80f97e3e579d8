"""Connected tcp transports in one process, for the in-process tcp tests: each rank is
built on a thread of its own (set-up waits for peers), on one fresh store."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from tandem.store.base import Store
from tandem.store.hash import HashStore
from tandem.transport import Slot
from tandem.transport.tcp import TcpTransport

SECRET = b"s" * 32
DEADLINE = 60.0  # generous: the machine is shared


def built_at_once(world: int, make: Callable[[int], Any]) -> list[Any]:
    """``[make(0), ..., make(world - 1)]``, each called on a thread of its own, at once
    (set-up waits for peers), within ``DEADLINE``."""
    made: list[Any] = [None] * world

    def build(rank: int) -> None:
        made[rank] = make(rank)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    return made


def tcp_job(hostnames: list[str]) -> list[TcpTransport]:
    """One transport per entry of ``hostnames`` (that rank's host name)."""
    store = HashStore()
    made = built_at_once(len(hostnames), lambda rank: TcpTransport(
        rank, len(hostnames), store, "127.0.0.1", SECRET, 30.0, 1 << 34, hostnames[rank],
        lazy=True))
    assert all(isinstance(m, TcpTransport) for m in made), made
    return made


def two_hosts_rank(store: Store, rank: int, secret: bytes) -> Any:
    """Rank ``rank`` of a 4-rank job on two simulated hosts (0, 1 on host a; 2, 3 on b;
    threads of this process, told apart by host name), built by the ``auto`` backend."""
    from tandem.collectives.backend import Backend, BackendOptions
    from tandem.config import load_settings
    from tandem.store import PrefixStore

    options = BackendOptions(store=PrefixStore("job", store), rank=rank, world_size=4,
                             host="127.0.0.1", hostname="ab"[rank // 2], secret=secret,
                             settings=load_settings())
    return Backend.factory("auto")(options)


def wait_ok(slots: list[Slot]) -> None:
    """Wait for every slot (within ``DEADLINE`` in all); each must succeed."""
    end = time.monotonic() + DEADLINE
    for s in slots:
        assert s.event.wait(max(0.0, end - time.monotonic())), f"not done: {s.key}"
        assert s.error is None, s.error
