"""Shared memory lent to a peer: large RPC tensors in one copy, received as views.

Going by reference (:mod:`~tandem.transport._cma`) costs the receiver a
``process_vm_readv`` into its own memory, which pins the sender's pages on the way:
measured on a 2-core VM, 3.2-4.4 ms per 16 MB against 1.2-1.8 ms for a memcpy. So a
large piece of an RPC message is instead *lent*: the sender copies it into a shared
segment of its own (a memfd, handed to the peer once over the authenticated socket,
then reused), and the receiver's tensor is a view of that segment, with no copy at all
on its side. When the receiver's last view of the piece is freed, the receiver
returns the segment (a frame on the ring) and the sender may fill it again; a segment
is never written while a view of it lives. A view stays valid for as long as it lives,
even after the sender exits: the receiver's mapping keeps the memory.

The sender's segments for one peer are bounded (:func:`lend_budget`): a receiver that
keeps many received tensors alive makes the sender fall back to going by reference
(or through the ring), never grow. A free segment of a size no longer asked for is
dropped (unmapped, and the receiver told) to make room.

    lender = Lender(budget, shm_dir, offer)     # offer(key, fd, size) hands the fd over
    key, address = lender.take(nbytes)          # None when the budget is used up
    lender.returned(key)                        # the receiver freed its views
    borrowed = Borrowed(accept)                 # accept(key) -> the peer's mapping
    view = borrowed.view(key, nbytes)
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import threading
import weakref
from typing import Callable, Protocol

from tandem.errors import ProtocolError
from tandem.transport._cma import address_of_view
from tandem.transport._ring import Ring
from tandem.transport._shmem import create_segment

__all__ = ["Lender", "Borrowed", "LentReader", "lend_budget", "LEND_MIN", "KEY_BIT"]

# Pieces at least this large are lent (only in RPC messages, whose receiver keeps the
# memory as a tensor; a posted receive would copy it out again).
LEND_MIN = 1 << 20
KEY_BIT = 1 << 62  # lent segments' keys on the socket, apart from arena keys
_ROUND = 1 << 20  # segment sizes are multiples of this, so near sizes share segments
_MAX_BORROWED = 4096  # mappings a receiver keeps per peer at most (a sane peer keeps fewer)


def lend_budget(peers: int) -> int:
    """Bytes of segments this rank lends one peer at most: 128 MiB, shrinking with more
    local peers to 32 MiB (memory is used only as large messages need it)."""
    return max(32 << 20, min(128 << 20, (256 << 20) // max(1, peers)))


class Lender:
    """The segments this rank lends one peer: made on demand, reused once returned."""

    def __init__(self, budget: int, shm_dir: str | None,
                 offer: Callable[[int, int, int], None],
                 drop: Callable[[int], None]) -> None:
        self._lock = threading.Lock()
        self._budget = budget
        self._shm_dir = shm_dir
        self._offer = offer  # hands a new segment's descriptor to the peer
        self._drop = drop  # tells the peer a segment is gone
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}  # key -> (mapping, address)
        self._free: dict[int, list[int]] = {}  # size -> keys not lent now
        self._lent: set[int] = set()
        self._bytes = 0  # in all segments, lent or free
        self._keys = itertools.count(1)
        self._closed = False

    def take(self, nbytes: int) -> tuple[int, int, mmap.mmap] | None:
        """A free segment of at least ``nbytes``, now lent: (key, address, mapping); None
        when none fits the budget (the caller sends another way). The caller holds the
        mapping while it writes: :meth:`close` leaves a mapping to the last holder."""
        size = -(-nbytes // _ROUND) * _ROUND
        if size > self._budget // 2:
            return None
        dropped: list[tuple[int, mmap.mmap]] = []
        with self._lock:
            if self._closed:
                return None
            keys = self._free.get(size)
            if keys:
                key = keys.pop()
                self._lent.add(key)
                return (key, *self._maps[key][::-1])
            while self._bytes + size > self._budget and self._free:
                # a free segment of another size makes room (the receiver unmaps it)
                other = next(iter(self._free))
                old = self._free[other].pop()
                if not self._free[other]:
                    del self._free[other]
                dropped.append((old, self._maps.pop(old)[0]))
                self._bytes -= other
            if self._bytes + size > self._budget:
                key = 0
            else:
                key = next(self._keys)
                self._bytes += size
        for old, area in dropped:
            area.close()
            self._drop(old)
        if not key:
            return None
        try:
            fd = create_segment(size, self._shm_dir, "tandem-lend")
            try:
                area = mmap.mmap(fd, size)
                try:
                    self._offer(key, fd, size)
                except BaseException:
                    area.close()
                    raise
            finally:
                os.close(fd)
        except Exception:  # noqa: BLE001 - no memory to lend, or the peer is gone: the
            with self._lock:  # message goes another way, which reports a lost peer
                self._bytes -= size
            return None
        address = address_of_view(memoryview(area))
        with self._lock:
            if self._closed:
                return None
            self._maps[key] = (area, address)
            self._lent.add(key)
        return key, address, area

    def returned(self, key: int) -> None:
        """The peer freed every view of segment ``key``: it may be filled again."""
        with self._lock:
            if self._closed:
                return
            if key not in self._lent:
                raise ProtocolError(f"segment {key} was returned but is not lent")
            self._lent.discard(key)
            self._free.setdefault(len(self._maps[key][0]), []).append(key)

    def untake(self, key: int) -> None:
        """A segment taken but never sent (the send failed first)."""
        self.returned(key)

    def segments(self) -> tuple[int, int]:
        """(segments, of them lent now), for tests."""
        with self._lock:
            return len(self._maps), len(self._lent)

    def close(self) -> None:
        """Forget every segment: each is unmapped here once no thread writes into it (the
        peer's mappings, and its views, stay valid)."""
        with self._lock:
            self._closed = True
            self._maps = {}
            self._free.clear()
            self._lent.clear()


class Borrowed:
    """The segments one peer lent this rank, mapped once each and kept for reuse."""

    def __init__(self, accept: Callable[[int], mmap.mmap]) -> None:
        self._accept = accept  # waits for the descriptor the peer sent for a key
        self._maps: dict[int, tuple[mmap.mmap, int]] = {}  # key -> (mapping, address)

    def find(self, key: int, nbytes: int) -> tuple[mmap.mmap, int]:
        """The mapping of segment ``key`` and its address (under the peer's read lock)."""
        entry = self._maps.get(key)
        if entry is None:
            if len(self._maps) >= _MAX_BORROWED:
                raise ProtocolError(f"a peer lent more than {_MAX_BORROWED} segments")
            area = self._accept(key)
            entry = self._maps[key] = (area, address_of_view(memoryview(area)))
        if nbytes > len(entry[0]):
            raise ProtocolError(f"a {nbytes}-byte piece in a {len(entry[0])}-byte segment")
        return entry

    def drop(self, key: int) -> None:
        """The peer dropped segment ``key`` (it was returned: no view of it lives)."""
        self._maps.pop(key, None)

    def clear(self) -> None:
        """Forget every mapping; views still alive keep theirs."""
        self._maps.clear()


class _Peer(Protocol):
    """What a :class:`LentReader` needs of the receiving peer."""

    rank: int

    @property
    def inbound(self) -> Ring: ...

    def give_back(self, key: int) -> None: ...


class LentReader:
    """Reads a frame with lent pieces: ``read(view)`` copies (out of the ring, or out of
    a lent segment), ``read.lend(nbytes)`` gives the next piece itself as a writable
    view when it is a whole lent piece of exactly that size (else None)."""

    def __init__(self, peer: "_Peer",
                 spans: list[tuple[tuple[mmap.mmap, int] | None, int, int]],
                 check: Callable[[], None]) -> None:
        self._peer = peer
        self._spans = spans  # ((mapping, address) or None for ring bytes, key, length)
        self._check = check
        self._at = 0  # the span being read
        self._off = 0  # bytes of it read
        self._kept: set[int] = set()  # keys whose views the receiver holds

    def finished(self) -> bool:
        return self._at == len(self._spans)

    def lend(self, nbytes: int) -> memoryview | None:
        if self._at == len(self._spans) or self._off:
            return None
        mapped, key, n = self._spans[self._at]
        if mapped is None or n != nbytes:
            return None
        view = memoryview(mapped[0])[:n]
        self._kept.add(key)
        self._at += 1
        # every tensor on it keeps ``view`` alive: once the last is freed, the sender may
        # fill the segment again (never sooner: the view would see other bytes)
        weakref.finalize(view, self._peer.give_back, key).atexit = False
        return view

    def __call__(self, view: memoryview) -> None:
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        got, want = 0, len(view)
        while got < want:
            if self._at == len(self._spans):
                raise ProtocolError(f"read past the end of a message from rank "
                                    f"{self._peer.rank}")
            mapped, _, n = self._spans[self._at]
            k = min(want - got, n - self._off)
            if mapped is None:
                self._peer.inbound.read_into(view[got:got + k], self._check, release=False)
            else:
                ctypes.memmove(address_of_view(view) + got, mapped[1] + self._off, k)
            got += k
            self._off += k
            if self._off == n:
                self._at += 1
                self._off = 0

    def settle(self) -> None:
        """Give back every lent piece that no view holds (copied out, or never read)."""
        for _, key, _ in self._spans:
            if key and key not in self._kept:
                self._peer.give_back(key)
