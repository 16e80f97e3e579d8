"""What a transport moves and what a receiver waits on: ``Kind``, ``Header``, ``Slot``.

A message is a :class:`Header` and a payload. A receive *posts* a :class:`Slot` for
a message key ``(peer, kind, group, seq, step)``; the slot's ``event`` is set when
the payload is in the posted memory, or when the receive failed (``error``)::

    slot = transport.irecv(peer, Kind.P2P, group, seq, tag, memoryview(buf))
    transport.wait([slot], deadline, lambda: "recv from rank 1", peers=[peer])
"""

from __future__ import annotations

import enum
import threading
from typing import Callable, NamedTuple

__all__ = ["Kind", "Header", "Flag", "Slot", "Key", "Reader", "Handler", "SIG_MAX", "reader_of"]

# a frame carries the signature's and the call site's lengths in 16 bits each
SIG_MAX = 0xFFFF


class Kind(enum.IntEnum):
    """Message kinds (one byte on the wire)."""

    COLL = 1  # collective data: key is (group, seq, step)
    P2P = 2  # point-to-point: key is (group, per-pair counter, tag)
    ABORT = 3  # a rank aborted a group; payload says which error (see failures)
    BYE = 4  # the sender is closing its transport on purpose (destroy_process_group)
    RPC = 5  # an RPC message: consumed by the handler registered for it (Mailbox.handle)
    STATE = 6  # a stall report's question or answer (collectives.watchdog); step 0 or 1


class Header(NamedTuple):
    """A message's header: its kind and key, payload size, signature and call site.

    Immutable; a named tuple because every message builds one on each side (measured:
    0.3 us against 1.06 us for a frozen dataclass)."""

    kind: int
    group: int
    seq: int
    step: int
    nbytes: int
    sig: bytes = b""
    site: bytes = b""


Key = tuple[int, int, int, int, int]  # (peer, kind, group, seq, step)
Reader = Callable[[memoryview], None]  # fills its argument with the next payload bytes
Handler = Callable[[int, "Header", Reader], None]  # (peer, header, read): see Mailbox.handle


def reader_of(data: memoryview) -> Reader:
    """A :data:`Reader` over a payload already in memory (1-D bytes)."""
    at = 0

    def read(view: memoryview) -> None:
        nonlocal at
        view[:] = data[at:at + len(view)]
        at += len(view)

    return read


class Flag:
    """A one-shot event: ``set`` once, ``wait`` with a timeout, ``is_set``.

    ``threading.Event`` builds a Condition and two locks per instance; a transport makes
    one of these per message, so this is a single pre-acquired lock released by ``set``
    (measured: Event construction was 12% of the main thread's time in a chunked ring).
    """

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            try:
                self._lock.release()
            except RuntimeError:  # a concurrent set() released it first
                pass

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # wake the next waiter too
            return True
        return self._set


class Slot:
    """One posted receive, one send in flight, or a parked early arrival.

    A parked arrival being read has ``parked`` set and ``event`` clear; a receive
    posted for it meanwhile waits in ``waiter`` and is completed by the reader.
    """

    __slots__ = ("peer", "key", "view", "sig", "site", "event", "header", "error", "parked",
                 "on_done", "waiter", "counted")

    def __init__(self, peer: int, key: Key, view: memoryview | None, sig: bytes,
                 site: bytes = b"") -> None:
        self.peer = peer
        self.key = key
        self.view = view
        self.sig = sig
        self.site = site
        self.event = Flag()
        self.header: Header | None = None
        self.error: BaseException | None = None
        self.parked: bytearray | None = None
        self.on_done: Callable[[Slot], None] | None = None
        self.waiter: Slot | None = None
        self.counted = False  # a parked payload counted against the mailbox's cap

    def done(self) -> bool:
        return self.event.is_set()

    def finish(self, header: Header | None, error: BaseException | None = None) -> None:
        if self.event.is_set():
            return
        self.header = header
        self.error = error
        self.event.set()
        if self.on_done is not None:
            self.on_done(self)

    @property
    def nbytes(self) -> int:
        return self.header.nbytes if self.header is not None else 0
