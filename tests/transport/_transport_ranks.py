"""Rank bodies of the transport tests (module level, so spawned children can import them).

``make(kind, rank, world, store)`` builds one transport of each kind under test:
``tcp``, ``shm`` (1 MiB rings, so 10 MB messages wrap around many times),
``shm-devshm`` (segments as named files in /dev/shm, the fallback path) and
``mixed`` (3 ranks on two simulated hosts: 0 and 1 share one, 2 is alone).
"""

from __future__ import annotations

import time
from typing import Any

from _conformance import check_peer_closed, run_all
from tandem.store.base import Store
from tandem.store.file import FileStore
from tandem.store.prefix import PrefixStore
from tandem.transport.base import Transport
from tandem.transport.mixed import MixedTransport
from tandem.transport.shm import ShmTransport
from tandem.transport.tcp import TcpTransport

SECRET = b"conformance-secret"
WORLD = {"tcp": 2, "shm": 2, "shm-devshm": 2, "mixed": 3}
PAIRS = {2: [(0, 1)], 3: [(0, 1), (0, 2), (1, 2)]}


def make(kind: str, rank: int, world: int, store: Store) -> Transport:
    if kind == "tcp":
        return TcpTransport(rank, world, store, "127.0.0.1", SECRET, 30.0, 1 << 34, "h")
    if kind == "shm":
        return ShmTransport(rank, world, store, SECRET, ring_bytes=1 << 20, hostname="h")
    if kind == "shm-devshm":
        return ShmTransport(rank, world, store, SECRET, ring_bytes=1 << 20, shm_dir="/dev/shm")
    if kind == "mixed":
        host = "a" if rank < 2 else "b"
        tcp = TcpTransport(rank, world, store, "127.0.0.1", SECRET, 30.0, 1 << 34, host)
        local = [0, 1] if rank < 2 else [2]
        shm = ShmTransport(rank, world, PrefixStore("shm", store), SECRET, peers=local,
                           ring_bytes=1 << 20, hostname=host, mailbox=tcp.mailbox)
        return MixedTransport(tcp, shm)
    raise ValueError(kind)


def _barrier(store: Store, world: int, name: str) -> None:
    store.add(name, 1)
    deadline = time.monotonic() + 60
    while int(store.get(name)) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}")
        time.sleep(0.01)


def conformance(rank: int, world: int, kind: str, tmp: str) -> dict[str, Any]:
    store = FileStore(f"{tmp}/store", world, timeout=60)
    t = make(kind, rank, world, store)
    rounds = iter(range(1000))
    records = run_all(t, PAIRS[world], lambda: _barrier(store, world, f"b{next(rounds)}"))
    records["transport"] = type(t).__name__
    # last: rank 1 closes, rank 0 must learn that it lost rank 1
    if rank in (0, 1):
        records["closed"] = check_peer_closed(t, rank, 1 - rank, closer=(rank == 1))
    if rank != 1:
        _barrier(store, world, "end")
        t.close()
    else:
        _barrier(store, world, "end")
    return records
