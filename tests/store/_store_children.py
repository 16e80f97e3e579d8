"""Bodies of the spawned processes in the store tests (importable by the children)."""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path
from typing import Any


def _stores() -> Any:
    """``tandem.store``, imported in a child without running ``tandem/__init__``.

    The store is the bottom layer and needs nothing from torch, but the top-level
    package imports torch: 2-5s per child on a busy two-core machine. Only children
    call this; the test process itself imports tandem normally.
    """
    if "tandem" not in sys.modules:
        bare = types.ModuleType("tandem")
        bare.__path__ = [str(Path(__file__).resolve().parents[2] / "tandem")]
        sys.modules["tandem"] = bare
    import tandem.store

    return tandem.store


def tcp_worker(port: int) -> None:
    """Join a TCPStore served by the parent, answer its key and count in."""
    with _stores().TCPStore("127.0.0.1", port, timeout=5) as store:
        store.set("child", b"from child")
        assert store.get("parent") == b"from parent"
        store.add("done", 1)


def tcp_joining_worker(port: int) -> None:
    """Count in to a master that waits for world_size=2 workers."""
    with _stores().TCPStore("127.0.0.1", port, world_size=2, timeout=8) as store:
        store.set("child-joined", b"1")


def tcp_master(port_queue: Any) -> None:
    """Serve a TCPStore, report its port, then idle until killed."""
    store = _stores().TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    port_queue.put(store.port)
    time.sleep(60)


def tcp_master_left_open(client_count: int) -> None:
    """Leave a master and its clients open: daemon threads must not keep the process alive."""
    TCPStore = _stores().TCPStore
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
    clients = [TCPStore("127.0.0.1", master.port, timeout=5) for _ in range(client_count)]
    clients[0].set("k", b"v")
    globals()["_keep"] = (master, clients)


def file_worker(path: str, adds: int) -> None:
    with _stores().FileStore(path, timeout=5) as store:
        store.set("child", b"\x00from child\x00")
        assert store.get("parent") == b"from parent"
        for _ in range(adds):
            store.add("counter", 1)
