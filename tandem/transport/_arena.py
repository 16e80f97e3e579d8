"""A group's shared staging memory: every local member maps every member's staging area.

Ring messages copy a payload twice (into the ring, out of it) and hop through a
reader thread. Collectives on same-host ranks do better when each rank *reads its
peers' memory directly*: a rank copies its part of a chunk into its own segment,
publishes a counter, and the others reduce or copy straight out of it. The
algorithms are in ``tandem.collectives.algorithms.shm``; this module is the memory
and the signalling::

    arena = transport.arena(key, members)      # collective over ``members``
    buf = arena.begin_round(check)             # 0 or 1: which half of each segment
    arena.data(arena.index, buf)[:n].copy_(x)  # my staging half (a uint8 tensor)
    arena.post()                               # "phase done" -> peers may read it
    arena.wait_all(arena.posted, check)        # every member finished that phase

The areas lie side by side in one segment, which the group's first member creates
and hands to each other member (``ShmTransport.arena``): members - 1 hand-overs and
one mapping per member (a segment per member, each handed to every other, took
64 x 63 hand-overs and mappings to build at 64 ranks). Only the control areas are
reserved then; each member reserves its own staging as its calls first need it
(:class:`Arena`). Area layout (member q's at byte q x area size)::

    byte 0            posted   u64   phases this member has published
    byte 8            pid      u64   the member's process id         (direct access,
    byte 16           here     u64   where it mapped its own segment  below)
    byte 24           verdict  u64   0 not yet, 1 it may read and write every member's
                                     memory, 2 it may not
    byte 32           buffer   u64   address of the tensor of its current call
    byte 64 + 8 q     asleep   u64   member q sleeps on ``posted`` (one word each)
    byte 2112 + k e   call k   the member's announcement of its call number ``seq``
                               in entry ``k = seq % 4`` (e = 1520 bytes): u64 1 + seq,
                               u64 signature length, u64 call-site length, then the
                               signature and the call site (truncated to fit)
    byte 8192         staging  2 x chunk bytes

Rounds alternate between the two staging halves. Before a member overwrites half
``r % 2`` it waits until every member has *started* round ``r - 1``, which each
does only after it finished reading round ``r - 2``: so one wait per round keeps
the halves safe, and most of the time it is already satisfied.

A call may also cut both halves into slots and stream through them itself (a
broadcast root runs several rounds ahead of its readers that way): it takes the
half :meth:`begin_round` gives it, writes the other half only once every member has
posted the call's first phase (then nobody reads the previous call any more), and if
it did write there, ends with :meth:`settle` (one more post, after its last read),
which the next round waits for.

A collective may also move bytes straight between the members' tensors with
cross-memory reads and writes (``_cma``; the algorithm is
``tandem.collectives.algorithms.shm_direct``) instead of staging them. Each member's
pid and the address where it mapped its own segment, written once when the arena is
made, let a peer probe whether the kernel lets it read and write this process
(:meth:`Arena.probe_direct`); the member publishes that probe's verdict, and the
address of the tensor it works on in the current call (:meth:`Arena.publish_buffer`)::

    arena.publish_buffer(t.data_ptr()); arena.post(); arena.wait_all(...)
    arena.read_member(q, arena.buffer_of(q) + offset, scratch.data_ptr(), nbytes)

Ordering rests on x86-64 total store order, as for the rings (see ``_ring``): data
is stored before the counter that publishes it; a :func:`fence` separates "publish"
from "is anyone asleep?". Announcements are a seqlock: the sequence word is cleared,
the text written, then the word set, so a reader that sees the same word before and
after reading the text read a whole one.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Callable, Sequence

import torch

from tandem.errors import ArgumentError
from tandem.transport import _cma
from tandem.transport._shmem import address_of, fence, futex_wait, futex_wake, reserve_more

__all__ = ["Arena", "MAX_MEMBERS", "CONTROL_BYTES", "segment_bytes", "default_chunk"]

CONTROL_BYTES = 8192
MAX_MEMBERS = 256
_POSTED = 0
PID, HERE, VERDICT, BUFFER = 1, 2, 3, 4  # u64 indexes of direct access in a control area
_ASLEEP = 8  # u64 index of member 0's sleep flag
_CALLS = (_ASLEEP + MAX_MEMBERS) * 8  # byte offset of the announcement entries: 2112
_KEPT = 4  # announcements kept per member
_ENTRY = (CONTROL_BYTES - _CALLS) // _KEPT  # bytes per entry: 1520
_HOT_S = 5e-6
_SLEEP_S = 0.1
_HEADS_KEPT = 64  # (dtype, numel) shapes whose staging heads stay cached
_PAGE = 4096  # staging is reserved in whole pages


def segment_bytes(chunk: int) -> int:
    return CONTROL_BYTES + 2 * chunk


def default_chunk(local_ranks: int) -> int:
    """Staging bytes per half: 1 MiB when every local rank has a CPU, else 4 MiB, halved
    (down to 256 KiB) while all members' halves together would exceed 32 MiB.

    Each round costs two waits on every member; on an oversubscribed host a wait
    means a context switch, so rounds are made fewer and larger there (measured on
    2 cores: 4 ranks, 64 MB all-reduce, 1 MiB rounds ~1.4x slower than 4 MiB). Every
    member maps every member's segment, so many local ranks get smaller ones.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    chunk = (1 << 20) if local_ranks <= (cpus or 1) else (4 << 20)
    while chunk > (256 << 10) and chunk * local_ranks > (32 << 20):
        chunk >>= 1
    return chunk


class Arena:
    """Staging areas of ``members`` (global ranks, in group order); ``index`` is mine.

    ``maps[i]`` is member i's segment (mine included), or ``maps`` is one segment
    holding every member's area, member i's at ``i * len(maps) // len(members)``. ``spin`` is how long a waiter
    polls before it sleeps on the futex (``self.spin`` may be changed per call). Its
    process group unmaps the segments with :meth:`close` when it is destroyed.

    ``fd``: the one segment, of which every control area is reserved but no staging;
    this member reserves its own staging (both halves alike, doubling, whole pages)
    before it first hands out views that write it (:meth:`heads`, :meth:`slots`,
    :meth:`data` of its own index), and closes ``fd`` once all is. A peer reads only
    what its writer published, so nothing is touched unreserved: a full ``/dev/shm``
    fails with a clear error, not ``SIGBUS``. A one-byte call then reserves a page
    per half, not 2 x chunk for every member while the others wait.
    """

    def __init__(self, members: Sequence[int], index: int,
                 maps: Sequence[mmap.mmap] | mmap.mmap, chunk: int, spin: float,
                 fd: int | None = None, where: str = "memory (memfd)") -> None:
        if len(members) > MAX_MEMBERS:
            raise ArgumentError(f"a shared-memory arena holds at most {MAX_MEMBERS} ranks")
        if isinstance(maps, mmap.mmap):  # one segment: (mapping, offset) of each area
            per = len(maps) // len(members)
            areas = [(maps, q * per) for q in range(len(members))]
            self._segments = [maps]
        else:
            areas = [(m, 0) for m in maps]
            self._segments = list(maps)
        self.index = index
        self.size = len(members)
        self.chunk = chunk
        self.default_spin = spin
        self.spin = spin  # for the call at hand: callers lower it when others need the CPU
        self._maps = areas
        # one view and one address per segment, not per member (one segment: 32 members
        # at a host's first barrier each exported the same mapping twice)
        whole = {id(m): (memoryview(m), address_of(m)) for m in self._segments}
        self._ctl = [whole[id(m)][0][o:o + CONTROL_BYTES].cast("Q") for m, o in areas]
        self._addr = [whole[id(m)][1] + o for m, o in areas]
        # each member's two staging halves as tensors, made at the first call that stages
        # (a barrier stages nothing: 2 views per member were O(members) torch work at init)
        self._data: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.posted = self._ctl[index][_POSTED]
        self._sleep_words = [_ASLEEP + q for q in range(self.size) if q != index]
        self.target = 0
        # members found to have announced call ``matched_call`` (seq, signature): a wait's
        # checks compare each member with the call at hand once, not at every wake
        self.matched_call: tuple[int, bytes] = (-1, b"")
        self.matched: set[int] = set()
        # [timeline hook] while set, every wait that blocks appends (start, end) here
        self.wait_log: list[tuple[float, float]] | None = None
        self._round = 0
        self._first = [0, 0]  # the value posted first in each of the last two rounds
        # typed views of the staging slots, made once: a view per round and member
        # cost more than the copies of small rounds
        self._views: dict[tuple[torch.dtype, int], list[list[list[torch.Tensor]]]] = {}
        self._heads: dict[tuple[torch.dtype, int], list[list[torch.Tensor]]] = {}
        mine = self._ctl[index]
        mine[PID], mine[HERE] = os.getpid(), self._addr[index]
        # whether every member may read and write every member's memory: None until the
        # members agreed (shm_direct does that in its first call)
        self.direct: bool | None = None
        self._scratch: torch.Tensor | None = None
        self._fd, self._where = fd, where
        self._mine = areas[index][1] + CONTROL_BYTES  # offset of my staging in its segment
        self.reserved = chunk if fd is None else 0  # bytes of each of my halves reserved

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Unmap every segment; call only when no thread uses the arena any more.

        Views into the segments are dropped first; a mapping something else still
        views (a staging tensor a caller kept) is left to the garbage collector.
        """
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._data = []
        self._views = {}
        self._heads = {}
        self._scratch = None
        for v in self._ctl:
            v.release()
        self._ctl = []
        self._maps = []
        for m in self._segments:
            try:
                m.close()
            except BufferError:
                pass
        self._segments = []

    # -- memory ----------------------------------------------------------------------
    def _halves(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[member]: its staging halves as uint8 tensors of ``chunk`` bytes (made once)."""
        if self._data is None:
            mapped = {id(m): torch.frombuffer(m, dtype=torch.uint8) for m in self._segments}
            c = self.chunk
            self._data = [(mapped[id(m)][o + CONTROL_BYTES:o + CONTROL_BYTES + c],
                           mapped[id(m)][o + CONTROL_BYTES + c:o + CONTROL_BYTES + 2 * c])
                          for m, o in self._maps]
        return self._data

    def _reserve(self, nbytes: int) -> None:
        """Reserve the first ``nbytes`` (at least double what was) of each of my halves."""
        if nbytes <= self.reserved:
            return
        assert self._fd is not None
        want = min(self.chunk, -(-max(nbytes, 2 * self.reserved) // _PAGE) * _PAGE)
        for half in (0, 1):
            reserve_more(self._fd, self._mine + half * self.chunk + self.reserved,
                         want - self.reserved, self._where)
        self.reserved = want
        if want >= self.chunk:  # all reserved: the descriptor is no longer needed
            os.close(self._fd)
            self._fd = None

    def data(self, member: int, half: int) -> torch.Tensor:
        """Member ``member``'s staging half ``half`` as a uint8 tensor of ``chunk`` bytes
        (my own: reserved whole first)."""
        if member == self.index and self.reserved < self.chunk:
            self._reserve(self.chunk)
        return self._halves()[member][half]

    def slots(self, dtype: torch.dtype, per: int) -> list[list[list[torch.Tensor]]]:
        """[half][slot][member]: each half cut into ``chunk // (per * itemsize)`` slots of
        ``per`` elements of ``dtype`` (cached; ``per * itemsize`` at most ``chunk``)."""
        key = (dtype, per)
        table = self._views.get(key)
        if table is None:
            step = per * torch.empty((), dtype=dtype).element_size()
            if step > self.chunk or step <= 0:
                raise ArgumentError(f"a slot of {step} bytes does not fit a {self.chunk}-byte "
                                    f"staging half")
            self._reserve(self.chunk // step * step)
            data = self._halves()
            table = [[[data[q][h][k * step:(k + 1) * step].view(dtype)
                       for q in range(self.size)] for k in range(self.chunk // step)]
                     for h in (0, 1)]
            self._views[key] = table
        return table

    def heads(self, dtype: torch.dtype, numel: int) -> list[list[torch.Tensor]]:
        """[half][member]: the first ``numel`` elements of ``dtype`` of each staging half,
        for a call that fits one round (cached for up to ``_HEADS_KEPT`` shapes; a training
        loop repeats a few)."""
        key = (dtype, numel)
        table = self._heads.get(key)
        if table is None:
            step = numel * torch.empty((), dtype=dtype).element_size()
            if step > self.chunk or numel < 0:
                raise ArgumentError(f"{numel} elements of {dtype} do not fit a "
                                    f"{self.chunk}-byte staging half")
            self._reserve(step)
            if len(self._heads) >= _HEADS_KEPT:
                self._heads.clear()
            data = self._halves()
            table = [[data[q][h][:step].view(dtype) for q in range(self.size)]
                     for h in (0, 1)]
            self._heads[key] = table
        return table

    # -- rounds and phases -----------------------------------------------------------
    def begin_round(self, check: Callable[[], None], write: bool = True) -> int:
        """Start a round; returns the staging half it may write (see the module doc).

        ``write=False``: this member only reads others' halves this round (a broadcast's
        non-roots), so it keeps the count of rounds without waiting for anyone.
        """
        r = self._round
        if r >= 1 and write:
            self.wait_all(self._first[(r - 1) % 2], check)
        self._first[r % 2] = self.posted + 1
        self._round = r + 1
        return r % 2

    def settle(self) -> None:
        """End a call that wrote both halves (see the module doc): post once more, after
        the call's last read, and make the next round wait for that post."""
        self.post()
        self._first[(self._round - 1) % 2] = self.posted

    def post(self) -> None:
        """Publish one more finished phase; wake members asleep on it."""
        ctl = self._ctl[self.index]
        self.posted += 1
        ctl[_POSTED] = self.posted
        fence()
        for w in self._sleep_words:
            if ctl[w]:
                futex_wake(self._addr[self.index])
                return

    def lagging(self, target: int) -> list[int]:
        """Members (indexes) that have not yet posted ``target`` phases."""
        return [q for q in range(self.size) if self._ctl[q][_POSTED] < target]

    def wait_all(self, target: int, check: Callable[[], None]) -> None:
        """Return once every member has posted ``target`` phases; ``check()`` may raise.

        ``self.target`` holds ``target`` meanwhile, for ``check`` to name the laggards.
        """
        self.target = target
        for q in range(self.size):
            if q != self.index and self._ctl[q][_POSTED] < target:
                self._wait(q, target, check)

    def wait_member(self, q: int, target: int, check: Callable[[], None]) -> None:
        """Return once member ``q`` has posted ``target`` phases (see :meth:`wait_all`)."""
        self.target = target
        if self._ctl[q][_POSTED] < target:
            self._wait(q, target, check)

    def _wait(self, q: int, target: int, check: Callable[[], None]) -> None:
        log = self.wait_log
        if log is None:
            self._block(q, target, check)
            return
        start = time.perf_counter()
        try:
            self._block(q, target, check)
        finally:
            log.append((start, time.perf_counter()))

    def _block(self, q: int, target: int, check: Callable[[], None]) -> None:
        ctl = self._ctl[q]
        now = time.perf_counter()
        hot, end = now + min(_HOT_S, self.spin), now + self.spin
        while True:
            for _ in range(8):
                if ctl[_POSTED] >= target:
                    return
            if time.perf_counter() >= hot:
                break
        while time.perf_counter() < end:
            os.sched_yield()
            if ctl[_POSTED] >= target:
                return
        flag = _ASLEEP + self.index
        check()
        ctl[flag] = 1
        try:
            while True:
                seen = ctl[_POSTED]
                if seen >= target:
                    return
                futex_wait(self._addr[q], seen, _SLEEP_S)
                if ctl[_POSTED] < target:
                    check()
        finally:
            ctl[flag] = 0

    # -- announcements (which call each member is in) --------------------------------
    def announce(self, seq: int, sig: bytes, site: bytes) -> None:
        base = _CALLS + (seq % _KEPT) * _ENTRY
        ctl, w = self._ctl[self.index], base // 8
        room = _ENTRY - 24
        sig = sig[:room]
        site = site[:room - len(sig)]
        ctl[w] = 0
        # through the mapping itself: a third of the cost of a memoryview slice (measured)
        m, o = self._maps[self.index]
        m[o + base + 24:o + base + 24 + len(sig) + len(site)] = sig + site
        ctl[w + 1] = len(sig)
        ctl[w + 2] = len(site)
        ctl[w] = seq + 1

    def latest(self, member: int) -> tuple[int, bytes, bytes]:
        """The newest call ``member`` announced (seq -1: none yet)."""
        seen = [a for k in range(_KEPT) if (a := self.announcement(member, k)) is not None]
        return max(seen, default=(-1, b"", b""))

    def announcement(self, member: int, seq: int) -> tuple[int, bytes, bytes] | None:
        """What ``member`` announced in ``seq``'s entry: (its seq, signature, call site).

        The seq is -1 when nothing was announced there yet; None means the member is
        rewriting the entry right now.
        """
        base = _CALLS + (seq % _KEPT) * _ENTRY
        ctl, w = self._ctl[member], base // 8
        before = ctl[w]
        n_sig, n_site = ctl[w + 1], ctl[w + 2]
        if before == 0:
            return (-1, b"", b"") if n_sig == 0 and n_site == 0 else None
        if 24 + n_sig + n_site > _ENTRY:
            return None
        mapped, o = self._maps[member]
        sig = mapped[o + base + 24:o + base + 24 + n_sig]
        site = mapped[o + base + 24 + n_sig:o + base + 24 + n_sig + n_site]
        if ctl[w] != before:
            return None
        return before - 1, sig, site

    def holds(self, member: int, seq: int, sig: bytes) -> bool:
        """Whether ``member``'s entry for ``seq`` holds call ``seq`` with signature ``sig``
        (the common answer, found without copying; False: :meth:`announcement` tells
        what it holds instead)."""
        base = _CALLS + (seq % _KEPT) * _ENTRY
        ctl, w = self._ctl[member], base // 8
        m, o = self._maps[member]
        return (ctl[w] == seq + 1 and ctl[w + 1] == len(sig)
                and m[o + base + 24:o + base + 24 + len(sig)] == sig
                and ctl[w] == seq + 1)

    # -- direct access to the members' memory ----------------------------------------
    def scratch(self, nbytes: int) -> torch.Tensor:
        """A private buffer of at least ``nbytes`` (uint8), kept for the next call."""
        if self._scratch is None or len(self._scratch) < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
            self._scratch.zero_()  # fault it in now, not inside a timed call
        return self._scratch

    def probe_direct(self) -> bool:
        """Whether this process may read and write every other member's memory; the
        answer is published as this member's verdict (:meth:`verdict`)."""
        ok = _cma.available()
        for q in range(self.size):
            if ok and q != self.index:
                ctl = self._ctl[q]
                ok = _cma.may_write(int(ctl[PID]), int(ctl[HERE]) + 8 * PID, int(ctl[PID]))
        self._ctl[self.index][VERDICT] = 1 if ok else 2
        return ok

    def verdict(self, member: int) -> bool | None:
        """``member``'s published :meth:`probe_direct` answer (None: not yet)."""
        v = self._ctl[member][VERDICT]
        return None if v == 0 else v == 1

    @staticmethod
    def direct_possible() -> bool:
        """Whether this system has cross-memory reads and writes at all."""
        return _cma.available()

    def read_member(self, member: int, address: int, local: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``address`` of ``member``'s process to ``local`` (OSError:
        the kernel refused, or the process is gone)."""
        _cma.read_from(int(self._ctl[member][PID]), local, address, nbytes)

    def write_member(self, member: int, address: int, local: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``local`` to ``address`` of ``member``'s process."""
        _cma.write_to(int(self._ctl[member][PID]), address, local, nbytes)

    def publish_buffer(self, address: int) -> None:
        """Where this member's tensor of the current call is (before the call's post)."""
        self._ctl[self.index][BUFFER] = address

    def buffer_of(self, member: int) -> int:
        """The address of ``member``'s published tensor, in its process."""
        return int(self._ctl[member][BUFFER])
