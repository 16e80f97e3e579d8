"""Transport failures inside one process: broken readers, cut messages, caps on memory.

Two real transports (tcp or shm) are built in threads of this process over a
HashStore, so a test can break one side exactly where it wants (a reader that
raises, a message cut off in the middle) and check that every waiting receive
fails at once, with that error, instead of waiting out its deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator

import pytest

from tandem.errors import ArgumentError, NetworkError, PeerLostError, TandemError
from tandem.store.hash import HashStore
from tandem.testing import wait_until
from tandem.transport import Header, Kind, Slot, Transport
from tandem.transport.shm import ShmTransport
from tandem.transport.tcp import TcpTransport
from _cut import cut_message as _cut_message, vanish as _die
from _pair import connected_pair

pytestmark = pytest.mark.timeout(60)

SECRET = b"failures-secret"
FAST = 5.0  # seconds: far below any deadline, yet generous on a busy machine


def _make(kind: str, rank: int, store: HashStore, **kw: Any) -> Transport:
    if kind == "tcp":
        return TcpTransport(rank, 2, store, "127.0.0.1", SECRET, 30.0, 1 << 34, "h", **kw)
    return ShmTransport(rank, 2, store, SECRET, ring_bytes=1 << 20, hostname="h", **kw)


@pytest.fixture(params=["tcp", "shm"])
def pair(request: Any) -> Iterator[list[Transport]]:
    made = connected_pair(lambda rank, store: _make(request.param, rank, store), Transport)
    yield made
    for t in made:
        t.close()


def _finished(slot: Slot, within: float = FAST) -> BaseException | None:
    assert slot.event.wait(within), f"{slot.key} still pending after {within}s"
    return slot.error


def _recv(t: Transport, peer: int, group: int, n: int) -> Slot:
    return t.irecv(peer, Kind.P2P, group, 0, 0, memoryview(bytearray(n)))


def test_a_reader_that_raises_fails_every_waiting_receive_with_its_error(
        pair: list[Transport]) -> None:
    a, b = pair

    def broken(peer: int, header: Header, read: Callable[[memoryview], None]) -> None:
        raise RuntimeError("a bug in the reader")

    waiting = [_recv(b, 0, group, 4) for group in (7, 8)]  # two groups, neither is sent to
    b.mailbox.arrive = broken  # type: ignore[method-assign]
    a.isend(1, Header(Kind.P2P, 9, 0, 0, 4), memoryview(b"ping"))
    for slot in waiting:
        error = _finished(slot)
        assert isinstance(error, TandemError), error
        assert "a bug in the reader" in str(error) and "RuntimeError" in str(error), error
    later = _recv(b, 0, 10, 4)
    assert isinstance(_finished(later), TandemError), "a later receive must fail at once too"


def test_a_signature_and_call_site_beyond_the_read_buffer_are_delivered(
        pair: list[Transport]) -> None:
    a, b = pair
    sig, site = b"s" * 40_000, b"f" * 30_000  # together above the reader's 64 KiB buffer
    slot = b.irecv(0, Kind.COLL, 3, 0, 0, memoryview(bytearray(4)), sig, site)
    a.isend(1, Header(Kind.COLL, 3, 0, 0, 4, sig, site), memoryview(b"data"))
    assert _finished(slot) is None


def test_a_signature_too_long_for_the_frame_is_refused_at_the_sender(
        pair: list[Transport]) -> None:
    a, _ = pair
    with pytest.raises(ArgumentError, match="signature"):
        a.isend(1, Header(Kind.COLL, 3, 0, 0, 4, b"s" * 70_000, b""), memoryview(b"data"))


def test_a_receive_posted_after_its_sender_died_mid_message_fails_naming_it(
        pair: list[Transport]) -> None:
    a, b = pair
    _cut_message(a, 1, Header(Kind.P2P, 5, 0, 0, 8 << 20), b"x" * (256 << 10))
    wait_until(lambda: 0 in b.mailbox._filling, "the reader to start filling the parked message",
               FAST)
    _die(a)
    wait_until(lambda: b.mailbox.failures.lost(0) is not None, "rank 1 to learn rank 0 is lost",
               FAST)
    start = time.monotonic()
    slot = _recv(b, 0, 5, 8 << 20)  # must not block here, nor wait for ever
    error = _finished(slot)
    assert time.monotonic() - start < FAST
    assert isinstance(error, PeerLostError) and error.rank == 0, error
    assert "rank 0" in str(error), error


def test_a_receive_posted_while_its_message_is_cut_off_fails_naming_the_sender(
        pair: list[Transport]) -> None:
    a, b = pair
    _cut_message(a, 1, Header(Kind.P2P, 5, 0, 0, 8 << 20), b"x" * (256 << 10))
    wait_until(lambda: 0 in b.mailbox._filling, "the reader to start filling the parked message",
               FAST)
    slot = _recv(b, 0, 5, 8 << 20)  # the parked message is still being read
    assert not slot.event.is_set()
    _die(a)
    error = _finished(slot)
    assert isinstance(error, PeerLostError) and error.rank == 0, error


def test_parked_messages_beyond_the_cap_fail_naming_peer_and_bytes(
        pair: list[Transport]) -> None:
    a, b = pair
    b.mailbox.park_limit = 1 << 20
    chunk = bytes(400 << 10)
    for seq in range(4):  # 1.6 MB that rank 1 never posts receives for
        a.isend(1, Header(Kind.P2P, 11, seq, 0, len(chunk)), memoryview(chunk))
    later = b.irecv(0, Kind.P2P, 11, 3, 0, memoryview(bytearray(len(chunk))))
    error = _finished(later)
    assert isinstance(error, TandemError), error
    text = str(error)
    assert "rank 0" in text and str(1 << 20) in text, text
    # the sender learns it too: its group 11 is failed with the same explanation
    probe = _recv(a, 1, 11, 1)
    assert isinstance(_finished(probe), TandemError)


def test_a_first_parked_message_larger_than_the_cap_is_still_accepted(
        pair: list[Transport]) -> None:
    a, b = pair
    b.mailbox.park_limit = 1 << 20
    big = bytes(3 << 20)
    a.isend(1, Header(Kind.P2P, 12, 0, 0, len(big)), memoryview(big))
    wait_until(lambda: any(s.event.is_set() for s in list(b.mailbox._parked.values())),
               "the message to be parked whole", FAST)
    slot = _recv(b, 0, 12, len(big))
    assert _finished(slot) is None


def test_a_send_queue_beyond_its_cap_is_refused_naming_peer_and_bytes(
        pair: list[Transport]) -> None:
    a, b = pair
    a.send_limit = 8 << 20  # type: ignore[attr-defined]
    stuck = threading.Event()

    def stopped(peer: int, header: Header, read: Callable[[memoryview], None]) -> None:
        stuck.wait(FAST)  # rank 1 reads nothing more, like a stopped process

    b.mailbox.arrive = stopped  # type: ignore[method-assign]
    payload = memoryview(bytes(1 << 20))
    try:
        with pytest.raises(NetworkError) as info:
            for seq in range(1000):  # 1 GB: far more than buffers and rings hold
                a.isend(1, Header(Kind.P2P, 13, seq, 0, len(payload)), payload)
    finally:
        stuck.set()
    text = str(info.value)
    assert "rank 1" in text and "bytes" in text and str(8 << 20) in text, text


def test_a_writer_that_raises_fails_its_send_and_the_connection(
        pair: list[Transport], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = pair
    import tandem.transport._ring as ring
    import tandem.transport._shm_peer as shm_peer
    import tandem.transport.tcp as tcp

    def broken(*args: Any, **kwargs: Any) -> None:
        if threading.current_thread().name.startswith(("tandem-write", "tandem-shm-write")):
            raise RuntimeError("a bug in the writer")
        return real(*args, **kwargs)

    if isinstance(a, TcpTransport):
        real = tcp._sendall_vec
        monkeypatch.setattr(tcp, "_sendall_vec", broken)
    else:
        real = ring.Ring.write
        monkeypatch.setattr(ring.Ring, "write", broken)
        # through the ring, not by reference (where the writer only writes a descriptor)
        monkeypatch.setattr(shm_peer, "BY_REFERENCE_MIN", 1 << 40)
    waiting = _recv(b, 0, 14, 1)
    # too large to go inline: the writer thread sends it
    big = memoryview(bytes(2 * tcp._INLINE_MAX))
    sent = a.isend(1, Header(Kind.P2P, 14, 1, 0, len(big)), big)
    error = _finished(sent)
    assert isinstance(error, PeerLostError) and "a bug in the writer" in str(error), error
    assert isinstance(_finished(waiting), PeerLostError), "the peer must learn at once"


def test_a_shm_watcher_that_raises_fails_every_waiting_receive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = HashStore()
    made: list[Any] = [None, None]
    threads = [threading.Thread(target=lambda r=r: made.__setitem__(r, _make("shm", r, store)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    a, b = made
    try:
        def broken(*args: Any) -> None:
            raise RuntimeError("a bug in the watcher")

        monkeypatch.setattr(b, "_take_offers", broken)
        waiting = _recv(b, 0, 15, 4)
        a._offer(a._peers[1], 99, a._peers[1].sock.fileno(), 4096)  # wakes b's watcher
        error = _finished(waiting)
        assert isinstance(error, PeerLostError) and "a bug in the watcher" in str(error), error
        assert isinstance(_finished(_recv(a, 1, 15, 4)), PeerLostError), "the peer learns too"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_message_past_max_frame_is_refused_by_its_sender_and_the_link_stays_up(
        kind: str) -> None:
    cap = 4096

    def make(rank: int, store: HashStore) -> Transport:
        if kind == "tcp":
            return TcpTransport(rank, 2, store, "127.0.0.1", SECRET, 30.0, cap, "h")
        return ShmTransport(rank, 2, store, SECRET, ring_bytes=1 << 20, hostname="h",
                            max_frame=cap)

    a, b = connected_pair(make, Transport)
    try:
        with pytest.raises(ArgumentError) as info:
            a.isend(1, Header(Kind.P2P, 5, 0, 0, 4 * cap), memoryview(bytes(4 * cap)))
        assert "16384 bytes to rank 1 exceeds TANDEM_MAX_FRAME=4096" in str(info.value)
        got = _recv(b, 0, 5, cap)  # a message at the cap goes through the same link
        a.isend(1, Header(Kind.P2P, 5, 0, 0, cap), memoryview(bytes(cap)))
        assert _finished(got) is None
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("header", [Header(Kind.P2P, 5, 0, 0, 8192),
                                    Header(Kind.COLL, 3, 0, 0, 4, b"s" * 70_000, b"")],
                         ids=["past-the-cap", "signature-too-long"])
def test_a_refused_send_to_a_peer_not_yet_dialed_opens_no_connection(header: Header) -> None:
    # a send its receiver would refuse fails before the first use's dial, not after it;
    # ranks 1 and 2 (neither its host's leader) connect on first use
    made = connected_pair(lambda rank, store: TcpTransport(
        rank, 3, store, "127.0.0.1", SECRET, 30.0, 4096, "h", lazy=True), TcpTransport, 3)
    try:
        a = made[1]
        assert isinstance(a, TcpTransport) and not a.connected(2)
        with pytest.raises(ArgumentError):
            a.isend(2, header, memoryview(bytes(header.nbytes)))
        assert not a.connected(2), "the refused send dialed its peer first"
    finally:
        for t in made:
            t.close()
