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
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from _shm_threads import on_threads

from tandem.collectives.backend import DEFAULT_GROUP_ID
from tandem.config import Settings
from tandem.errors import NetworkError
from tandem.store.hash import HashStore
from tandem.transport._arena import CONTROL_BYTES, Arena
from tandem.transport._shmem import create_segment
from tandem.transport.shm import ShmTransport, unsupported_reason

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(bool(unsupported_reason()), reason=unsupported_reason())]

SECRET = b"arena-handover-secret"
N = 4
CHUNK = 1 << 16



def _barrier(arenas: list[Any], r: int) -> int:
    """The shared-memory all_reduce (MAX) of one byte, as rank ``r``: every rank gets N."""
    a = arenas[r]
    staged = a.heads(torch.uint8, 1)[a.begin_round(lambda: None)]
    staged[r][0] = r + 1
    a.post()
    a.wait_all(a.posted, lambda: None)
    return max(int(staged[q][0]) for q in range(len(arenas)))



@pytest.fixture
def host() -> Iterator[list[ShmTransport]]:
    store = HashStore()
    made = on_threads(N, lambda r: ShmTransport(r, N, store, SECRET, ring_bytes=1 << 16,
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
    arenas = on_threads(N, lambda r: host[r].arena(5, list(range(N)), CHUNK, timeout=30))
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
    made = on_threads(2, lambda i: host[members[i]].arena(9, members, CHUNK, timeout=30))
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


def test_the_first_barrier_reserves_pages_not_every_member_s_staging(
        host: list[ShmTransport], monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's first member reserved the whole segment (2 x chunk per member, 64 MiB
    at 16 ranks) while the others waited: now only the control areas, and each member
    reserves its own staging as its calls first write it."""
    chunk = 4 << 20
    reserved: list[int] = []  # bytes asked of posix_fallocate, call by call
    fallocate = os.posix_fallocate
    lock = threading.Lock()

    def counted(fd: int, offset: int, length: int) -> None:
        with lock:
            reserved.append(length)
        fallocate(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", counted)
    arenas = on_threads(N, lambda r: host[r].arena(13, list(range(N)), chunk, timeout=30))
    try:
        assert all(isinstance(a, Arena) for a in arenas), arenas
        assert sum(reserved) == N * CONTROL_BYTES, reserved

        assert on_threads(N, lambda r: _barrier(arenas, r)) == [N] * N
        small = N * (CONTROL_BYTES + 2 * mmap.PAGESIZE)
        assert sum(reserved) == small, f"{sum(reserved)} bytes reserved, {small} expected"
        whole = N * (CONTROL_BYTES + 2 * chunk)
        fd = arenas[1]._fd
        assert fd is not None and os.fstat(fd).st_blocks * 512 == small
        for r, a in enumerate(arenas):  # a large call: each reserves the rest of its own
            a.data(r, 0)[-1] = r
            assert a._fd is None, "all reserved: the descriptor went"
        assert sum(reserved) == whole, f"{sum(reserved)} bytes, each once: {whole}"
    finally:
        for a in arenas:
            if isinstance(a, Arena):
                a.close()


@pytest.mark.procs  # mount and umount
@pytest.mark.procs  # the fixture mounts a tmpfs
def test_a_full_directory_fails_a_member_s_staging_with_a_clear_error(tiny_tmpfs: Path
                                                                       ) -> None:
    """Staging reserved late must still be reserved before any touch: on a tmpfs that
    holds the control areas and a barrier's pages but not 4 MiB of staging, the large
    call's reservation says the directory is full (a touch would have been SIGBUS)."""
    store = HashStore()
    made = on_threads(2, lambda r: ShmTransport(r, 2, store, SECRET, ring_bytes=1 << 16,
                                                 hostname="h", shm_dir=str(tiny_tmpfs)))
    arenas: list[Any] = []
    try:
        assert all(isinstance(t, ShmTransport) for t in made), made
        arenas = on_threads(2, lambda r: made[r].arena(3, [0, 1], 4 << 20, timeout=30))
        assert all(isinstance(a, Arena) for a in arenas), arenas
        for r, a in enumerate(arenas):  # a barrier's worth fits
            a.heads(torch.uint8, 1)[0][r][0] = 1
        with pytest.raises(NetworkError, match="is full") as info:
            arenas[0].data(0, 0)[-1] = 1  # unreserved, this write would be SIGBUS
        assert str(tiny_tmpfs) in str(info.value)
    finally:
        for a in arenas:
            if isinstance(a, Arena):
                a.close()
        for t in made:
            if isinstance(t, ShmTransport):
                t.close()


def _whole_host(store: HashStore, shm_arena: bool = True, n: int = N) -> list[Any]:
    """n transports as ``init_process_group`` makes them when one host holds the job."""
    from tandem.collectives.backend import BackendOptions, _shm_over
    settings = Settings(shm_arena=shm_arena)
    return on_threads(n, lambda r: _shm_over(BackendOptions(
        store=store, rank=r, world_size=n, host="127.0.0.1", hostname="h", secret=SECRET,
        settings=settings), [q for q in range(n) if q != r], None))


@pytest.mark.parametrize("n", [2, N])  # 2: the member gets no socket, only the arena
def test_the_default_group_s_arena_comes_with_the_connections(
        monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """One host, the whole job: the first rank makes the default group's arena before
    the others connect and sends it in the same message as each rank's sockets, so every
    member holds it when init returns: the first collective makes no hand-over, waits
    neither for the first rank nor for a watcher thread (at 32 ranks on 2 CPUs a
    hand-over taken by each member's watcher thread, which then woke the caller, ended
    the first barrier 0.30-0.51 s after the last rank's init). The watcher threads are
    held here until the members have mapped it."""
    offers: list[tuple[int, int]] = []
    real = ShmTransport._offer

    def counted(self: ShmTransport, peer: Any, key: int, *rest: Any) -> None:
        if key == DEFAULT_GROUP_ID:
            offers.append((self.rank, peer.rank))
        real(self, peer, key, *rest)

    held = threading.Event()
    watch = ShmTransport._watch

    def late_watch(self: ShmTransport) -> None:
        held.wait(60)
        watch(self)

    monkeypatch.setattr(ShmTransport, "_offer", counted)
    monkeypatch.setattr(ShmTransport, "_watch", late_watch)
    made = _whole_host(HashStore(), n=n)
    arenas: list[Any] = []
    try:
        assert all(isinstance(t, ShmTransport) for t in made), made
        # the other members map it while the first one has not called anything yet
        # and no watcher thread has run (before: each waited for a record on its
        # socket that its watcher thread took, here in vain)
        late = on_threads(n - 1, lambda i: made[i + 1].arena(DEFAULT_GROUP_ID,
                                                                list(range(n)), None, timeout=2))
        assert all(isinstance(a, Arena) for a in late), late
        arenas = [made[0].arena(DEFAULT_GROUP_ID, list(range(n)), None, timeout=2)] + late
        assert offers == [], f"hand-over records on the sockets: {offers}"
        assert len({a.chunk for a in arenas}) == 1 and [a.index for a in arenas] == list(range(n))
        held.set()
        assert on_threads(n, lambda r: _barrier(arenas, r)) == [n] * n
        # another group's arena, even the first rank's first one, still comes by hand-over
        pair = on_threads(2, lambda r: made[r].arena(7, [0, 1], CHUNK, timeout=30))
        assert all(isinstance(a, Arena) for a in pair), pair
        arenas += pair
    finally:
        held.set()
        for a in arenas:
            if isinstance(a, Arena):
                a.close()
        for t in made:
            if isinstance(t, ShmTransport):
                t.close()


def test_a_subgroup_first_leaves_the_default_group_s_arena_to_it() -> None:
    """A subgroup's arena made before the default group's does not take the one handed
    over at init; a job that never collects closes it."""
    fds = len(os.listdir("/proc/self/fd"))
    made = _whole_host(HashStore())
    arenas: list[Any] = []
    try:
        assert all(isinstance(t, ShmTransport) for t in made), made
        arenas = on_threads(2, lambda r: made[r].arena(3, [0, 1], CHUNK, timeout=30))
        arenas += on_threads(N, lambda r: made[r].arena(DEFAULT_GROUP_ID, list(range(N)),
                                                          None, timeout=30))
        assert all(isinstance(a, Arena) for a in arenas), arenas
        assert arenas[0].chunk == CHUNK and arenas[2].chunk != CHUNK
        arenas[2].data(0, 0)[:1].fill_(9)
        assert all(int(a.data(0, 0)[0]) == 9 for a in arenas[2:])
    finally:
        for a in arenas:
            if isinstance(a, Arena):
                a.close()
        for t in made:
            if isinstance(t, ShmTransport):
                t.close()
    unused = _whole_host(HashStore())
    for t in unused:
        t.close()
    off = _whole_host(HashStore(), shm_arena=False)  # no arena: none made at init
    assert all(t._premade is None for t in off)
    for t in off:
        t.close()
    assert len(os.listdir("/proc/self/fd")) == fds, "an arena's descriptor was left open"
