"""A host leader makes its host's shared memory while the other hosts' leaders connect to
it, not after: one after the other, its host's ranks waited for both (2x8: 16-34 ms of
connections between the leaders, then 11-42 ms of shared memory).

Two simulated hosts of two ranks each (threads of this process, told apart by host name),
built by the ``auto`` backend; rank 2 (host b's leader) dials rank 0 (host a's) only once
rank 0 is in its shared-memory set-up: before, rank 0 waited for that connection first."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tandem.collectives import backend
from tandem.collectives.backend import BackendOptions
from tandem.store import HashStore
from tandem.transport.mixed import MixedTransport
from tandem.transport.shm import unsupported_reason
from tandem.transport.tcp import TcpTransport

from _tcp_job import built_at_once, two_hosts_rank

SECRET = b"setup-overlap-secret"
DEADLINE = 60.0  # the store's, on a loaded machine
HELD = 10.0  # how long rank 2 holds its dial for rank 0's shared memory, at most

pytestmark = pytest.mark.skipif(bool(unsupported_reason()), reason="no shared memory here")


def test_a_host_leader_makes_its_shared_memory_before_the_other_leaders_connect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = HashStore(DEADLINE)
    in_shm = threading.Event()  # rank 0 began its host's shared memory
    waited: list[bool] = []  # rank 2: whether rank 0 got there while it held its dial
    shm_over = backend._shm_over
    connect_lower = TcpTransport._connect_lower

    def shm(options: BackendOptions, peers: list[int], tcp: Any) -> Any:
        if options.rank == 0:
            in_shm.set()
        return shm_over(options, peers, tcp)

    def dial(self: TcpTransport, entries: dict[int, tuple[str, str, int]],
             deadline: float) -> None:
        if self.rank == 2 and 0 in entries:
            waited.append(in_shm.wait(HELD))
        connect_lower(self, entries, deadline)

    monkeypatch.setattr(backend, "_shm_over", shm)
    monkeypatch.setattr(TcpTransport, "_connect_lower", dial)

    made = built_at_once(4, lambda rank: two_hosts_rank(store, rank, SECRET))
    try:
        assert all(isinstance(m, MixedTransport) for m in made), made
        assert waited == [True], "rank 0 waited for rank 2's connection before its shm"
        tcp0 = made[0].tcp
        assert isinstance(tcp0, TcpTransport) and tcp0.connected(2)  # and it did connect
    finally:
        for m in made:
            if isinstance(m, MixedTransport):
                m.close()
