"""The mailbox: matches arriving messages with posted receives, for one rank and all peers.

Receivers *post* a buffer for a message key before or after it arrives:

* posted first: the payload is read straight into the posted memory (no copy);
* arrived first: it is parked in a temporary buffer and copied when posted; a
  receive posted while the parked payload is still being read is completed by
  the reader when it is whole, or failed with the sender's loss: it never waits
  on the reader.

Parked memory is bounded: beyond ``park_limit`` bytes (one message of any size is
always taken), a further early message fails its group, here and at the sender,
naming the peer and the bytes. Mismatch detection is in :mod:`.mismatch`, failure
bookkeeping in :mod:`.failures`; the transport tells peers about aborts.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from tandem.errors import PeerLostError, StateError, TandemError
from tandem.transport import mismatch as mm
from tandem.transport.failures import Failures, decode_error
from tandem.transport.message import Handler, Header, Key, Kind, Reader, Slot

__all__ = ["Mailbox", "DEFAULT_PARK_LIMIT"]

# enum members as module constants: looking one up on its class costs ~10x a global
_ABORT = Kind.ABORT
_BYE = Kind.BYE
_STATE = Kind.STATE
_COLL = Kind.COLL

DEFAULT_PARK_LIMIT = 1 << 30  # bytes of early messages held at once, beyond the first
_DRAIN = 1 << 20  # a refused payload is read away in pieces this large


def _drain(read: Reader, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, _DRAIN)))
    left = nbytes
    while left:
        k = min(left, len(scratch))
        read(scratch[:k])
        left -= k


class Mailbox:
    """Posted receives, parked arrivals and wildcard receives of one rank."""

    def __init__(self, rank: int, park_limit: int = DEFAULT_PARK_LIMIT) -> None:
        self.rank = rank
        self.park_limit = park_limit
        self.failures = Failures(rank)
        self.history = mm.History(rank)
        self._lock = threading.Lock()
        self._posted: dict[Key, Slot] = {}
        self._parked: dict[Key, Slot] = {}
        self._parked_bytes = 0
        self._filling: dict[int, Slot] = {}  # per peer: the parked message being read
        self._wild: list[tuple[Callable[[int, Header], bool], Slot]] = []
        # set by the transport: tell ``peers`` that ``group`` failed with ``error``
        self.reply: Callable[[list[int], int, TandemError], None] | None = None
        self._members: dict[int, list[int]] = {}  # group -> its global ranks (know_members)
        self._handlers: dict[int, Handler] = {}

    def handle(self, kind: int, handler: Handler | None) -> None:
        """Hand every message of ``kind`` to ``handler(peer, header, read)`` instead of
        matching it with a posted receive (for messages that arrive unsolicited, of sizes
        nobody can post for: RPC). The handler runs on the reader's thread, must consume
        exactly ``header.nbytes`` through ``read`` (each call fills a view with the next
        bytes) and must not raise. ``None`` removes it."""
        if handler is None:
            self._handlers.pop(kind, None)
        else:
            self._handlers[kind] = handler

    # -- receiving side (called by the transport's reader for ``peer``) ----------------
    def arrive(self, peer: int, header: Header, read: Reader) -> None:
        """Deliver one message; ``read(view)`` fills ``view`` with the next payload bytes."""
        if self._handlers:
            handler = self._handlers.get(header.kind)
            if handler is not None:
                handler(peer, header, read)
                return
        if header.kind == _BYE:
            _drain(read, header.nbytes)
            self.failures.depart(peer)
            return
        if header.kind == _STATE:  # a stall question with no watchdog here to answer it
            _drain(read, header.nbytes)
            return
        if header.kind == _ABORT:
            buf = bytearray(header.nbytes)
            read(memoryview(buf))
            reporter, reported = decode_error(header.step, bytes(buf))
            self.failures.report(header.group, reporter, reported)
            self.abort_group(header.group, reported)
            return
        key = (peer, header.kind, header.group, header.seq, header.step)
        refused: TandemError | None = None
        clash: list[Slot] = []
        dropped = False
        with self._lock:
            slot = self._posted.pop(key, None)
            if slot is None:
                slot = self._take_wild(peer, header)
            if slot is None:
                refused = self.history.stray(peer, header) or self._over_limit(peer, header)
                # nothing of a failed group is ever received: keep nothing for it
                dropped = refused is None and self.failures.aborted(header.group) is not None
                if refused is None and not dropped:
                    slot = self._park(peer, key, header)
                    clash = mm.clashing_posts(self._posted, header)
                    for s in clash:
                        del self._posted[s.key]
        if refused is not None:
            _drain(read, header.nbytes)  # never combine, never hold
            self._reject(peer, header.group, refused)
            return
        if dropped:
            _drain(read, header.nbytes)
            return
        assert slot is not None
        if slot.parked is not None:
            for victim in clash:  # our own call for this sequence number is a different one
                victim.finish(None, mm.mismatch(victim, header, self.rank, peer))
            self._fill_parked(peer, slot, read)
            return
        error = mm.check(slot, header, self.rank)
        if error is not None:
            _drain(read, header.nbytes)
            slot.finish(header, error)
            return
        assert slot.view is not None
        read(slot.view)
        slot.finish(header)

    def _over_limit(self, peer: int, header: Header) -> TandemError | None:
        """Parking ``header``'s payload would exceed the cap (lock held)."""
        held = self._parked_bytes
        if not held or held + header.nbytes <= self.park_limit:
            return None
        return StateError(
            f"rank {peer} sent a {header.nbytes}-byte message (group {header.group}) that rank "
            f"{self.rank} has posted no receive for, while {held} bytes of earlier such "
            f"messages wait to be received; the cap on early messages is {self.park_limit} "
            f"bytes: post receives sooner, or send less ahead of them")

    def _park(self, peer: int, key: Key, header: Header) -> Slot:
        parked = Slot(peer, key, None, b"")
        parked.header = header
        parked.parked = bytearray(header.nbytes)
        parked.counted = True
        self._parked[key] = parked
        self._parked_bytes += header.nbytes
        self._filling[peer] = parked
        return parked

    def _fill_parked(self, peer: int, parked: Slot, read: Reader) -> None:
        assert parked.parked is not None
        try:
            read(memoryview(parked.parked))
        except BaseException:
            with self._lock:  # the reader reports the loss (peer_lost) with its cause
                if self._parked.get(parked.key) is parked:
                    del self._parked[parked.key]
                self._free(parked)
            raise
        with self._lock:
            if self._filling.get(peer) is parked:
                del self._filling[peer]
            parked.event.set()  # whole; a receive posted from now on copies it at once
            waiter, parked.waiter = parked.waiter, None
            if waiter is not None:
                self._free(parked)
        if waiter is not None:
            self._complete_from_parked(waiter, parked)

    def _free(self, parked: Slot) -> None:
        """Stop counting a parked payload against the cap (lock held); once, whatever the
        path. Its buffer lives on until its copy is made (see _complete_from_parked)."""
        if parked.counted:
            parked.counted = False
            self._parked_bytes -= parked.nbytes

    def _take_wild(self, peer: int, header: Header) -> Slot | None:
        for i, (match, slot) in enumerate(self._wild):
            if match(peer, header):
                del self._wild[i]
                slot.peer = peer
                return slot
        return None

    def know_members(self, group: int, ranks: list[int]) -> None:
        """``group``'s global ranks: a clash this rank finds is told to all of them."""
        self._members[group] = list(ranks)

    def _reject(self, peer: int, group: int, error: TandemError) -> None:
        # every member, not only ``peer``: a root still waiting for a rank that called
        # another collective would otherwise wait out its whole timeout
        self.abort_group(group, error)
        if self.reply is not None:
            self.reply(self._members.get(group, [peer]), group, error)

    def finished(self, group: int, seq: int, sig: bytes, site: bytes,
                 recorded: bool = False) -> None:
        """Record that this rank completed call ``seq``; leftovers for it are strays.

        ``recorded``: the group's flight recorder shows the call as completed already
        (see :meth:`History.follow`), so it is not kept twice."""
        with self._lock:
            if not recorded:
                self.history.record(group, seq, sig, site)
            if not self._parked:  # the common case: a 4 KB all_reduce's every call
                return
            strays = [s for k, s in self._parked.items() if k[1] == _COLL and k[2] == group
                      and k[3] == seq and s.event.is_set()]
            for s in strays:
                del self._parked[s.key]
                self._free(s)
        for s in strays:
            assert s.header is not None
            error = self.history.stray(s.peer, s.header)
            if error is not None:
                self._reject(s.peer, group, error)

    def unreceived(self, kind: int, group: int) -> list[tuple[int, int, int]]:
        """(sender, step, bytes) of each message of ``kind`` on ``group`` that arrived and
        that no receive has taken, in arrival order."""
        with self._lock:
            return [(k[0], k[4], s.nbytes) for k, s in self._parked.items()
                    if k[1] == kind and k[2] == group]

    def parked_call(self, group: int, seq: int,
                    besides: bytes | None = None) -> tuple[int, Header] | None:
        """A collective message of call ``seq`` on ``group`` that nobody has received yet
        (sender, header). A call that moves no messages uses it to spot a peer whose call
        of the same number does; one that moves some passes its signature as
        ``besides``, so that its own early messages do not hide another call's."""
        with self._lock:
            for k, parked in self._parked.items():
                if (k[1] == _COLL and k[2] == group and k[3] == seq and parked.header
                        and parked.header.sig != besides):
                    return k[0], parked.header
        return None

    # -- posting side ----------------------------------------------------------------
    def post(self, peer: int, kind: int, group: int, seq: int, step: int,
             view: memoryview, sig: bytes = b"", site: bytes = b"") -> Slot:
        key = (peer, kind, group, seq, step)
        slot = Slot(peer, key, view, sig, site)
        failure: TandemError | None = None
        clash = None
        early = None
        with self._lock:
            # a failed group receives nothing more, not even what arrived before it failed
            failure = self.failures.aborted(group)
            if failure is None:
                early = self._parked.pop(key, None)
                if early is None:
                    failure = self.failures.failure(peer, group)
                    if failure is None:
                        clash = mm.clashing_arrival(self._parked.values(), kind, group, seq, sig)
                    if failure is None and clash is None:
                        self._posted[key] = slot
                elif early.event.is_set():
                    self._free(early)
                else:
                    early.waiter = slot  # the reader completes it (or fails it with the loss)
        if early is not None:
            if early.event.is_set():
                self._complete_from_parked(slot, early)
            return slot
        if clash is not None:
            assert clash.header is not None
            failure = mm.mismatch(slot, clash.header, self.rank, clash.peer)
        if failure is not None:
            slot.finish(None, failure)
        return slot

    def post_any(self, peers: Iterable[int], kind: int, group: int, view: memoryview,
                 match: Callable[[int, Header], bool], sig: bytes = b"") -> Slot:
        """Post a receive that any of ``peers`` may satisfy (``recv(src=None)``)."""
        slot = Slot(-1, (-1, kind, group, -1, -1), view, sig)
        failure: TandemError | None = None
        with self._lock:
            early = None
            failed = self.failures.aborted(group)
            for key, parked in () if failed else self._parked.items():
                if parked.header is not None and match(key[0], parked.header):
                    early = self._parked.pop(key)
                    slot.peer = key[0]
                    break
            if early is None:
                failure = failed
                if failure is None:
                    self._wild.append((match, slot))
            elif early.event.is_set():
                self._free(early)
            else:
                early.waiter = slot
        if early is not None:
            if early.event.is_set():
                self._complete_from_parked(slot, early)
            return slot
        if failure is not None:
            slot.finish(None, failure)
        return slot

    def _complete_from_parked(self, slot: Slot, early: Slot) -> None:
        header = early.header
        assert header is not None and early.parked is not None
        error = mm.check(slot, header, self.rank)
        if error is None and slot.view is not None:
            slot.view[: header.nbytes] = early.parked
        early.parked = None
        slot.finish(header, error)

    def cancel(self, slot: Slot) -> None:
        """Withdraw a receive (its deadline passed): nothing is written into it later."""
        with self._lock:
            self._posted.pop(slot.key, None)
            self._wild = [(m, s) for m, s in self._wild if s is not slot]
            for parked in self._filling.values():
                if parked.waiter is slot:
                    parked.waiter = None

    # -- failures --------------------------------------------------------------------
    def peer_lost(self, peer: int, error: PeerLostError) -> None:
        """``peer``'s connection is gone: it crashed (every wait on its group fails), or,
        after a goodbye, it left (only what waits on it fails)."""
        with self._lock:
            error = self.failures.lose(peer, error)
            victims = [s for k, s in self._posted.items() if k[0] == peer]
            for s in victims:
                del self._posted[s.key]
            cut = self._filling.pop(peer, None)
            waiter = None
            if cut is not None:
                waiter, cut.waiter = cut.waiter, None
                if self._parked.get(cut.key) is cut:
                    del self._parked[cut.key]
                self._free(cut)
        if waiter is not None:
            waiter.finish(None, error)
        for s in victims:
            s.finish(None, error)

    def abort_group(self, group: int, error: TandemError, quiet: bool = False) -> None:
        """Fail every receive of ``group`` here, now and later, with ``error`` (``quiet``:
        for this rank's own reasons, see ``Failures.abort``)."""
        self.failures.abort(group, error, quiet)
        with self._lock:
            victims = [s for k, s in self._posted.items() if k[2] == group]
            for s in victims:
                del self._posted[s.key]
            wild = [s for _, s in self._wild if s.key[2] == group]
            self._wild = [(m, s) for m, s in self._wild if s.key[2] != group]
            waiting = [p.waiter for p in self._filling.values()
                       if p.waiter is not None and p.waiter.key[2] == group]
            for p in self._filling.values():
                if p.waiter is not None and p.waiter.key[2] == group:
                    p.waiter = None
            # what arrived early will never be received (see post): let it go
            early = [k for k, p in self._parked.items() if k[2] == group and p.event.is_set()]
            for k in early:
                self._free(self._parked.pop(k))
        for s in victims + wild + waiting:
            s.finish(None, error)

    def close(self, error: TandemError) -> None:
        """Fail every receive, now and later, with ``error``; drop parked messages."""
        self.failures.close(error)
        with self._lock:
            victims = list(self._posted.values()) + [s for _, s in self._wild]
            victims += [p.waiter for p in self._filling.values() if p.waiter is not None]
            self._posted.clear()
            self._wild.clear()
            for p in self._parked.values():
                self._free(p)
            self._parked.clear()
            for p in self._filling.values():
                p.waiter = None
        for s in victims:
            s.finish(None, error)
