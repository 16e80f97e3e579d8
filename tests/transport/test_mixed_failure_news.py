"""Failure news crosses hosts without a connection to every rank (tcp connects on first
use): an abort reaches a rank of another host through one rank of that host, and a
rank that dies is announced to the other hosts by its own host, so a rank waiting on
it learns at once although the two never connected.

Two simulated hosts of two ranks each (threads of this process, told apart by host
name), built by the ``auto`` backend: shared memory within a host, tcp across."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from tandem.errors import PeerLostError, StateError
from tandem.store import HashStore
from tandem.transport import Kind, Slot
from tandem.transport.mixed import MixedTransport
from tandem.transport.shm import unsupported_reason
from tandem.transport.tcp import TcpTransport

from _cut import vanish
from _tcp_job import built_at_once, two_hosts_rank

SECRET = b"failure-news-secret"
DEADLINE = 60.0  # the store's, on a loaded machine
NOTICED_WITHIN = 5.0  # seconds from a failure to the news at a rank of another host

pytestmark = pytest.mark.skipif(bool(unsupported_reason()), reason="no shared memory here")


@pytest.fixture
def job() -> Iterator[list[MixedTransport]]:
    """Ranks 0, 1 on host a and 2, 3 on host b: 0 and 2 lead; 1 and 3 never connect."""
    store = HashStore(DEADLINE)

    made = built_at_once(4, lambda rank: two_hosts_rank(store, rank, SECRET))
    assert all(isinstance(m, MixedTransport) for m in made), made
    yield made
    for m in made:
        m.close()


def _tcp(t: MixedTransport) -> TcpTransport:
    assert isinstance(t.tcp, TcpTransport)
    return t.tcp


def _failed(slot: Slot) -> BaseException | None:
    assert slot.event.wait(NOTICED_WITHIN), "the news did not arrive"
    return slot.error


def test_an_abort_reaches_a_rank_of_another_host_through_that_host(
        job: list[MixedTransport]) -> None:
    waiting = job[3].irecv(1, Kind.COLL, 5, 0, 0, memoryview(bytearray(4)))
    job[1].abort(5, [0, 2, 3], StateError("boom"))
    error = _failed(waiting)
    assert isinstance(error, StateError) and "[reported by rank 1] boom" in str(error), error
    assert not _tcp(job[1]).connected(3) and not _tcp(job[3]).connected(1), \
        "the news must go through the host, not by a new connection"


def test_a_dead_rank_is_named_to_a_rank_of_another_host_that_never_connected_to_it(
        job: list[MixedTransport]) -> None:
    waiting = job[3].irecv(1, Kind.P2P, 0, 0, 0, memoryview(bytearray(4)))
    assert not _tcp(job[3]).connected(1)
    start = time.monotonic()
    vanish(_tcp(job[1]))  # what the kernel does for a SIGKILLed process (tcp first: a
    vanish(job[1].shm)  # rank that is going announces nobody, and a dead one runs nothing)
    error = _failed(waiting)
    assert isinstance(error, PeerLostError) and error.rank == 1, error
    assert "rank 1 died (reported by rank 0)" in str(error), error
    assert time.monotonic() - start < NOTICED_WITHIN
    assert job[3].lost(1) is not None
