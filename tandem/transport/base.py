"""The ``Transport`` seam: tagged byte messages between ranks, with posted receives.

A transport connects one rank to every other rank of a job and moves messages.
Each message has a :class:`Header` (kind, group, sequence number, step, size, the
sender's signature of the operation and its call site) and a payload. Receivers
*post* a buffer for a message key before or after it arrives:

* posted first: the payload is read straight into the posted memory (no copy);
* arrived first: it is parked in a temporary buffer and copied when posted.

Before a payload touches posted memory, the sender's signature is compared with
the receiver's; a mismatch fails the receive with ``CollectiveMismatchError`` and
the payload is discarded, so mismatched collectives never combine data.

Implementations (tcp, loopback) only deliver bytes; matching, signatures, dead
peers and aborts live here, written once.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from tandem.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    ProtocolError,
    StateError,
    TandemError,
)

if TYPE_CHECKING:
    from tandem.transport._arena import Arena

__all__ = ["Kind", "Header", "Slot", "Mailbox", "Transport", "check_size", "encode_error",
           "decode_error"]


class Kind:
    """Message kinds (one byte on the wire)."""

    COLL = 1  # collective data: key is (group, seq, step)
    P2P = 2  # point-to-point: key is (group, per-pair counter, tag)
    ABORT = 3  # a rank aborted a group; payload is the UTF-8 reason
    BYE = 4  # the sender is closing its transport on purpose (destroy_process_group)
    RPC = 5  # an RPC message: consumed by the handler registered for it (Mailbox.handle)


@dataclasses.dataclass(frozen=True)
class Header:
    kind: int
    group: int
    seq: int
    step: int
    nbytes: int
    sig: bytes = b""
    site: bytes = b""


# An ABORT message's ``step`` says which error the receivers raise.
ABORT_CODES: dict[int, type[TandemError]] = {
    0: StateError,
    1: CollectiveMismatchError,
    2: CollectiveTimeoutError,
    3: PeerLostError,
}

Key = tuple[int, int, int, int, int]  # (peer, kind, group, seq, step)


def encode_error(error: TandemError, reporter: int) -> bytes:
    """An ABORT payload: the details other ranks need to rebuild ``error``."""
    missing = ",".join(map(str, getattr(error, "missing", ())))
    lost = getattr(error, "rank", -1)
    return f"{missing};{lost}\n[reported by rank {reporter}] {error}".encode()


def decode_error(code: int, data: bytes) -> TandemError:
    head, _, text = data.decode(errors="replace").partition("\n")
    missing_text, _, lost_text = head.partition(";")
    error_type = ABORT_CODES.get(code, StateError)
    if error_type is CollectiveTimeoutError:
        missing = tuple(int(m) for m in missing_text.split(",") if m.strip().lstrip("-").isdigit())
        return CollectiveTimeoutError(text, missing)
    if error_type is PeerLostError:
        return PeerLostError(text, int(lost_text) if lost_text.lstrip("-").isdigit() else -1)
    return error_type(text)
Reader = Callable[[memoryview], None]
Handler = Callable[[int, "Header", Reader], None]


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
    """One posted receive (or a parked early arrival)."""

    __slots__ = ("peer", "key", "view", "sig", "site", "event", "header", "error", "parked",
                 "on_done")

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


def _mismatch(slot: Slot, header: Header, my_rank: int, peer: int | None = None) -> CollectiveMismatchError:
    return CollectiveMismatchError(
        f"collective mismatch (group {header.group}, sequence {header.seq}): "
        f"rank {my_rank} called {slot.sig.decode(errors='replace')} at "
        f"{slot.site.decode(errors='replace') or '?'} but rank {slot.peer if peer is None else peer} called "
        f"{header.sig.decode(errors='replace')} at {header.site.decode(errors='replace')}"
    )


class Mailbox:
    """Matches arriving messages with posted receives, for one rank and all peers."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._posted: dict[Key, Slot] = {}
        self._parked: dict[Key, Slot] = {}
        self._wild: list[tuple[Callable[[int, Header], bool], Slot]] = []
        self.dead: dict[int, PeerLostError] = {}
        # peers that said goodbye before closing: a finished peer, not a crashed one, so
        # only calls that still need it fail (see peer_lost)
        self.departed: set[int] = set()
        self.left: dict[int, PeerLostError] = {}
        self.aborted: dict[int, TandemError] = {}
        # the last calls completed per group: (seq, sig, site), to recognise stray messages
        self._finished: dict[int, collections.deque[tuple[int, bytes, bytes]]] = {}
        # every failure peers reported per group, including after the first one
        self.reports: dict[int, list[TandemError]] = collections.defaultdict(list)
        # set by the transport: tell ``peer`` that ``group`` failed with ``error``
        self.reply: Callable[[int, int, TandemError], None] | None = None
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
        """Deliver one message; ``read(view)`` fills ``view`` with the payload."""
        handler = self._handlers.get(header.kind)
        if handler is not None:
            handler(peer, header, read)
            return
        if header.kind == Kind.BYE:
            read(memoryview(bytearray(header.nbytes)))
            with self._lock:
                self.departed.add(peer)
            return
        if header.kind == Kind.ABORT:
            buf = bytearray(header.nbytes)
            read(memoryview(buf))
            reported = decode_error(header.step, bytes(buf))
            self.reports[header.group].append(reported)
            self.abort_group(header.group, reported)
            return
        key = (peer, header.kind, header.group, header.seq, header.step)
        with self._lock:
            slot = self._posted.pop(key, None)
            if slot is None:
                slot = self._take_wild(peer, header)
            stray = None
            if slot is None:
                stray = self._stray(peer, header)
            if slot is None and stray is None:
                parked = Slot(peer, key, None, b"")
                parked.header = header
                self._parked[key] = parked
                clash = self._clashing_posts(peer, header)
        if stray is not None:
            read(memoryview(bytearray(header.nbytes)))  # drain, never combine
            self._reject(peer, header.group, stray)
            return
        if slot is None:
            for victim in clash:  # our own call for this sequence number is a different one
                victim.finish(None, _mismatch(victim, header, self.rank, peer))
            buf = bytearray(header.nbytes)
            read(memoryview(buf))
            parked.parked = buf
            parked.event.set()
            return
        error = self._check(slot, header)
        if error is not None:
            read(memoryview(bytearray(header.nbytes)))  # drain, never combine
            slot.finish(header, error)
            return
        assert slot.view is not None
        read(slot.view)
        slot.finish(header)

    def _clashing_posts(self, peer: int, header: Header) -> list[Slot]:
        """Posted receives of the same collective call whose signature differs from ``header``.

        Mismatched calls often use different step numbers, so their messages never meet a
        posted receive; comparing against every receive of the same (group, sequence)
        catches them at once instead of at the deadline. Caller holds the lock.
        """
        if header.kind != Kind.COLL:
            return []
        clash = [s for k, s in self._posted.items() if k[1] == Kind.COLL and k[2] == header.group
                 and k[3] == header.seq and s.sig != header.sig]
        for s in clash:
            del self._posted[s.key]
        return clash

    def _stray(self, peer: int, header: Header) -> CollectiveMismatchError | None:
        """A message for a call this rank already completed: the peer's call differed.

        E.g. two ranks that both believe they are the root of a broadcast only send.
        Caller holds the lock.
        """
        done = self._finished.get(header.group)
        if header.kind != Kind.COLL or not done or header.seq > done[-1][0]:
            return None
        mine = next(((sig, site) for seq, sig, site in done if seq == header.seq), None)
        sig, site = mine if mine is not None else (b"an earlier collective", b"?")
        return CollectiveMismatchError(
            f"collective mismatch (group {header.group}, sequence {header.seq}): "
            f"rank {self.rank} completed {sig.decode(errors='replace')} at "
            f"{site.decode(errors='replace')} but rank {peer} called "
            f"{header.sig.decode(errors='replace')} at {header.site.decode(errors='replace')}")

    def _reject(self, peer: int, group: int, error: TandemError) -> None:
        self.abort_group(group, error)
        if self.reply is not None:
            self.reply(peer, group, error)

    def finished(self, group: int, seq: int, sig: bytes, site: bytes) -> None:
        """Record that this rank completed call ``seq``; leftovers for it are strays."""
        with self._lock:
            done = self._finished.setdefault(group, collections.deque(maxlen=64))
            done.append((seq, sig, site))
            keys = [k for k in self._parked
                    if k[1] == Kind.COLL and k[2] == group and k[3] == seq]
            strays = [(k[0], self._parked.pop(k).header) for k in keys]
            errors = [(peer, self._stray(peer, h)) for peer, h in strays if h is not None]
        for peer, error in errors:
            if error is not None:
                self._reject(peer, group, error)

    def parked_call(self, group: int, seq: int) -> tuple[int, Header] | None:
        """A collective message of call ``seq`` on ``group`` that nobody has received yet
        (sender, header). A call that moves no messages uses it to spot a peer whose call
        of the same number does."""
        with self._lock:
            for k, parked in self._parked.items():
                if (k[1] == Kind.COLL and k[2] == group and k[3] == seq
                        and parked.header is not None):
                    return k[0], parked.header
        return None

    def _clashing_arrival(self, kind: int, group: int, seq: int, sig: bytes) -> Slot | None:
        """A parked message of the same collective call with another signature (lock held)."""
        if kind != Kind.COLL:
            return None
        for k, parked in self._parked.items():
            if (k[1] == Kind.COLL and k[2] == group and k[3] == seq and parked.header is not None
                    and parked.header.sig != sig):
                return parked
        return None

    def _take_wild(self, peer: int, header: Header) -> Slot | None:
        for i, (match, slot) in enumerate(self._wild):
            if match(peer, header):
                del self._wild[i]
                slot.peer = peer
                return slot
        return None

    def _check(self, slot: Slot, header: Header) -> BaseException | None:
        if header.kind == Kind.COLL and header.sig != slot.sig:
            return _mismatch(slot, header, self.rank)
        if slot.view is not None and header.nbytes != len(slot.view):
            what = slot.sig.decode(errors="replace") or "receive"
            return CollectiveMismatchError(
                f"rank {slot.peer} sent {header.nbytes} bytes but rank {self.rank} expected "
                f"{len(slot.view)} for {what} (tensor sizes differ across ranks; sender at "
                f"{header.site.decode(errors='replace')})"
            )
        return None

    # -- posting side ----------------------------------------------------------------
    def post(self, peer: int, kind: int, group: int, seq: int, step: int,
             view: memoryview, sig: bytes = b"", site: bytes = b"") -> Slot:
        key = (peer, kind, group, seq, step)
        slot = Slot(peer, key, view, sig, site)
        with self._lock:
            early = self._parked.pop(key, None)
            if early is None:
                failure = self._failure(peer, group)
                clash = self._clashing_arrival(kind, group, seq, sig) if failure is None else None
                if failure is None and clash is None:
                    self._posted[key] = slot
        if early is None:
            if clash is not None:
                assert clash.header is not None
                failure = _mismatch(slot, clash.header, self.rank, clash.peer)
            if failure is not None:
                slot.finish(None, failure)
            return slot
        self._complete_from_parked(slot, early)
        return slot

    def post_any(self, peers: Iterable[int], kind: int, group: int, view: memoryview,
                 match: Callable[[int, Header], bool]) -> Slot:
        """Post a receive that any of ``peers`` may satisfy (``recv(src=None)``)."""
        slot = Slot(-1, (-1, kind, group, -1, -1), view, b"")
        with self._lock:
            early = None
            for key, parked in self._parked.items():
                if parked.header is not None and match(key[0], parked.header):
                    early = self._parked.pop(key)
                    slot.peer = key[0]
                    break
            if early is None:
                failure = self.aborted.get(group)
                if failure is None:
                    self._wild.append((match, slot))
        if early is None:
            if failure is not None:
                slot.finish(None, failure)
            return slot
        self._complete_from_parked(slot, early)
        return slot

    def _complete_from_parked(self, slot: Slot, early: Slot) -> None:
        early.event.wait()  # the reader may still be filling the parked buffer
        header = early.header
        assert header is not None and early.parked is not None
        error = self._check(slot, header)
        if error is None and slot.view is not None:
            slot.view[: header.nbytes] = early.parked
        slot.finish(header, error)

    def cancel(self, slot: Slot) -> None:
        with self._lock:
            self._posted.pop(slot.key, None)
            self._wild = [(m, s) for m, s in self._wild if s is not slot]

    # -- failures --------------------------------------------------------------------
    def _failure(self, peer: int, group: int) -> TandemError | None:
        if group in self.aborted:
            return self.aborted[group]
        return self.dead.get(peer) or self.left.get(peer)

    def peer_lost(self, peer: int, error: PeerLostError) -> None:
        """``peer``'s connection is gone: it crashed (every wait on its group fails), or,
        after a goodbye, it left (only what waits on it fails)."""
        with self._lock:
            if peer in self.departed:
                error = PeerLostError(
                    f"rank {peer} left (it closed its process group) before sending what rank "
                    f"{self.rank} is waiting for; did the ranks run different collectives?",
                    peer)
                self.left.setdefault(peer, error)
            else:
                self.dead.setdefault(peer, error)
            victims = [s for k, s in self._posted.items() if k[0] == peer]
            for s in victims:
                del self._posted[s.key]
        for s in victims:
            s.finish(None, error)

    def abort_group(self, group: int, error: TandemError) -> None:
        with self._lock:
            self.aborted.setdefault(group, error)
            victims = [s for k, s in self._posted.items() if k[2] == group]
            for s in victims:
                del self._posted[s.key]
            wild = [s for _, s in self._wild if s.key[2] == group]
            self._wild = [(m, s) for m, s in self._wild if s.key[2] != group]
        for s in victims + wild:
            s.finish(None, error)


class Transport(abc.ABC):
    """Moves messages between this rank and its peers.

    ``isend`` returns a :class:`Slot`-like handle whose ``event`` is set when the
    buffer may be reused; ``irecv`` posts a receive in the :class:`Mailbox`.
    """

    rank: int
    world_size: int
    mailbox: Mailbox

    def irecv(self, peer: int, kind: int, group: int, seq: int, step: int,
              view: memoryview, sig: bytes = b"", site: bytes = b"") -> Slot:
        return self.mailbox.post(peer, kind, group, seq, step, view, sig, site)

    @abc.abstractmethod
    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        """Queue ``payload`` for ``peer``; the handle completes when it was written."""

    def isendv(self, peer: int, header: Header, parts: Sequence[memoryview]) -> Slot:
        """Like ``isend`` with the payload in pieces (byte views), sent as one message;
        tcp and shm write the pieces without joining them."""
        return self.isend(peer, header, memoryview(b"".join(parts)))

    def _send_slot(self, peer: int, header: Header) -> Slot:
        return Slot(peer, (peer, header.kind, header.group, header.seq, header.step), None, b"")

    def _send_to_self(self, header: Header, payload: memoryview) -> Slot:
        """A message to this very rank: copied now, delivered through the mailbox."""
        data = bytes(payload)
        done = 0

        def read(view: memoryview) -> None:
            nonlocal done
            view[:] = data[done:done + len(view)]
            done += len(view)

        self.mailbox.arrive(self.rank, header, read)
        slot = self._send_slot(self.rank, header)
        slot.finish(header)
        return slot

    def _check_peer(self, peer: int, known: bool, what: str) -> None:
        """Raise if ``peer`` has no link (``what`` names the link) or was lost."""
        if not known:
            raise PeerLostError(f"rank {self.rank} has no {what} to rank {peer}", peer)
        lost = self.mailbox.dead.get(peer)
        if lost is not None:
            raise lost

    def abort(self, group: int, peers: Iterable[int], error: TandemError) -> None:
        """Fail ``group`` here and tell ``peers`` so they raise the same error."""
        self.mailbox.abort_group(group, error)
        code = next((c for c, t in ABORT_CODES.items() if type(error) is t), 0)
        data = encode_error(error, self.rank)
        header = Header(Kind.ABORT, group, 0, code, len(data))
        targets = [p for p in peers if p != self.rank and p not in self.mailbox.dead]

        def tell() -> None:
            for p in targets:
                try:
                    self.isend(p, header, memoryview(data))
                except TandemError:
                    pass

        # a stuck peer with a full socket buffer must not block the rank that aborts
        threading.Thread(target=tell, daemon=True, name="tandem-abort").start()

    def close(self) -> None:
        """Close every connection; pending operations fail."""

    def say_goodbye(self, peers: Iterable[int]) -> None:
        """Tell ``peers`` this rank closes on purpose (best effort, never blocks), so they
        do not take the closed connections for a crash while they finish their own calls."""
        header = Header(Kind.BYE, 0, 0, 0, 0)
        for p in peers:
            if p != self.rank and p not in self.mailbox.dead:
                try:
                    self.isend(p, header, memoryview(b""))
                except TandemError:
                    pass

    def host_of(self, rank: int) -> str:
        """The host identity of ``rank`` (used for topology decisions)."""
        return ""

    def shares_memory_with(self, ranks: Sequence[int]) -> bool:
        """Whether this rank can map the memory of every rank in ``ranks`` (see ``arena``)."""
        return False

    def arena(self, key: int, members: Sequence[int], chunk: int | None = None,
              timeout: float | None = None) -> "Arena":
        """Shared staging memory with ``members`` (collective over them); shm only."""
        raise StateError(f"the {type(self).__name__} cannot share memory between ranks")


def check_size(nbytes: int, cap: int, peer: int) -> None:
    if nbytes > cap:
        raise ProtocolError(f"rank {peer} announced a {nbytes}-byte message; the cap is {cap}")
