"""A peer's queue of frames waiting for its writer thread, bounded in bytes and messages.

A send that cannot be written at once is queued; the payload is not copied, so the
queue holds the caller's memory until the writer is done with it. A peer that stops
reading (a stopped or stuck process) would let that grow without end; past the
limits a send is refused at once with an error naming the peer and the bytes
queued. The first frame is always taken, so one message of any size can be sent::

    q = SendQueue(me=0, peer=1)
    q.push((parts, header, slot))        # raises NetworkError past the limits
    parts, header, slot = q.popleft()
"""

from __future__ import annotations

import collections
from typing import Iterable

from tandem.errors import NetworkError
from tandem.transport.message import Header, Slot

__all__ = ["SendQueue", "Entry", "DEFAULT_SEND_LIMIT", "DEFAULT_SEND_COUNT", "BoundedSends"]

DEFAULT_SEND_LIMIT = 1 << 30  # payload bytes queued for one peer, beyond the first frame
DEFAULT_SEND_COUNT = 1 << 16  # frames queued for one peer

Entry = tuple[list[memoryview], Header, Slot]


def _size(entry: Entry) -> int:
    return sum(len(p) for p in entry[0])


class SendQueue:
    """Frames for one peer, oldest first. Not thread-safe: the caller holds its lock."""

    def __init__(self, me: int, peer: int, limit: int = DEFAULT_SEND_LIMIT,
                 count: int = DEFAULT_SEND_COUNT) -> None:
        self.me = me
        self.peer = peer
        self.limit = limit
        self.count = count
        self.bytes = 0
        self.held = 0  # bytes sent by reference, not yet acknowledged (``hold``)
        self.held_count = 0
        self._items: collections.deque[Entry] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def push(self, entry: Entry, front: bool = False) -> None:
        """Queue ``entry`` (``front``: the rest of a frame already begun, always taken)."""
        n = _size(entry)
        if not front and self._items:
            self._check_room(n)
        if front:
            self._items.appendleft(entry)
        else:
            self._items.append(entry)
        self.bytes += n

    def _check_room(self, n: int) -> None:
        bytes_, count = self.bytes + self.held, len(self._items) + self.held_count
        if bytes_ + n > self.limit or count >= self.count:
            raise NetworkError(
                f"rank {self.me} has {bytes_} bytes in {count} messages queued "
                f"for rank {self.peer}, which is not reading them (stopped or stuck?); the "
                f"cap is {self.limit} bytes and {self.count} messages: wait for earlier "
                f"sends to complete before queueing more")

    def hold(self, n: int) -> None:
        """Count ``n`` bytes the peer has yet to take from the sender's memory (a send by
        reference) against the same caps; the first is always taken. ``release`` undoes."""
        if self.held_count or self._items:
            self._check_room(n)
        self.held += n
        self.held_count += 1

    def release(self, n: int) -> None:
        self.held -= n
        self.held_count -= 1

    def first(self) -> Entry:
        return self._items[0]

    def popleft(self) -> Entry:
        entry = self._items.popleft()
        self.bytes -= _size(entry)
        return entry

    def drain(self) -> list[Entry]:
        """Remove and return everything queued (the transport is closing)."""
        items = list(self._items)
        self._items.clear()
        self.bytes = 0
        return items


class BoundedSends:
    """For a transport with a send queue per peer: one knob for all of them."""

    _send_limit: int

    def _send_queues(self) -> Iterable[SendQueue]:
        raise NotImplementedError

    @property
    def send_limit(self) -> int:
        """Bytes that may wait in one peer's send queue before a send is refused."""
        return self._send_limit

    @send_limit.setter
    def send_limit(self, value: int) -> None:
        self._send_limit = value
        for q in self._send_queues():
            q.limit = value
