"""Threads that wait for a frame read it themselves (``Transport.poller``), in one process.

Two shm transports are built in threads of this process over a HashStore. Each test
checks one promise of the leader/follower read path: every frame is delivered once and
in order whichever threads read it; a watching thread reads a frame without the reader
thread being woken for it; and the reader thread is woken again as the last watcher
leaves (no lost wake-up).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

from _pair import connected_pair
from tandem.transport import Header, Kind
from tandem.transport import _ring
from tandem.transport.base import Reader
from tandem.transport.shm import ShmTransport, unsupported_reason

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

SECRET = b"polling-secret"
FAST = 5.0


@pytest.fixture
def pair() -> Iterator[list[ShmTransport]]:
    made = connected_pair(lambda rank, store: ShmTransport(
        rank, 2, store, SECRET, ring_bytes=1 << 20, hostname="h"), ShmTransport)
    yield made
    for t in made:
        t.close()


class Recorder:
    """An RPC-kind handler: each frame's seq, its payload and the thread that read it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: list[tuple[int, bytes, str]] = []

    def __call__(self, peer: int, header: Header, read: Reader) -> None:
        buf = bytearray(header.nbytes)
        if header.nbytes:
            read(memoryview(buf))
        with self.lock:
            self.got.append((header.seq, bytes(buf), threading.current_thread().name))

    def count(self) -> int:
        with self.lock:
            return len(self.got)


def _payload(i: int) -> bytes:
    n = (3 << 20) if i % 500 == 7 else 1 + (i * 37) % 3000  # a few go by reference
    return bytes([i % 251]) * n


def _prime(a: ShmTransport, b: ShmTransport) -> None:
    """One frame from ``a`` to ``b``: its ring (made on the first message) exists after."""
    first = Recorder()
    b.handle(Kind.RPC, first)
    a.isend(1, Header(Kind.RPC, 0, 0, 0, 1), memoryview(b"!"))
    assert _wait_for(lambda: first.count() == 1), "the first frame did not arrive"


def _wait_for(cond: Any, within: float = FAST) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.001)
    return False


def test_every_frame_is_delivered_once_in_order_whoever_reads_it(
        pair: list[ShmTransport]) -> None:
    a, b = pair
    rec = Recorder()
    b.handle(Kind.RPC, rec)
    poller = b.poller(0)
    assert poller is not None and a.poller(0) is None  # none for oneself
    n = 2000
    stop = threading.Event()

    def poll() -> None:  # two threads take turns with the reader thread
        while not stop.is_set():
            poller.watch(True)
            try:
                for _ in range(200):
                    if not poller.poll():
                        time.sleep(0)
            finally:
                poller.watch(False)
            time.sleep(0.001)

    threads = [threading.Thread(target=poll, name=f"poller-{i}") for i in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(n):
            data = _payload(i)
            a.isend(1, Header(Kind.RPC, 0, i, 0, len(data)), memoryview(data))
        assert _wait_for(lambda: rec.count() == n, 60), f"{rec.count()} of {n} frames arrived"
    finally:
        stop.set()
        for t in threads:
            t.join(FAST)
    assert [seq for seq, _, _ in rec.got] == list(range(n))
    assert all(data == _payload(seq) for seq, data, _ in rec.got)


def test_a_watching_thread_reads_the_frame_without_waking_the_reader(
        pair: list[ShmTransport]) -> None:
    a, b = pair
    _prime(a, b)
    rec = Recorder()
    b.handle(Kind.RPC, rec)
    peer = b._peers[0]
    ring = peer.inbound
    poller = b.poller(0)
    assert poller is not None
    readers = []
    for i in range(5):  # the reader thread's own 100 ms timeout may win a round
        assert _wait_for(lambda: ring._idle_sleeper), "the reader thread never slept"
        poller.watch(True)
        try:
            assert ring._ctl[_ring._CSLEEP] == 0, "the writer would wake the reader thread"
            a.isend(1, Header(Kind.RPC, 0, i, 0, 4), memoryview(b"ping"))
            assert _wait_for(lambda: poller.poll() or rec.count() > i)
        finally:
            poller.watch(False)
        assert _wait_for(lambda: rec.count() > i)
        readers.append(rec.got[-1][2])
        if readers[-1] == threading.current_thread().name:
            break
    assert threading.current_thread().name in readers, readers


def test_the_reader_thread_is_woken_again_when_the_last_watcher_leaves(
        pair: list[ShmTransport]) -> None:
    a, b = pair
    _prime(a, b)
    rec = Recorder()
    b.handle(Kind.RPC, rec)
    ring = b._peers[0].inbound
    poller = b.poller(0)
    assert poller is not None
    assert _wait_for(lambda: ring._idle_sleeper), "the reader thread never slept"
    poller.watch(True)
    poller.watch(True)
    assert ring._ctl[_ring._CSLEEP] == 0
    poller.watch(False)
    assert ring._ctl[_ring._CSLEEP] == 0, "one watcher is still polling"
    a.isend(1, Header(Kind.RPC, 0, 1, 0, 4), memoryview(b"late"))  # nobody polls it
    poller.watch(False)  # the last one leaves with a frame waiting: the reader takes it
    assert _wait_for(lambda: rec.count() == 1, 1.0), "the frame was left in the ring"
    assert rec.got[0][2].startswith("tandem-shm-read")
    assert _wait_for(lambda: ring._idle_sleeper)
    assert ring._ctl[_ring._CSLEEP] == 1


def test_a_thread_still_polling_when_the_transport_closes_finds_nothing_to_read(
        pair: list[ShmTransport]) -> None:
    a, b = pair
    b.handle(Kind.RPC, Recorder())
    poller = b.poller(0)
    assert poller is not None
    poller.watch(True)
    a.isend(1, Header(Kind.RPC, 0, 0, 0, 4), memoryview(b"left"))
    b.close()  # the rings are unmapped under the polling thread
    assert poller.poll() is False
    poller.watch(False)
    poller.watch(True)
    assert poller.poll() is False
