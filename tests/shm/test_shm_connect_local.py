"""The host's first rank admits the others without waiting for any one of them.

``connect_local`` runs here on threads of this process (one per rank, over a
HashStore). Rank 1 proves the secret first and then holds back its hello until rank 2
has proven it too: the first rank must go on with rank 2's handshake meanwhile. It
used to read each rank's hello right after its handshake, on its only thread, so the
ranks took turns (at 16 ranks on 2 CPUs, each turn a wait for a CPU).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from _shm_threads import on_threads

from tandem import _wire
from tandem.store.hash import HashStore
from tandem.transport import _shm_setup
from tandem.transport.shm import unsupported_reason

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

SECRET = b"connect-local-secret"


def test_a_rank_slow_to_say_hello_does_not_hold_up_the_others_handshakes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    me = threading.local()
    one_proven, two_proven = threading.Event(), threading.Event()
    held: list[bool] = []
    handshake, send_hello = _wire.client_handshake, _shm_setup._send_hello

    def proving(sock: Any, *args: Any) -> None:
        handshake(sock, *args)
        (one_proven if me.rank == 1 else two_proven).set()

    def hello(sock: Any, rank: int, world: int) -> int:
        if rank == 1:  # said once rank 2 is in, or after 5 s if it is kept out
            held.append(two_proven.wait(5))
        return send_hello(sock, rank, world)

    monkeypatch.setattr(_wire, "client_handshake", proving)
    monkeypatch.setattr(_shm_setup, "_send_hello", hello)
    store = HashStore()

    def connect(rank: int) -> Any:
        me.rank = rank
        if rank == 2:
            one_proven.wait(30)  # rank 1 is admitted first
        return _shm_setup.connect_local(store, rank, 3, [0, 1, 2], SECRET, 30)

    out = on_threads(3, connect)
    try:
        assert all(isinstance(o, tuple) for o in out), out
        assert held == [True], "rank 2 could not prove the secret while rank 1 held its hello"
        for rank, (links, _) in enumerate(out):
            assert sorted(links) == sorted({0, 1, 2} - {rank}), (rank, links)
        # every pair's socket joins the right two ranks
        links1, links2 = out[1][0], out[2][0]
        links1[2].sock.sendall(b"x")
        assert links2[1].sock.recv(1) == b"x"
    finally:
        for o in out:
            if isinstance(o, tuple):
                for link in o[0].values():
                    link.sock.close()


def test_the_watcher_thread_starts_after_the_rank_is_reachable_and_before_it_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a thread waits for it to get a CPU (13-100 ms at 16 ranks on 2 CPUs):
    the watcher's start overlaps the wait for the other ranks instead of following it,
    and comes after what they wait for (the first rank's address, another's hello)."""
    from tandem.transport import shm

    seen: list[tuple[int, str, bool]] = []
    lock = threading.Lock()

    def note(rank: int, what: str) -> None:
        alive = any(t.name == f"tandem-shm-watch-{rank}" and t.is_alive()
                    for t in threading.enumerate())
        with lock:
            seen.append((rank, what, alive))

    class Noting(HashStore):
        def _set(self, key: str, value: bytes) -> None:
            if key.startswith("shm/addr/"):
                note(int(key.rsplit("/", 1)[1]), "address")
            super()._set(key, value)

    send_hello, recv_hello, accept = (_shm_setup._send_hello, _shm_setup._recv_hello,
                                      _shm_setup._accept_loop)

    def hello(sock: Any, rank: int, world: int) -> Any:
        note(rank, "hello")
        return send_hello(sock, rank, world)

    me = threading.local()

    def awaiting_hello(sock: Any) -> Any:
        if me.rank == 1:  # rank 1's wait for the first rank's hello (rank 0 reads it too)
            note(1, "wait")
        return recv_hello(sock)

    def accepting(listener: Any, rank: int, *args: Any) -> Any:
        note(rank, "wait")
        return accept(listener, rank, *args)

    monkeypatch.setattr(_shm_setup, "_send_hello", hello)
    monkeypatch.setattr(_shm_setup, "_recv_hello", awaiting_hello)
    monkeypatch.setattr(_shm_setup, "_accept_loop", accepting)
    store = Noting()

    def make(rank: int) -> Any:
        me.rank = rank
        return shm.ShmTransport(rank, 2, store, SECRET, ring_bytes=1 << 16)

    made = on_threads(2, make)
    try:
        assert all(isinstance(t, shm.ShmTransport) for t in made), made
        for rank, first in ((0, "address"), (1, "hello")):
            mine = [(what, alive) for r, what, alive in seen if r == rank]
            assert mine[:2] == [(first, False), ("wait", True)], (rank, seen)
    finally:
        for t in made:
            if isinstance(t, shm.ShmTransport):
                t.close()


def test_a_failed_set_up_leaves_no_watcher_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.errors import NetworkError
    from tandem.transport import shm

    def failing(*args: Any) -> Any:
        raise NetworkError("no peers today")

    monkeypatch.setattr(shm, "connect_local", failing)
    with pytest.raises(NetworkError, match="no peers today"):
        shm.ShmTransport(0, 2, HashStore(), SECRET, ring_bytes=1 << 16)
    for t in threading.enumerate():
        if t.name == "tandem-shm-watch-0":
            t.join(10)
            assert not t.is_alive(), "the watcher of a failed set-up is still running"
