"""Building a same-host group's arena takes members - 1 hand-overs, not members^2.

The first member makes one segment holding every member's staging area and hands it
to each other member; each maps it once. Four shm transports are built on threads of
this process (over a HashStore): the hand-overs are counted at ``ShmTransport._offer``
and the mappings in ``/proc/self/maps``, and what one member writes into its area is
read by the others in theirs.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Iterator

import pytest

from tandem.errors import NetworkError
from tandem.store.hash import HashStore
from tandem.transport._arena import Arena
from tandem.transport._shmem import create_segment
from tandem.transport.shm import ShmTransport, unsupported_reason

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

SECRET = b"arena-handover-secret"
N = 4
CHUNK = 1 << 16


def _on_threads(n: int, work: Any) -> list[Any]:
    """``work(rank)`` for ranks 0..n-1, each on its own thread; the results (or errors)."""
    out: list[Any] = [None] * n

    def run(rank: int) -> None:
        try:
            out[rank] = work(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture
def host() -> Iterator[list[ShmTransport]]:
    store = HashStore()
    made = _on_threads(N, lambda r: ShmTransport(r, N, store, SECRET, ring_bytes=1 << 16,
                                                 hostname="h"))
    assert all(isinstance(t, ShmTransport) for t in made), made
    yield made
    for t in made:
        t.close()


def _arena_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "tandem-arena" in line)


def test_the_arena_is_one_segment_handed_over_members_minus_one_times(
        host: list[ShmTransport], monkeypatch: pytest.MonkeyPatch) -> None:
    offers: list[tuple[int, int]] = []
    for t in host:
        def counted(peer: Any, key: int, *rest: Any, t: Any = t, real: Any = t._offer) -> None:
            if key == 5:  # the arena's (a goodbye at close is news, not a hand-over)
                offers.append((t.rank, peer.rank))
            real(peer, key, *rest)

        monkeypatch.setattr(t, "_offer", counted)
    before = _arena_mappings()
    arenas = _on_threads(N, lambda r: host[r].arena(5, list(range(N)), CHUNK, timeout=30))
    try:
        assert all(isinstance(a, Arena) for a in arenas), arenas
        assert sorted(offers) == [(0, q) for q in range(1, N)], offers  # a segment each: 12
        assert _arena_mappings() - before == N, "one mapping per member"  # a segment each: 16
        assert all(a.chunk == CHUNK and a.index == r for r, a in enumerate(arenas))
        for r, a in enumerate(arenas):  # each member's area is its own, seen by every member
            a.data(r, 1)[:4].fill_(10 + r)
        for a in arenas:
            assert [int(a.data(q, 1)[3]) for q in range(N)] == [10 + q for q in range(N)]
            assert [int(a.data(q, 0)[0]) for q in range(N)] == [0] * N
    finally:
        for a in arenas:
            if isinstance(a, Arena):
                a.close()


def test_a_subgroup_s_arena_comes_from_its_first_member(host: list[ShmTransport]) -> None:
    members = [3, 1]  # group order: rank 3 is the group's first member
    made = _on_threads(2, lambda i: host[members[i]].arena(9, members, CHUNK, timeout=30))
    try:
        assert all(isinstance(a, Arena) for a in made), made
        made[0].data(0, 0)[:2].fill_(7)
        assert int(made[1].data(0, 0)[1]) == 7 and made[1].index == 1
    finally:
        for a in made:
            if isinstance(a, Arena):
                a.close()


def test_a_segment_that_does_not_split_into_areas_is_refused(host: list[ShmTransport]) -> None:
    size = 9 * mmap.PAGESIZE  # two areas of 4.5 pages each
    fd = create_segment(size)
    try:
        host[0]._offer(host[0]._peers[1], 11, fd, size)
    finally:
        os.close(fd)
    with pytest.raises(NetworkError, match="rank 0 handed over a .*arena for 2 ranks"):
        host[1].arena(11, [0, 1], CHUNK, timeout=30).close()
