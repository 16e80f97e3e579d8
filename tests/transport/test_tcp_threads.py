"""The tcp transport's threads do not grow with its peers: one reader for every connection
and one sender for what cannot go out inline, whatever the number of ranks; and the one
sender never lets a peer that stopped reading hold up the others."""

from __future__ import annotations

import re
import threading
from typing import Any

from tandem.transport import Header, Kind

from _tcp_job import DEADLINE, tcp_job, wait_ok


def _threads(kind: str, rank: int, among: set[threading.Thread]) -> int:
    """How many of ``among`` are ``rank``'s ``kind`` ("read" or "write") threads."""
    return sum(1 for t in among
               if re.fullmatch(rf"tandem-{kind}-{rank}(?:[<>]\d+)?", t.name))


def test_one_reader_and_one_sender_per_rank_whatever_the_number_of_peers() -> None:
    world = 5
    before = set(threading.enumerate())  # other tests' transports may still be closing
    mesh = tcp_job(["h"] * world)
    try:
        big = memoryview(bytes(8 << 20))  # past the inline size: the sender writes these
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
        wait_ok(sends + recvs)
        ours = set(threading.enumerate()) - before
        for r in range(world):
            counts = {k: _threads(k, r, ours) for k in ("read", "write")}
            assert counts == {"read": 1, "write": 1}, (r, counts)
    finally:
        for t in mesh:
            t.close()


def test_a_ring_sized_piece_goes_out_from_the_caller_without_waking_the_sender() -> None:
    # a 16 MB all-reduce over 4 hosts sends 512 KiB pieces; handed to the sender thread,
    # the first one waited 9-23 ms for it to be scheduled (4x1 at 1 Gbit/s, load 20)
    before = set(threading.enumerate())
    a, b = tcp_job(["h"] * 2)
    try:
        piece = memoryview(bytes(range(256)) * 2048)  # 512 KiB
        buf = bytearray(len(piece))
        got = b.irecv(0, Kind.P2P, 5, 0, 0, memoryview(buf))
        sent = a.isend(1, Header(Kind.P2P, 5, 0, 0, len(piece)), piece)
        assert sent.done(), "a 512 KiB piece into an idle connection went to the sender"
        wait_ok([got])
        assert bytes(buf) == bytes(piece)
        assert _threads("write", 0, set(threading.enumerate()) - before) == 0
    finally:
        for t in (a, b):
            t.close()


def test_a_peer_that_stopped_reading_does_not_hold_up_sends_to_the_others() -> None:
    a, stuck, other = tcp_job(["h"] * 3)
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
        wait_ok([sent, got])
        assert bytes(buf) == bytes(payload)
        assert not held.done(), "the stopped peer cannot have taken 64 MB"
    finally:
        release.set()
        for t in (a, stuck, other):
            t.close()
