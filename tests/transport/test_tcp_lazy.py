"""The tcp transport connects on first use: at set-up only host leaders with one another
(and a leader with its own host's ranks, backend tcp); any other pair when one of them
first sends. Two ranks that dial each other at once both get through, and each
direction stays one ordered stream; a rank that leaves is not taken for a crash."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tandem.errors import PeerLostError
from tandem.transport import Header, Kind, Slot
from tandem.transport.tcp import TcpTransport

from _tcp_job import DEADLINE, tcp_job, wait_ok


def _connected(t: TcpTransport) -> set[int]:
    return set(t._conns)


def test_set_up_connects_host_leaders_only() -> None:
    # 3 hosts of 2 ranks: leaders 0, 2, 4
    job = tcp_job(["a", "a", "b", "b", "c", "c"])
    try:
        assert _connected(job[0]) == {1, 2, 4}, _connected(job[0])
        assert _connected(job[2]) == {0, 3, 4}, _connected(job[2])
        assert _connected(job[3]) == {2}, _connected(job[3])
        # a first send to a rank of another host connects the pair, and only it
        buf = bytearray(5)
        got = job[5].irecv(1, Kind.P2P, 1, 0, 0, memoryview(buf))
        wait_ok([job[1].isend(5, Header(Kind.P2P, 1, 0, 0, 5), memoryview(b"hello")), got])
        assert bytes(buf) == b"hello"
        assert _connected(job[1]) == {0, 5} and _connected(job[5]) == {4, 1}
    finally:
        for t in job:
            t.close()


def test_ranks_dialing_each_other_at_once_both_get_through_and_leave_cleanly() -> None:
    doubled = 0
    for _ in range(5):  # the dials race differently each time
        job = tcp_job(["a", "a", "b", "b"])  # 1 and 3: not connected at set-up
        a, b = job[1], job[3]
        try:
            n = 200
            bufs = {(s, i): bytearray(8) for s in (1, 3) for i in range(n)}
            recvs = [job[4 - s].irecv(s, Kind.P2P, 9, i, 0, memoryview(bufs[s, i]))
                     for s in (1, 3) for i in range(n)]
            start = threading.Barrier(2)
            sends: list[Slot] = []

            def flood(t: TcpTransport, to: int) -> None:
                start.wait(DEADLINE)
                for i in range(n):
                    sends.append(t.isend(to, Header(Kind.P2P, 9, i, 0, 8),
                                         memoryview(i.to_bytes(8, "little"))))

            threads = [threading.Thread(target=flood, args=(a, 3)),
                       threading.Thread(target=flood, args=(b, 1))]
            for th in threads:
                th.start()
            for th in threads:
                th.join(DEADLINE)
            wait_ok(sends + recvs)
            doubled += a._conns[3] == 2  # both dialed: two connections, both read
            assert all(int.from_bytes(bufs[s, i], "little") == i for s, i in bufs)
            a.close()  # a goodbye on one connection, both closed: a leaving, not a crash
            end = time.monotonic() + DEADLINE
            while b.left(1) is None and time.monotonic() < end:
                time.sleep(0.01)
            assert b.left(1) is not None and b.lost(1) is None, (b.left(1), b.lost(1))
        finally:
            for t in job:
                t.close()
    assert doubled, "the two dials never raced in 5 tries: that case went untested"


def test_a_first_send_to_a_rank_that_is_gone_fails_naming_it() -> None:
    job = tcp_job(["a", "a", "b", "b"])  # 1 and 3 are not connected at set-up
    try:
        job[3]._listener.close()  # type: ignore[union-attr]  # as a dead process's would be
        with pytest.raises(PeerLostError) as info:
            job[1].isend(3, Header(Kind.P2P, 1, 0, 0, 1), memoryview(b"x"))
        assert "rank 3" in str(info.value), info.value
        assert job[1].lost(3) is not None
    finally:
        for t in job:
            t.close()


def test_a_first_send_to_a_rank_that_dies_mid_handshake_fails_naming_it() -> None:
    job = tcp_job(["a", "a", "b", "b"])
    dying = socket.socket()
    dying.bind(("127.0.0.1", 0))
    dying.listen(1)

    def accept_and_die() -> None:
        conn, _ = dying.accept()
        conn.close()  # what the kernel does for a rank killed before it answered

    helper = threading.Thread(target=accept_and_die, daemon=True)
    helper.start()
    try:
        job[1]._addrs[3] = dying.getsockname()  # rank 3's address, as far as rank 1 knows
        with pytest.raises(PeerLostError) as info:
            job[1].isend(3, Header(Kind.P2P, 1, 0, 0, 1), memoryview(b"x"))
        assert "rank 3" in str(info.value), info.value
        assert job[1].lost(3) is not None
    finally:
        helper.join(DEADLINE)
        dying.close()
        for t in job:
            t.close()
