"""A ring reserves its memory as writes first reach it, not all when it is made.

The first barrier across hosts makes a ring for every edge of each host's tree (14 per
host at 2x8); reserving 4 MiB for each, while every rank of the host waited, took most
of that barrier. Small messages now reserve 64 KiB; the producer reserves the rest
(doubling) before its writes touch it, so nothing is ever touched unreserved.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

from _pair import connected_pair, rpc_sender
from tandem.transport._ring import DATA_OFFSET
from tandem.transport.shm import ShmTransport, unsupported_reason

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

RING = 4 << 20


@pytest.fixture
def pair() -> Iterator[list[ShmTransport]]:
    made = connected_pair(lambda rank, store: ShmTransport(
        rank, 2, store, b"reserve-secret", ring_bytes=RING, hostname="h"), ShmTransport)
    yield made
    for t in made:
        t.close()


def test_a_ring_reserves_what_its_writes_reach(pair: list[ShmTransport], monkeypatch: Any
                                               ) -> None:
    a, b = pair
    reserved: list[int] = []  # bytes asked of posix_fallocate, call by call
    fallocate = os.posix_fallocate

    def counted(fd: int, offset: int, length: int) -> None:
        reserved.append(length)
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", counted)
    send = rpc_sender(a, b, 1)
    send(b"x" * 64)  # a barrier's worth
    assert 0 < sum(reserved) <= DATA_OFFSET + (64 << 10), f"{sum(reserved)} bytes for 64"
    ring = a._peers[1]._out
    assert ring is not None
    send(bytes(range(256)) * 1024)  # 256 KiB: reserved as the writes reach it
    assert DATA_OFFSET + (256 << 10) <= sum(reserved) < DATA_OFFSET + RING, reserved
    fd = ring.descriptor()
    assert fd is not None and os.fstat(fd).st_blocks * 512 == sum(reserved)
    piece = bytes(range(251)) * 2400  # ~600 KB: below the size that goes by reference
    for _ in range(8):  # round the ring
        send(piece)
    assert sum(reserved) == DATA_OFFSET + RING, reserved  # each byte once
    assert ring.descriptor() is None  # all reserved: the descriptor went
