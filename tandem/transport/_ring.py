"""A single-producer/single-consumer byte ring in a shared-memory segment.

Layout (one segment per direction of a pair of ranks; the consumer creates it)::

    byte 0     head   u64  bytes ever written  (producer stores; consumer futex-waits on it)
    byte 64    tail   u64  bytes ever read     (consumer stores; producer futex-waits on it)
    byte 128   the consumer is asleep (u64 flag)
    byte 192   the producer is asleep (u64 flag)
    byte 256   capacity   (u64, a power of two, written by the creator)
    byte 320   where the producer mapped this segment, and its pid (u64 each; for the
               consumer's cross-memory-attach probe, see ``_cma``)
    byte 384   the consumer may read the producer's memory (u64: 0 unknown, 1 yes, 2 no)
    byte 4096  data[capacity]

Messages are a byte stream (frames are the transport's business), so a payload
of any size streams through a ring of a few MiB: the producer copies in as much
as fits and publishes ``head``; the consumer copies out and publishes ``tail``.
Copies are ``memoryview`` slice assignments (one ``memmove`` each).

Correctness rests on x86-64 total store order: data is stored before the counter
that publishes it, and loads are not reordered with loads. The one reordering x86
allows, a load passing an earlier store, matters only for "publish, then is the
peer asleep?": a :func:`fence` sits between the two. A sleeper stores its flag
and lets the kernel compare the counter (``futex_wait`` orders both), so wake-ups
are never lost; the sleep has a timeout as a second line of defence anyway.

Waiting: poll the counter for ``spin`` seconds (the first 5 us holding the GIL,
then with ``sched_yield`` between checks, which hands the GIL to this process's
other threads and the CPU to other processes), then sleep on the futex. A sleeper
is woken by the peer's publish, or by its own process (peer lost, close), after
which ``check()`` decides whether to go on. The transport polls long only when
every local rank has a CPU of its own; see ``ShmTransport``.

Several threads of the consumer's process may take turns reading (one at a time, the
transport's lock decides): the reader thread that waits between frames
(:meth:`Ring.wait_readable`), and *watchers* (:meth:`Ring.watch`), threads that poll the
ring themselves while they wait for something, e.g. an RPC caller for its reply. While
a watcher polls, the producer is not asked to wake the idle reader thread: the watcher
reads the next frame itself, so no thread is woken just to hand it over.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Callable, Sequence

import numpy as np

from tandem.errors import ProtocolError
from tandem.transport._shmem import address_of, fence, futex_wait, futex_wake, reserve_more

__all__ = ["Ring", "DATA_OFFSET", "segment_size", "init_segment"]

DATA_OFFSET = 4096
_HEAD, _TAIL, _CSLEEP, _PSLEEP, _CAP = 0, 8, 16, 24, 32  # u64 indexes into the control page
_PADDR, _PPID, _CMA = 40, 41, 48
_SLEEP_S = 0.1  # futex timeout: how often a sleeper re-runs check() on its own
_HOT_S = 5e-6  # first part of a wait: poll holding the GIL (cheap, but blocks our other threads)
_BIG = 64 << 10  # copies this large release the GIL
_PIECE = 1 << 20  # most bytes copied before publishing (the consumer starts on them meanwhile)


def _copy(dst: memoryview, dst_a: np.ndarray | None, a: int, src: memoryview,
          src_a: np.ndarray | None, b: int, k: int) -> None:
    """dst[a:a+k] = src[b:b+k]; large copies release the GIL (numpy), small ones are cheaper
    as one memmove under it. Measured on 2 cores: streaming both ways at once, GIL-free
    copies let the reader and writer threads of a rank overlap (~1.5x)."""
    if k >= _BIG:
        d = dst_a if dst_a is not None else np.frombuffer(dst, dtype=np.uint8)
        s = src_a if src_a is not None else np.frombuffer(src, dtype=np.uint8)
        np.copyto(d[a:a + k], s[b:b + k])
    else:
        dst[a:a + k] = src[b:b + k]


_PAGE = 4096  # reservations grow in whole pages
_ALL = 1 << 62  # stream position below which every write lands in reserved memory
_INITIAL_DATA = 64 << 10


def initial_data(capacity: int) -> int:
    """Data bytes a new ring reserves at once: 64 KiB (small messages never need more)."""
    return min(capacity, _INITIAL_DATA)


def segment_size(capacity: int) -> int:
    return DATA_OFFSET + capacity


def init_segment(mm: mmap.mmap, capacity: int) -> None:
    """Write the capacity into a fresh (zeroed) segment."""
    memoryview(mm)[:DATA_OFFSET].cast("Q")[_CAP] = capacity


class Ring:
    """One direction of one pair: ``write`` on the producer side, ``read_into`` on the other.

    ``spin`` is how long a waiter polls before sleeping on the futex. Each side keeps
    its own counter in a local variable (only it stores that counter).
    """

    def __init__(self, mm: mmap.mmap, spin: float = 5e-6, fd: int | None = None,
                 where: str = "memory (memfd)") -> None:
        """``fd``: the producer's segment, of which only the first page and the data
        :func:`initial_data` are reserved; the producer reserves the rest as its writes
        first reach it (doubling) and closes ``fd`` once all is. A pair that exchanges
        only small messages (a barrier) then reserves 64 KiB, not 4 MiB."""
        self._mm = mm
        self._mv = memoryview(mm)
        self._ctl = self._mv[:DATA_OFFSET].cast("Q")
        cap = self._ctl[_CAP]
        if cap <= 0 or cap & (cap - 1) or len(mm) < DATA_OFFSET + cap:
            problem = f"shared-memory ring of {len(mm)} bytes announces capacity {cap}"
            self._release()
            raise ProtocolError(problem)
        self.capacity = cap
        self._mask = cap - 1
        self._data = self._mv[DATA_OFFSET:DATA_OFFSET + cap]
        self._array: np.ndarray | None = np.frombuffer(self._data, dtype=np.uint8)
        base = address_of(mm)
        self._head_addr = base + 8 * _HEAD
        self._tail_addr = base + 8 * _TAIL
        self._head = self._ctl[_HEAD]  # producer's copy
        self._tail = self._ctl[_TAIL]  # consumer's copy
        self._spin = spin
        # who needs the producer's wake-up on ``head`` (see ``_update_sleep_flag``)
        self._watch_lock = threading.Lock()
        self._watchers = 0
        self._idle_sleeper = False  # the reader thread sleeps between frames
        self._frame_sleeper = False  # a reader sleeps inside a frame
        self._closed = False
        self._fd = fd
        self._where = where
        # data bytes reserved: writes below this stream position touch reserved memory
        self._grown = min(cap, initial_data(cap)) if fd is not None else _ALL
        if self._grown >= cap:
            self._grown = _ALL  # the descriptor stays until handed over (``handed_over``)

    def descriptor(self) -> int | None:
        """The segment's descriptor (until all is reserved and it was handed over)."""
        return self._fd

    def handed_over(self) -> None:
        """The consumer has the segment: the descriptor is kept only to reserve more."""
        if self._grown == _ALL:
            self._all_reserved()

    def _grow(self, end: int) -> None:
        """Reserve data up to stream position ``end`` (at least double what was), before
        a write reaches it; once all is, the descriptor goes."""
        assert self._fd is not None
        want = min(self.capacity, -(-max(end, 2 * self._grown) // _PAGE) * _PAGE)
        reserve_more(self._fd, DATA_OFFSET + self._grown, want - self._grown, self._where)
        self._grown = want
        if want >= self.capacity:
            self._all_reserved()

    def _all_reserved(self) -> None:
        self._grown = _ALL
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- producer --------------------------------------------------------------------
    def free(self) -> int:
        """Bytes that can be written now without waiting."""
        return self.capacity - (self._head - self._ctl[_TAIL])

    def write(self, parts: Sequence[memoryview], check: Callable[[], None]) -> None:
        """Append ``parts`` (1-D byte views) in order and publish; wait for space as needed."""
        ctl, data, cap, mask = self._ctl, self._data, self.capacity, self._mask
        head = self._head
        if head + sum(len(p) for p in parts) > self._grown:
            self._grow(head + sum(len(p) for p in parts))
        published = ctl[_HEAD]
        for part in parts:
            off, n = 0, len(part)
            while off < n:
                free = cap - (head - ctl[_TAIL])
                if free == 0:
                    if head != published:
                        self._publish(_HEAD, head, _CSLEEP, self._head_addr)
                        published = head
                    self._wait(_TAIL, _PSLEEP, head - cap, self._tail_addr, check)
                    continue
                pos = head & mask
                k = min(n - off, free, cap - pos, _PIECE)
                _copy(data, self._array, pos, part, None, off, k)
                off += k
                head += k
                self._head = head  # copied in: part of the stream, published or not
                if k >= _BIG:  # let the consumer start on it while we copy the next
                    self._publish(_HEAD, head, _CSLEEP, self._head_addr)
                    published = head
        if head != published:
            self._publish(_HEAD, head, _CSLEEP, self._head_addr)

    def try_write(self, parts: Sequence[bytes | memoryview], wake: bool = True) -> bool:
        """Append ``parts`` (small 1-D byte buffers) and publish, if all of them fit in the
        free space now; False, writing nothing, if they do not. Never waits: the small-frame
        path of a sender that must not block (one slice assignment per part, one publish).
        ``wake=False`` publishes without waking a sleeping consumer: a frame that may wait
        until the next one wakes it."""
        head = self._head
        n = 0
        for part in parts:
            n += len(part)
        if n > self.capacity - (head - self._ctl[_TAIL]):
            return False
        if head + n > self._grown:
            self._grow(head + n)
        data, cap = self._data, self.capacity
        for part in parts:
            k = len(part)
            pos = head & self._mask
            if pos + k <= cap:
                data[pos:pos + k] = part
            else:  # wraps around the end of the ring
                first = cap - pos
                data[pos:] = part[:first]
                data[:k - first] = part[first:]
            head += k
        self._head = head
        if wake:
            self._publish(_HEAD, head, _CSLEEP, self._head_addr)
        else:
            self._ctl[_HEAD] = head
            fence()
        return True

    def _publish(self, word: int, value: int, flag: int, addr: int) -> None:
        ctl = self._ctl
        ctl[word] = value
        fence()
        if ctl[flag]:
            futex_wake(addr)

    # -- consumer --------------------------------------------------------------------
    def read_into(self, view: memoryview, check: Callable[[], None], release: bool = True) -> None:
        """Fill ``view`` (a 1-D byte view) with the next ``len(view)`` bytes; wait as needed.

        ``release=False`` leaves the space to the producer only at the next release
        (saves a fence on small reads that are followed by more).
        """
        ctl, data, cap, mask = self._ctl, self._data, self.capacity, self._mask
        tail = self._tail
        off, n = 0, len(view)
        while off < n:
            avail = ctl[_HEAD] - tail
            if avail == 0:
                if tail != ctl[_TAIL]:
                    self._publish(_TAIL, tail, _PSLEEP, self._tail_addr)
                self._wait(_HEAD, _CSLEEP, tail, self._head_addr, check)
                continue
            pos = tail & mask
            k = min(n - off, avail, cap - pos, _PIECE)
            _copy(view, None, off, data, self._array, pos, k)
            off += k
            tail += k
            self._tail = tail
            if k >= _BIG:
                self._publish(_TAIL, tail, _PSLEEP, self._tail_addr)
        if release and tail != ctl[_TAIL]:
            self._publish(_TAIL, tail, _PSLEEP, self._tail_addr)

    def peek(self, n: int) -> memoryview | None:
        """The next ``n`` unread bytes as a view of the ring itself, if all of them are
        there and do not wrap around its end; else None. Valid until :meth:`skip`."""
        tail = self._tail
        pos = tail & self._mask
        if self._ctl[_HEAD] - tail < n or pos + n > self.capacity:
            return None
        return self._data[pos:pos + n]

    def skip(self, n: int) -> None:
        """Count ``n`` peeked bytes as read (handed back to the producer at the next
        release)."""
        self._tail += n

    def release(self) -> None:
        """Hand everything read so far back to the producer."""
        if self._tail != self._ctl[_TAIL]:
            self._publish(_TAIL, self._tail, _PSLEEP, self._tail_addr)

    def empty(self) -> bool:
        return self._ctl[_HEAD] == self._tail

    # -- consumer: taking turns (the caller serialises reads; see the module docstring) --
    def watch(self, on: bool) -> None:
        """Start (``on``) or stop watching: this thread polls the ring itself meanwhile,
        so the idle reader thread need not be woken for the frames it reads."""
        with self._watch_lock:
            if self._closed:
                return
            self._watchers += 1 if on else -1
            self._update_sleep_flag()
            if not on and not self._watchers and self._idle_sleeper:
                fence()  # the flag is back: did a frame slip in while it was off?
                if self._ctl[_HEAD] != self._tail:
                    futex_wake(self._head_addr)

    def _update_sleep_flag(self) -> None:  # under _watch_lock
        # mid-frame sleepers always need the wake (watchers cannot read while a frame is
        # being read); the idle reader thread only while nobody polls
        need = self._frame_sleeper or (self._idle_sleeper and not self._watchers)
        self._ctl[_CSLEEP] = 1 if need else 0

    def wait_readable(self, check: Callable[[], None], busy: bool = False) -> None:
        """Return once unread bytes are there (the reader thread, between frames; it holds
        no lock meanwhile, so watchers may read frames and move ``_tail``). Polls first
        if no watcher polls already, or if ``busy`` (the caller just read a frame: in a
        burst, a reader that stays awake spares the producer a wake-up per frame);
        ``check()`` raises to give up."""
        ctl = self._ctl
        if busy or not self._watchers:
            end = time.perf_counter() + self._spin
            while ctl[_HEAD] == self._tail and time.perf_counter() < end:
                os.sched_yield()
        while ctl[_HEAD] == self._tail:
            check()
            stale = self._tail
            with self._watch_lock:
                self._idle_sleeper = True
                self._update_sleep_flag()
            try:
                fence()
                if ctl[_HEAD] == stale:
                    futex_wait(self._head_addr, stale, _SLEEP_S)
            finally:
                with self._watch_lock:
                    self._idle_sleeper = False
                    self._update_sleep_flag()

    # -- cross-memory attach (see ``_cma``) -------------------------------------------
    def announce(self, pid: int) -> None:
        """Producer: publish where this process mapped the segment, for the consumer's probe."""
        self._ctl[_PPID] = pid
        self._ctl[_PADDR] = address_of(self._mm)

    def producer_memory(self) -> tuple[int, int, int]:
        """Consumer: (producer pid, address there of the capacity word, its value); an
        address of 0 until the producer announced itself."""
        addr = self._ctl[_PADDR]
        return self._ctl[_PPID], addr + 8 * _CAP if addr else 0, self.capacity

    def set_readable(self, ok: bool) -> None:
        """Consumer: tell the producer whether its memory can be read from here."""
        self._ctl[_CMA] = 1 if ok else 2

    def readable(self) -> bool:
        """Producer: whether the consumer said it can read this process's memory."""
        return self._ctl[_CMA] == 1

    # -- waiting ---------------------------------------------------------------------
    def _wait(self, word: int, flag: int, stale: int, addr: int, check: Callable[[], None]) -> None:
        """Return once ``ctl[word] != stale``; ``check()`` raises to give up."""
        ctl = self._ctl
        now = time.perf_counter()
        hot, end = now + min(_HOT_S, self._spin), now + self._spin
        while True:  # poll under the GIL: only a few microseconds
            for _ in range(8):
                if ctl[word] != stale:
                    return
            if time.perf_counter() >= hot:
                break
        while time.perf_counter() < end:
            os.sched_yield()  # lets our other threads have the GIL and other processes the CPU
            if ctl[word] != stale:
                return
        check()
        self._sleeping(flag, True)
        try:
            while ctl[word] == stale:
                futex_wait(addr, stale, _SLEEP_S)
                check()
        finally:
            self._sleeping(flag, False)

    def _sleeping(self, flag: int, on: bool) -> None:
        if flag == _PSLEEP:
            self._ctl[flag] = 1 if on else 0
            return
        with self._watch_lock:
            self._frame_sleeper = on
            self._update_sleep_flag()

    def wake_local(self) -> None:
        """Wake this process's sleepers on either counter (they then run ``check()``)."""
        futex_wake(self._head_addr)
        futex_wake(self._tail_addr)

    # -- lifetime --------------------------------------------------------------------
    def _release(self) -> None:
        self._array = None
        for v in (getattr(self, "_data", None), self._ctl, self._mv):
            if v is not None:
                v.release()
        try:
            self._mm.close()
        except BufferError:  # a view is still in use somewhere; the GC unmaps it later
            pass

    def close(self) -> None:
        """Unmap; call only when no thread reads or writes the ring any more (watchers
        that start or stop later find it closed and do nothing)."""
        with self._watch_lock:
            self._closed = True
            self._release()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
