"""The small-frame path of the shm transport (``Transport.send_now``), in one process.

A small message goes straight into the ring when nothing is queued before it; otherwise
``send_now`` declines and ``isendv`` queues it behind the others, so frames to a peer
arrive in the order they were sent whichever path each took.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

from _pair import connected_pair
from tandem.transport import Header, Kind
from tandem.transport.base import Reader
from tandem.transport.shm import ShmTransport, unsupported_reason

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

SECRET = b"send-now-secret"
RING = 1 << 16


@pytest.fixture
def pair() -> Iterator[list[ShmTransport]]:
    made = connected_pair(lambda rank, store: ShmTransport(
        rank, 2, store, SECRET, ring_bytes=RING, hostname="h"), ShmTransport)
    yield made
    for t in made:
        t.close()


def _payload(i: int) -> bytes:
    # every 50th is larger than the ring: it queues for the writer thread
    return bytes([i % 251]) * (3 * RING if i % 50 == 3 else 1 + (i * 37) % 900)


def test_frames_arrive_in_order_whether_sent_now_or_queued(pair: list[ShmTransport]) -> None:
    a, b = pair
    got: list[tuple[int, bytes]] = []
    lock = threading.Lock()

    def record(peer: int, header: Header, read: Reader) -> None:
        buf = bytearray(header.nbytes)
        read(memoryview(buf))
        with lock:
            got.append((header.seq, bytes(buf)))

    b.handle(Kind.RPC, record)
    n, now, declined = 1000, 0, 0
    slot = None
    for i in range(n):
        if i % 50 == 10 and slot is not None:  # let the queue empty now and then
            assert slot.event.wait(30), "a queued send was never written"
        data = memoryview(_payload(i))
        header = Header(Kind.RPC, 0, i, 0, len(data))
        if a.send_now(1, header, [data]):
            now += 1
        else:
            declined += len(data) < RING
            slot = a.isendv(1, header, [data])
            assert slot.error is None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with lock:
            if len(got) == n:
                break
        time.sleep(0.001)
    assert [seq for seq, _ in got] == list(range(n)), "frames arrived out of order or lost"
    assert all(data == _payload(seq) for seq, data in got)
    assert now > n // 2, f"only {now} of {n} small frames went straight into the ring"
    assert declined, "no small frame waited behind a queued one: the test proves nothing"


def test_send_now_declines_what_it_cannot_send_at_once(pair: list[ShmTransport]) -> None:
    a, _ = pair
    big = memoryview(bytes(RING + 1))  # larger than the whole ring
    assert not a.send_now(1, Header(Kind.RPC, 0, 0, 0, len(big)), [big])
    assert not a.send_now(7, Header(Kind.RPC, 0, 0, 0, 1), [memoryview(b"x")])  # no such peer
    a.close()
    assert not a.send_now(1, Header(Kind.RPC, 0, 0, 0, 1), [memoryview(b"x")])

