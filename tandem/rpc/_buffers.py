"""Memory for large received tensors, recycled once the user's tensor is freed.

A tensor read off the wire needs memory of its own. For a large one, fresh memory costs
more than the copy into it: the kernel faults in and zeroes every page on first touch
(measured on a 2-core VM: 16 MB read from a peer in ~2.5 ms into fresh memory, ~1,000
page faults, against ~1.5 ms and none into memory used before). So each large tensor
gets an anonymous mapping of its own, asked for as transparent huge pages (a 2 MB page
faults once where 512 small ones would), and when the last tensor or view on it is
freed the mapping goes back to a small cache here, ready for the next message of that
size: a worker that receives the same large tensors again and again (an echo, a
parameter server's gradients) reads them into memory that is already mapped.

    pool = ReceiveBuffers()
    t = pool.empty((4 << 20,), torch.float32)   # torch.empty's twin for large tensors
    pool.close()                                # drops the cache; live tensors stay valid

The cache is bounded (:data:`_CACHED`, :data:`_CACHED_BYTES`); a mapping that does not
fit is unmapped as soon as its tensor is gone. Nothing here reads or writes the memory:
the caller overwrites every byte (the codec reads the message into it).
"""

from __future__ import annotations

import collections
import ctypes
import math
import mmap
import threading
import weakref

import torch

__all__ = ["ReceiveBuffers", "LARGE"]

LARGE = 1 << 20  # tensors at least this large get a mapping of their own
_HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KB base pages)
_ROUND = 64 << 10  # mapping sizes are multiples of this (sizes that differ a little share)
_CACHED = 8  # mappings kept for reuse at most
_CACHED_BYTES = 256 << 20  # and at most this much memory in them


class ReceiveBuffers:
    """Hands out tensors on recycled anonymous mappings; one per RPC agent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # mapping size -> free mappings of that size, oldest first
        self._free: dict[int, collections.deque[mmap.mmap]] = {}
        self._count = 0
        self._bytes = 0
        self._closed = False

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor, like ``torch.empty(shape, dtype=dtype)``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < LARGE:
            return torch.empty(shape, dtype=dtype)
        # room to start at a huge-page boundary (only whole, aligned 2 MB stretches can be
        # huge pages); the pages of the slack are never touched, so they cost no memory
        size = -(-nbytes // _ROUND) * _ROUND + _HUGE
        area, offset = self._take(size, nbytes)
        view = memoryview(area)
        tensor = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
        # the tensor (and every view of it) keeps ``view`` alive: once the last is freed,
        # the mapping may serve another message
        weakref.finalize(view, self._give_back, area).atexit = False  # (exit unmaps all)
        del view
        return tensor.view(dtype).view(shape)

    def cached(self) -> int:
        """How many mappings wait for reuse (for tests)."""
        return self._count

    def close(self) -> None:
        """Unmap the cached mappings; tensors still alive keep theirs until freed."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, {}
            self._count = self._bytes = 0
        for areas in free.values():
            for area in areas:
                area.close()

    def _take(self, size: int, nbytes: int) -> tuple[mmap.mmap, int]:
        """A mapping of ``size`` bytes and the offset of its first huge-page boundary."""
        area: mmap.mmap | None = None
        with self._lock:
            areas = self._free.get(size)
            if areas:
                self._count -= 1
                self._bytes -= size
                area = areas.pop()  # the most recently used: likeliest still in cache
        if area is not None:
            return area, -_address(area) % _HUGE
        area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        offset = -_address(area) % _HUGE
        huge = nbytes // _HUGE * _HUGE  # only the whole huge pages the tensor fills: a
        # partly used one would cost up to 2 MB more than the tensor needs
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere small pages it is
            try:
                area.madvise(mmap.MADV_HUGEPAGE, offset, huge)
            except OSError:  # a kernel without transparent huge pages
                pass
        return area, offset

    def _give_back(self, area: mmap.mmap) -> None:
        """The last tensor on ``area`` was freed (runs in whichever thread freed it)."""
        size = len(area)
        with self._lock:
            if not self._closed and self._count < _CACHED and \
                    self._bytes + size <= _CACHED_BYTES:
                self._free.setdefault(size, collections.deque()).append(area)
                self._count += 1
                self._bytes += size
                return
        area.close()  # the cache is full: unmapped now rather than at garbage collection


def _address(area: mmap.mmap) -> int:
    """The address of a mapping's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(area))
