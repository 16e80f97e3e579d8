"""Connected transports in one process, for the in-process transport tests.

All ranks must connect at once (each waits for the others in the store), so each is
built on a thread of its own; ``connected_pair`` returns them once all exist.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

from tandem.store.hash import HashStore
from tandem.transport import Header, Kind
from tandem.transport.base import Reader, Transport

T = TypeVar("T")


def connected_pair(make: Callable[[int, HashStore], T], kind: type, n: int = 2) -> list[T]:
    """``[make(0, store), ..., make(n - 1, store)]`` built concurrently on one fresh store;
    each must be an instance of ``kind`` within 60 s."""
    store = HashStore()
    made: list[Any] = [None] * n

    def build(rank: int) -> None:
        made[rank] = make(rank, store)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(m, kind) for m in made), made
    return made


def rpc_sender(a: Transport, b: Transport, to: int) -> Callable[[bytes], None]:
    """``send(data)``: an RPC message from ``a`` to ``b`` (rank ``to``), checked to
    arrive whole and to complete on ``a``; ``b`` handles every RPC message from now."""
    got: list[bytes] = []
    arrived = threading.Condition()

    def record(peer: int, header: Header, read: Reader) -> None:
        buf = bytearray(header.nbytes)
        read(memoryview(buf))
        with arrived:
            got.append(bytes(buf))
            arrived.notify_all()

    def send(data: bytes) -> None:
        n = len(got)
        slot = a.isendv(to, Header(Kind.RPC, 0, n, 0, len(data)), [memoryview(data)])
        with arrived:
            assert arrived.wait_for(lambda: len(got) > n, 60), "the message never arrived"
        assert slot.event.wait(60) and slot.error is None
        assert got[n] == data

    b.handle(Kind.RPC, record)
    return send
