"""Large shm payloads sent by reference (cross-memory attach), in one process.

Two shm transports are built in threads of this process over a HashStore (the
kernel lets a process read itself, so the probe succeeds), and each test checks one
promise of the by-reference path: the bytes arrive, the send completes only once
the receiver took them, the caps on unread sends still hold, a refused probe falls
back to the ring, and a receiver that closes fails the sends it never took.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator

import pytest

from _pair import connected_pair
from tandem.errors import NetworkError, TandemError
from tandem.transport import Header, Kind, Slot
from tandem.transport import _cma
from tandem.transport.shm import ShmTransport, unsupported_reason

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(bool(unsupported_reason()) or not _cma.available(),
                                 reason=unsupported_reason() or "no process_vm_readv")]

SECRET = b"by-reference-secret"
FAST = 5.0
BIG = 3 << 20  # above BY_REFERENCE_MIN and above the 1 MiB rings below


def _pair() -> list[ShmTransport]:
    return connected_pair(lambda rank, store: ShmTransport(
        rank, 2, store, SECRET, ring_bytes=1 << 20, hostname="h"), ShmTransport)


@pytest.fixture
def pair() -> Iterator[list[ShmTransport]]:
    made = _pair()
    yield made
    for t in made:
        t.close()


def _readable(a: ShmTransport, peer: int, within: float = FAST) -> bool:
    """Whether ``peer`` told ``a`` it can read a's memory (it probes on its first frame)."""
    deadline = time.monotonic() + within
    ring = a._peers[peer].outbound
    while time.monotonic() < deadline:
        if ring.readable():
            return True
        time.sleep(0.01)
    return False


def _warm(a: ShmTransport, b: ShmTransport) -> None:
    """One small message each way, so each reader has probed its peer."""
    for src, dst in ((a, b), (b, a)):
        got = dst.irecv(src.rank, Kind.P2P, 99, 0, 0, memoryview(bytearray(4)))
        src.isend(dst.rank, Header(Kind.P2P, 99, 0, 0, 4), memoryview(b"warm"))
        assert got.event.wait(FAST) and got.error is None


def _payload(n: int = BIG) -> bytes:
    return bytes(range(256)) * (n // 256)


def _finished(slot: Slot, within: float = FAST) -> BaseException | None:
    assert slot.event.wait(within), f"{slot.key} still pending after {within}s"
    return slot.error


def test_a_large_message_arrives_intact_by_reference(pair: list[ShmTransport]) -> None:
    a, b = pair
    _warm(a, b)
    assert _readable(a, 1), "the probe of a same-user peer in this process must succeed"
    data = _payload()
    buf = bytearray(len(data) + 4)
    got = b.irecv(0, Kind.P2P, 1, 0, 0, memoryview(buf))
    sent = a.isendv(1, Header(Kind.P2P, 1, 0, 0, len(data) + 4),
                    [memoryview(b"head"), memoryview(data)])
    assert _finished(sent) is None and _finished(got) is None
    assert bytes(buf[:4]) == b"head" and bytes(buf[4:]) == data


def test_a_send_by_reference_completes_only_once_the_receiver_took_it(
        pair: list[ShmTransport]) -> None:
    a, b = pair
    _warm(a, b)
    assert _readable(a, 1)
    go, arrived = threading.Event(), threading.Event()
    real = b.mailbox.arrive

    def slow(peer: int, header: Header, read: Callable[[memoryview], None]) -> None:
        arrived.set()
        go.wait(FAST)
        real(peer, header, read)

    b.mailbox.arrive = slow  # type: ignore[method-assign]
    buf = bytearray(BIG)
    got = b.irecv(0, Kind.P2P, 2, 0, 0, memoryview(buf))
    sent = a.isend(1, Header(Kind.P2P, 2, 0, 0, BIG), memoryview(_payload()))
    assert arrived.wait(FAST), "the message never reached the receiver"
    assert not sent.done(), "the sender's memory must stay untouched until the peer read it"
    go.set()
    assert _finished(sent) is None and _finished(got) is None
    assert bytes(buf) == _payload()


def test_unread_sends_by_reference_are_capped(pair: list[ShmTransport]) -> None:
    a, b = pair
    _warm(a, b)
    assert _readable(a, 1)
    a.send_limit = 8 << 20
    stuck = threading.Event()

    def stopped(peer: int, header: Header, read: Callable[[memoryview], None]) -> None:
        stuck.wait(FAST)

    b.mailbox.arrive = stopped  # type: ignore[method-assign]
    payload = memoryview(bytes(BIG))
    try:
        with pytest.raises(NetworkError) as info:
            for seq in range(100):
                a.isend(1, Header(Kind.P2P, 3, seq, 0, BIG), payload)
    finally:
        stuck.set()
    assert "rank 1" in str(info.value) and str(8 << 20) in str(info.value)


def test_a_refused_probe_falls_back_to_the_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cma, "probe", lambda *args: False)
    a, b = _pair()
    try:
        _warm(a, b)
        # b's reader probes a's memory before it delivers a's first frame
        assert b._peers[0]._probed
        assert not a._peers[1].outbound.readable()
        data = _payload()
        buf = bytearray(len(data))
        got = b.irecv(0, Kind.P2P, 4, 0, 0, memoryview(buf))
        sent = a.isend(1, Header(Kind.P2P, 4, 0, 0, len(data)), memoryview(data))
        assert _finished(sent) is None and _finished(got) is None
        assert bytes(buf) == data
        assert not a._peers[1]._acks
    finally:
        a.close()
        b.close()


def test_a_receiver_that_closes_fails_the_sends_it_never_took(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair()
    try:
        _warm(a, b)
        assert _readable(a, 1)
        stuck = threading.Event()
        arrived = threading.Event()

        def stopped(peer: int, header: Header, read: Callable[[memoryview], None]) -> None:
            arrived.set()
            stuck.wait(FAST)
            raise TandemError("stopped")

        b.mailbox.arrive = stopped  # type: ignore[method-assign]
        sent = a.isend(1, Header(Kind.P2P, 5, 0, 0, BIG), memoryview(_payload()))
        assert arrived.wait(FAST), "the send never reached the receiver's reader"
        closer = threading.Thread(target=b.close)
        closer.start()
        stuck.set()
        error = _finished(sent, 15.0)
        assert isinstance(error, TandemError), error
        closer.join(15.0)
    finally:
        a.close()
        b.close()
