"""Rings are made on a pair's first message in each direction, not at start-up.

Start-up only connects the local ranks' sockets; a rank makes the ring it writes to a
peer when it first sends to it and hands it over that socket. These tests build shm
transports on threads of this process (over a HashStore) and check: pairs that never
talk hold no ring (no mapping); each direction gets its own ring on its first frame,
also when both sides start at once; a peer whose connection closes before or while
its ring is made is reported to whoever waits on it, and sends to it fail, instead of
hanging; a goodbye from a rank that never wrote needs no ring.
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from tandem.errors import PeerLostError, StateError
from tandem.transport import Header, Kind
from tandem.transport.message import Slot
from tandem.transport import shm
from tandem.transport.shm import ShmTransport, unsupported_reason
from tandem.testing import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))
from _pair import connected_pair  # noqa: E402 - the transport tests' helper, found above

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

SECRET = b"lazy-ring-secret"
RING = 1 << 16
FAST = 10.0


def _build(n: int) -> list[ShmTransport]:
    """``n`` connected transports (ranks 0..n-1 of one host)."""
    return connected_pair(lambda rank, store: ShmTransport(
        rank, n, store, SECRET, ring_bytes=RING, hostname="h"), ShmTransport, n)


@pytest.fixture
def trio() -> Iterator[list[ShmTransport]]:
    made = _build(3)
    yield made
    for t in made:
        t.close()


def _ring_mappings() -> int:
    """This process's mappings of ring segments (memfds labelled tandem-ring)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "tandem-ring" in line)


def _rings(t: ShmTransport) -> dict[int, tuple[bool, bool]]:
    return {p: peer.has_rings() for p, peer in t._peers.items()}


def _send(t: ShmTransport, peer: int, seq: int, data: bytes) -> Slot:
    return t.isend(peer, Header(Kind.P2P, 0, seq, 0, len(data)), memoryview(data))


def _recv(t: ShmTransport, peer: int, seq: int, n: int) -> tuple[Slot, bytearray]:
    buf = bytearray(n)
    return t.irecv(peer, Kind.P2P, 0, seq, 0, memoryview(buf)), buf


def _done(slot: Slot) -> BaseException | None:
    assert slot.event.wait(FAST), f"{slot.key} still pending after {FAST}s"
    return slot.error


def test_pairs_that_never_talk_hold_no_ring() -> None:
    before = _ring_mappings()  # transports other tests left for the collector, if any
    trio = a, b, c = _build(3)
    try:
        assert _ring_mappings() == before, "a ring was made at start-up"
        assert all(rings == (False, False) for t in trio for rings in _rings(t).values())
        got, buf = _recv(b, 0, 1, 5)
        assert _done(_send(a, 1, 1, b"hello")) is None
        assert _done(got) is None and buf == b"hello"
        # one segment for 0 -> 1, mapped by its writer and its reader; nothing else
        assert _ring_mappings() == before + 2
        _only_0_to_1(trio)
    finally:
        for t in trio:
            t.close()


def _only_0_to_1(trio: list[ShmTransport]) -> None:
    a, b, c = trio
    assert _rings(a) == {1: (False, True), 2: (False, False)}
    assert _rings(b) == {0: (True, False), 2: (False, False)}
    assert _rings(c) == {0: (False, False), 1: (False, False)}
    assert [t.name for t in threading.enumerate()].count("tandem-shm-read-1<0") == 1
    assert not any(t.name.startswith(("tandem-shm-read-0", "tandem-shm-read-2"))
                   for t in threading.enumerate()), "a reader runs for a silent peer"


def test_both_directions_starting_at_once_each_get_their_ring() -> None:
    for _ in range(5):  # the race is between the two first messages: try it a few times
        a, b = _build(2)
        try:
            n = 50
            go = threading.Barrier(2)
            errors: list[BaseException] = []

            def talk(me: ShmTransport, peer: int) -> None:
                try:
                    recvs = [_recv(me, peer, i, 3000 + i) for i in range(n)]
                    go.wait(FAST)
                    sends = [_send(me, peer, i, bytes([me.rank + i % 7]) * (3000 + i))
                             for i in range(n)]
                    for s in sends:
                        assert _done(s) is None
                    for i, (slot, buf) in enumerate(recvs):
                        assert _done(slot) is None
                        assert buf == bytes([peer + i % 7]) * (3000 + i), i
                except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                    errors.append(exc)

            threads = [threading.Thread(target=talk, args=(a, 1)),
                       threading.Thread(target=talk, args=(b, 0))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not errors, errors
            assert _rings(a) == {1: (True, True)} and _rings(b) == {0: (True, True)}
        finally:
            a.close()
            b.close()


class Died(BaseException):
    """The sender's process ends here (in a test: the send stops)."""


def _crash(t: ShmTransport) -> None:
    """What the kernel does to a killed rank's connections: close them (its peers see EOF)."""
    for p in t._peers.values():
        p.closing = True
        p.sock.shutdown(socket.SHUT_RDWR)


def test_a_peer_lost_before_it_ever_wrote_is_reported_to_its_waiters(
        trio: list[ShmTransport]) -> None:
    a, b, c = trio
    waiting, _ = _recv(b, 0, 1, 4)
    _crash(a)  # it never wrote to anyone: no ring, no reader thread for it anywhere
    error = _done(waiting)
    assert isinstance(error, PeerLostError) and error.rank == 0, error
    assert isinstance(b.lost(0), PeerLostError) and b.left(0) is None  # died, not left
    try:  # a first send to it fails: at once if c saw the close, else once it has
        late: BaseException | None = _done(_send(c, 0, 1, b"late"))
    except PeerLostError as exc:
        late = exc
    assert isinstance(late, PeerLostError) and "rank 0" in str(late), late
    assert c._peers[0].has_rings() == (False, False)


def test_a_peer_lost_while_its_ring_is_made_is_reported(
        trio: list[ShmTransport], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = trio
    handed = a._offer

    def offer_then_die(*args: Any) -> None:
        handed(*args)
        if args[1] == shm._RING_KEY:  # the ring reaches the peer, the frame never does
            _crash(a)
            raise Died()

    monkeypatch.setattr(a, "_offer", offer_then_die)
    waiting, _ = _recv(b, 0, 1, 4)
    with pytest.raises(Died):
        _send(a, 1, 1, b"ping")
    error = _done(waiting)
    assert isinstance(error, PeerLostError) and error.rank == 0, error
    assert b._peers[0].has_rings()[0], "the ring arrived before the connection closed"


def test_a_send_to_a_peer_already_gone_fails_and_makes_no_ring(
        trio: list[ShmTransport]) -> None:
    a, b, c = trio
    waiting, _ = _recv(a, 1, 1, 4)
    _crash(b)
    assert isinstance(_done(waiting), PeerLostError)  # a noticed b's end
    with pytest.raises(PeerLostError, match="rank 1"):
        slot = _send(a, 1, 1, b"ping")
        raise AssertionError(f"the send was accepted: {_done(slot)}")
    assert a._peers[1].has_rings() == (False, False)


def test_a_goodbye_from_a_rank_that_never_wrote_needs_no_ring(
        trio: list[ShmTransport]) -> None:
    a, b, c = trio
    waiting, _ = _recv(b, 0, 1, 4)
    a.close()  # on purpose: b's receive fails as "left", not as a crash
    error = _done(waiting)
    assert isinstance(error, PeerLostError), error
    wait_until(lambda: b.left(0) is not None, "rank 1 to learn that rank 0 left", FAST)
    assert b.lost(0) is None, "a rank that said goodbye was taken for a crash"
    assert _rings(b)[0] == (False, False)


def test_an_abort_to_a_peer_never_written_to_arrives_without_a_ring(
        trio: list[ShmTransport]) -> None:
    a, b, c = trio
    waiting = [b.irecv(2, Kind.P2P, 7, 0, 0, memoryview(bytearray(4))),
               c.irecv(1, Kind.P2P, 7, 0, 0, memoryview(bytearray(4)))]
    a.abort(7, [1, 2], StateError("rank 0 gave up on group 7"))
    for slot in waiting:
        error = _done(slot)
        assert isinstance(error, StateError) and "gave up on group 7" in str(error), error
    assert all(rings == (False, False) for t in trio for rings in _rings(t).values())
    # the peers go on: a first message after the news takes the ring as usual
    got, buf = _recv(b, 0, 1, 2)
    assert _done(_send(a, 1, 1, b"ok")) is None and _done(got) is None and buf == b"ok"
    assert a._peers[1].has_rings() == (False, True)


def test_malformed_news_on_the_socket_breaks_only_that_peer(
        trio: list[ShmTransport]) -> None:
    a, b, c = trio
    waiting, _ = _recv(b, 0, 1, 4)
    a._offer(a._peers[1], shm._NEWS_KEY, None, 3, b"abc")  # 3 bytes: no frame header
    error = _done(waiting)
    assert isinstance(error, PeerLostError) and "3-byte frame" in str(error), error
    got, buf = _recv(b, 2, 1, 2)  # another peer of b still reaches it
    assert _done(_send(c, 1, 1, b"ok")) is None and _done(got) is None and buf == b"ok"
