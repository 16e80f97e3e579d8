"""The tcp transport's threads do not grow with its peers: one reader for every connection
and one sender for what cannot go out inline, whatever the number of ranks; and the one
sender never lets a peer that stopped reading hold up the others."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

from tandem.store.hash import HashStore
from tandem.transport import Header, Kind, Slot
from tandem.transport.tcp import TcpTransport

SECRET = b"s" * 32
DEADLINE = 60.0  # generous: the machine is shared


def _mesh(world: int) -> list[TcpTransport]:
    """``world`` connected transports in this process, each built on a thread of its own."""
    store = HashStore()
    made: list[Any] = [None] * world

    def build(rank: int) -> None:
        made[rank] = TcpTransport(rank, world, store, "127.0.0.1", SECRET, 30.0, 1 << 34, "h")

    threads = [threading.Thread(target=build, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert all(isinstance(m, TcpTransport) for m in made), made
    return made


def _wait(slots: list[Slot]) -> None:
    end = time.monotonic() + DEADLINE
    for s in slots:
        assert s.event.wait(max(0.0, end - time.monotonic())), f"not done: {s.key}"
        assert s.error is None, s.error


def _threads_of(rank: int) -> dict[str, int]:
    """How many reader and writer threads ``rank``'s transport runs now."""
    out = {"read": 0, "write": 0}
    for t in threading.enumerate():
        m = re.fullmatch(rf"tandem-(read|write)-{rank}(?:[<>]\d+)?", t.name)
        if m:
            out[m.group(1)] += 1
    return out


def test_one_reader_and_one_sender_per_rank_whatever_the_number_of_peers() -> None:
    world = 5
    mesh = _mesh(world)
    try:
        big = memoryview(bytes(4 << 20))  # past the inline size: the sender writes these
        sends, recvs = [], []
        bufs = {}
        for a in range(world):
            for b in range(world):
                if a != b:
                    bufs[a, b] = bytearray(len(big))
                    recvs.append(mesh[b].irecv(a, Kind.P2P, 7, a, 0, memoryview(bufs[a, b])))
        for a in range(world):  # every rank to every rank at once: nobody waits on anybody
            for b in range(world):
                if a != b:
                    sends.append(mesh[a].isend(b, Header(Kind.P2P, 7, a, 0, len(big)), big))
        _wait(sends + recvs)
        for r in range(world):
            assert _threads_of(r) == {"read": 1, "write": 1}, (r, _threads_of(r))
    finally:
        for t in mesh:
            t.close()


def test_a_peer_that_stopped_reading_does_not_hold_up_sends_to_the_others() -> None:
    a, stuck, other = _mesh(3)
    blocked = threading.Event()
    release = threading.Event()
    real = stuck.mailbox.arrive

    def stopped(peer: int, header: Header, read: Any) -> None:
        blocked.set()
        release.wait(DEADLINE)
        real(peer, header, read)

    stuck.mailbox.arrive = stopped  # type: ignore[method-assign]
    try:
        huge = memoryview(bytes(64 << 20))  # far more than the socket buffers hold
        held = a.isend(1, Header(Kind.P2P, 3, 0, 0, len(huge)), huge)
        assert blocked.wait(DEADLINE)
        payload = memoryview(bytes(range(256)) * 4096)  # 1 MB: through the sender as well
        buf = bytearray(len(payload))
        got = other.irecv(0, Kind.P2P, 3, 1, 0, memoryview(buf))
        sent = a.isend(2, Header(Kind.P2P, 3, 1, 0, len(payload)), payload)
        _wait([sent, got])
        assert bytes(buf) == bytes(payload)
        assert not held.done(), "the stopped peer cannot have taken 64 MB"
    finally:
        release.set()
        for t in (a, stuck, other):
            t.close()
