"""The ``Transport`` seam: tagged byte messages between ranks, with posted receives.

A transport connects one rank to every other rank of a job and moves messages
(:mod:`.message`: a ``Header`` and a payload). Receivers post a buffer for a message
key before or after it arrives; the :class:`~.mailbox.Mailbox` matches them, checks
signatures (:mod:`.mismatch`) and keeps the failure bookkeeping (:mod:`.failures`).
Implementations (tcp, shm, loopback) only deliver bytes.

What the collectives layer uses, and nothing else::

    slot = t.isend(peer, Header(Kind.COLL, group, seq, step, n, sig, site), view)
    slot = t.irecv(peer, Kind.COLL, group, seq, step, view, sig, site)
    t.wait([slot], deadline, describe, peers)     # raises naming whoever failed
    t.aborted(group), t.lost(peer), t.left(peer)  # what failed, or None
    t.abort(group, peers, error)                  # fail group here and at peers
    t.finished(group, seq, sig, site)             # a call completed here
    t.close()                                     # release everything; pending ops fail
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NoReturn, Protocol, Sequence

from tandem.errors import ArgumentError, PeerLostError, ProtocolError, StateError, TandemError
from tandem.transport.failures import ABORT_CODES, decode_error, encode_error
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import (SIG_MAX, Flag, Handler, Header, Key, Kind, Reader, Slot,
                                      reader_of)
from tandem.transport.wait import raise_lost, wait_all

if TYPE_CHECKING:
    from tandem.transport._arena import Arena

__all__ = ["Kind", "Header", "Slot", "Mailbox", "Transport", "check_size", "check_header",
           "encode_error", "decode_error", "ABORT_CODES", "Flag", "Key", "Reader", "join_all",
           "Link", "Poller", "one_drop_warning"]

_TELL_S = 1.0  # how long close() lets abort messages already on their way go out
_FLUSH_S = 1.0  # how long close() lets queued sends (aborts, goodbyes) go out
# the same when a group failed here: a goodbye cut off makes peers blame this rank's exit
# for the failure; a flush waits only while sends are queued, so this costs nothing else
_FLUSH_FAILED_S = 5.0


_LISTED = 8  # dropped sends named one by one in the warning of a closing transport
_LOGGER = logging.getLogger("tandem")
# the sends given up within a close on this thread (one_drop_warning), else no attribute
_DROPPING = threading.local()


@contextlib.contextmanager
def one_drop_warning(rank: int) -> Iterator[None]:
    """Log the sends given up inside (:meth:`Transport.give_up_sends`, any transport,
    every peer) in one warning at the end; nested, the outermost one logs."""
    if getattr(_DROPPING, "names", None) is not None:
        yield
        return
    names: list[str] = []
    _DROPPING.names = names
    try:
        yield
    finally:
        del _DROPPING.names
        if names:
            _LOGGER.warning(
                "tandem: rank %d closes its transport (destroy_process_group) with %d send(s) "
                "its peers had not taken, now dropped: %s%s; wait on each send's Work before "
                "destroy_process_group", rank, len(names), "; ".join(names[:_LISTED]),
                f"; and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _send_text(slot: Slot) -> str:
    """A send by its peer and op, as a user would know it (global ranks)."""
    peer, kind, group, seq, step = slot.key
    site = slot.site.decode(errors="replace")
    at = f", called at {site}" if site else ""
    if kind == Kind.P2P:
        return f"send to rank {peer} (tag {step}, group id {group}{at})"
    if kind == Kind.COLL:
        return f"message to rank {peer} of collective call #{seq} (group id {group}{at})"
    name = Kind(kind).name if kind in Kind._value2member_map_ else str(kind)
    return f"{name} message to rank {peer}"


class Poller(Protocol):
    """A peer's incoming frames, read by a thread that waits for one (see
    :meth:`Transport.poller`)."""

    def watch(self, on: bool) -> None: ...

    def poll(self) -> bool: ...


class Link(Protocol):
    """What closing needs of a transport's connection to one peer."""

    rank: int

    def flush(self, deadline: float) -> None: ...


def join_all(threads: Iterable[threading.Thread | None], seconds: float) -> bool:
    """Join ``threads`` (not the calling one) within ``seconds``; whether all ended."""
    end = time.monotonic() + seconds
    me = threading.current_thread()
    rest = [t for t in threads if t is not None and t is not me]
    for t in rest:
        t.join(max(0.0, end - time.monotonic()))
    return not any(t.is_alive() for t in rest)


class Transport(abc.ABC):
    """Moves messages between this rank and its peers.

    ``isend`` returns a :class:`Slot` whose ``event`` is set when the buffer may be
    reused; ``irecv`` posts a receive in the :class:`Mailbox`.
    """

    rank: int
    world_size: int
    mailbox: Mailbox

    # -- messages ----------------------------------------------------------------------
    def irecv(self, peer: int, kind: int, group: int, seq: int, step: int,
              view: memoryview, sig: bytes = b"", site: bytes = b"") -> Slot:
        return self.mailbox.post(peer, kind, group, seq, step, view, sig, site)

    def irecv_any(self, peers: Iterable[int], kind: int, group: int, view: memoryview,
                  match: Callable[[int, Header], bool], sig: bytes = b"") -> Slot:
        """A receive any of ``peers`` may satisfy: the first message ``match`` accepts."""
        return self.mailbox.post_any(peers, kind, group, view, match, sig)

    @abc.abstractmethod
    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        """Queue ``payload`` for ``peer``; the handle completes when it was written."""

    def isendv(self, peer: int, header: Header, parts: Sequence[memoryview]) -> Slot:
        """Like ``isend`` with the payload in pieces (byte views), sent as one message;
        tcp and shm write the pieces without joining them."""
        return self.isend(peer, header, memoryview(b"".join(parts)))

    def send_now(self, peer: int, header: Header, parts: Sequence[memoryview]) -> bool:
        """Send a small message at once if that needs no waiting and no send handle: True
        if it was sent (as complete as a finished ``isendv``); False if nothing was sent,
        and ``isendv`` must send it (which also reports a lost peer). Transports without
        such a path (tcp) always answer False."""
        return False

    def handle(self, kind: int, handler: Handler | None) -> None:
        """Hand every arriving message of ``kind`` to ``handler(peer, header, read)``
        instead of matching it with a posted receive: for messages that arrive
        unsolicited, of sizes nobody can post for (RPC). See ``Mailbox.handle``."""
        self.mailbox.handle(kind, handler)

    def poller(self, peer: int) -> Poller | None:
        """``peer``'s incoming frames for a thread that waits for one of them, or None
        where only the transport's own threads read (tcp). Between ``watch(True)`` and
        ``watch(False)``, ``poll()`` reads and delivers (as ``handle`` says) the next
        frame if one is there and no other thread is reading; a reply thus reaches the
        thread that waits for it without a hand-off between threads."""
        return None

    def cancel(self, slot: Slot) -> None:
        """Withdraw a posted receive."""
        self.mailbox.cancel(slot)

    def wait(self, slots: Iterable[Slot], deadline: float, describe: Callable[[], str],
             peers: Iterable[int] = ()) -> None:
        """Wait for ``slots`` until ``deadline``; ``peers`` are watched for death."""
        wait_all(slots, deadline, describe, self.mailbox, peers)

    def connected(self, peer: int) -> bool:
        """Whether a message to ``peer`` goes out without first making a connection (one
        made on first use may wait on a stopped peer for the whole handshake timeout)."""
        return True

    def know_group(self, group: int, ranks: list[int]) -> None:
        """``group``'s global ranks: a clash this rank finds in one of its calls is told to
        all of them, not only to the rank whose message showed it."""
        self.mailbox.know_members(group, ranks)

    # -- what failed ---------------------------------------------------------------------
    def aborted(self, group: int) -> TandemError | None:
        """Why ``group`` failed on this rank (abort, or the transport closed), or None."""
        return self.mailbox.failures.aborted(group)

    def group_failures(self) -> list[TandemError]:
        """Why each failed group failed on this rank (its own or a peer's abort; not the
        groups this rank destroyed), oldest first."""
        return [error for _, error in self.mailbox.failures.reasons()]

    def lost(self, peer: int) -> PeerLostError | None:
        """Why ``peer`` is gone if its connection closed without a goodbye, else None."""
        return self.mailbox.failures.lost(peer)

    def lost_peers(self) -> dict[int, PeerLostError]:
        """Every peer whose connection closed without a goodbye, in the order noticed."""
        return self.mailbox.failures.all_lost()

    def left_peers(self) -> dict[int, PeerLostError]:
        """Every peer whose connection closed after its goodbye (it left on purpose)."""
        return self.mailbox.failures.all_left()

    def left(self, peer: int) -> PeerLostError | None:
        """Why ``peer``, which closed its process group on purpose, can send no more."""
        return self.mailbox.failures.left(peer)

    def raise_lost(self, group: int, lost: PeerLostError, rank: int, deadline: float,
                   describe: Callable[[], str]) -> NoReturn:
        """Raise for ``rank``, found gone (``lost``: it died or left) by a wait on ``group``:
        the group's abort if its news comes within a grace, else the loss (see ``wait``)."""
        raise_lost(self.mailbox.failures, group, lost, rank, deadline, describe)

    def check_group(self, group: int, ranks: Sequence[int], deadline: float,
                    describe: Callable[[], str]) -> None:
        """Raise if ``group`` failed here (its abort) or one of ``ranks`` died (the first
        noticed, unless the group's abort comes in :meth:`blame`'s grace)."""
        failure = self.aborted(group)
        if failure is not None:
            raise failure
        lost = self.mailbox.failures.first_lost(ranks)
        if lost is not None:
            self.raise_lost(group, lost, lost.rank, deadline, describe)

    def finished(self, group: int, seq: int, sig: bytes, site: bytes,
                 recorded: bool = False) -> None:
        """This rank completed call ``seq`` of ``group``; later messages for it are strays.

        ``recorded``: the lookup given to :meth:`follow_calls` shows it completed."""
        self.mailbox.finished(group, seq, sig, site, recorded)

    def follow_calls(self, group: int, completed: Callable[[int], tuple[bytes, bytes] | None]
                     ) -> None:
        """``group`` records its completed calls itself: ``completed(seq)`` is (signature,
        call site) of call ``seq`` once this rank completed it (else None)."""
        self.mailbox.history.follow(group, completed)

    def unfollow_calls(self, group: int,
                       last: Callable[[int], Iterable[tuple[int, bytes, bytes]]]) -> None:
        """End :meth:`follow_calls`; ``last(n)``: (seq, signature, call site) of the
        group's last ``n`` completed calls, oldest first."""
        self.mailbox.history.unfollow(group, last)

    def unreceived(self, kind: int, group: int) -> list[tuple[int, int, int]]:
        """(sender, step, bytes) of each arrived message of ``kind`` on ``group`` that no
        receive took (for point-to-point messages, the step is the tag)."""
        return self.mailbox.unreceived(kind, group)

    def parked_call(self, group: int, seq: int,
                    besides: bytes | None = None) -> tuple[int, Header] | None:
        """(sender, header) of an unreceived message of call ``seq`` on ``group`` whose
        signature is not ``besides``, or None."""
        return self.mailbox.parked_call(group, seq, besides)

    # -- failing -------------------------------------------------------------------------
    def abort(self, group: int, peers: Iterable[int], error: TandemError) -> None:
        """Fail ``group`` here and tell ``peers`` so they raise the same error."""
        self.mailbox.abort_group(group, error)
        targets = [p for p in peers if p != self.rank and self.lost(p) is None]

        def tell() -> None:
            self._tell_abort(group, error, targets)

        # a stuck peer with a full socket buffer must not block the rank that aborts
        teller = threading.Thread(target=tell, daemon=True, name="tandem-abort")
        teller.start()  # before it is listed: close() may join it from another thread
        tellers = self._tellers()
        tellers[:] = [t for t in tellers if t.is_alive()] + [teller]

    def _tell_abort(self, group: int, error: TandemError, targets: list[int]) -> None:
        """Send ``targets`` the news that ``group`` failed (on the abort's own thread)."""
        header, data = _abort_message(group, error, self.rank)
        for p in targets:
            try:
                self.isend(p, header, memoryview(data))
            except TandemError:
                pass

    def fail_here(self, group: int, error: TandemError) -> None:
        """Fail every receive of ``group`` on this rank only (peers are not told)."""
        self.mailbox.abort_group(group, error, quiet=True)

    def _tellers(self) -> list[threading.Thread]:
        return self.__dict__.setdefault("_abort_tellers", [])

    def _finish_telling(self) -> None:
        """Let aborts on their way reach their queues first: a peer that sees this rank
        leave must already know why (else it blames the rank that left)."""
        end = time.monotonic() + _TELL_S
        for t in self._tellers():
            t.join(max(0.0, end - time.monotonic()))

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Close every connection; pending operations fail."""

    def _take_leave(self, links: Iterable[Link]) -> None:
        """The polite start of ``close``: aborts on their way and a goodbye reach every
        peer's queue, and queued sends get a moment to go out, so peers learn why this
        rank leaves before they see its connections close."""
        links = list(links)
        self._finish_telling()
        self.say_goodbye([link.rank for link in links])
        failed = bool(self.mailbox.failures.reasons())
        end = time.monotonic() + (_FLUSH_FAILED_S if failed else _FLUSH_S)
        for link in links:
            link.flush(end)

    def closed_error(self) -> StateError:
        return StateError(f"rank {self.rank} closed its transport (destroy_process_group): "
                          f"the operation can no longer complete")

    def give_up_sends(self, slots: Iterable[Slot]) -> None:
        """Fail the sends that closing drops, each error naming its peer and op, and log
        the user's among them (one warning per close, :func:`one_drop_warning`): an isend
        completes once sent, so its caller may never wait on it and learn otherwise."""
        with one_drop_warning(self.rank):
            self._give_up(slots, _DROPPING.names)

    def _give_up(self, slots: Iterable[Slot], dropped: list[str]) -> None:
        for slot in slots:
            if slot.event.is_set():
                continue
            what = _send_text(slot)
            slot.finish(None, StateError(
                f"rank {self.rank} closed its transport (destroy_process_group) before its "
                f"{what} went out, and gave it up: its peer had not taken it by then (closing "
                f"waits up to {_FLUSH_S:g} s for queued sends, {_FLUSH_FAILED_S:g} s after a "
                f"failure); wait on each send's Work "
                f"before destroy_process_group"))
            if slot.key[1] in (Kind.P2P, Kind.COLL):
                dropped.append(what)

    def say_goodbye(self, peers: Iterable[int]) -> None:
        """Tell ``peers`` this rank closes on purpose (best effort, never blocks), so they
        do not take the closed connections for a crash while they finish their own calls.

        Groups that failed here are reported first, on the same connections: a peer
        still waiting on this rank then fails with the cause ("rank 0 died (reported by
        rank 2)"), not with this rank's leaving, even if the news from elsewhere is late.
        """
        news = [_abort_message(g, e, self.rank) for g, e in self.mailbox.failures.reasons()]
        news.append((Header(Kind.BYE, 0, 0, 0, 0), b""))
        for p in peers:
            if p != self.rank and self.lost(p) is None:
                try:
                    for header, data in news:
                        self.isend(p, header, memoryview(data))
                except TandemError:
                    pass

    # -- topology ----------------------------------------------------------------------------
    def host_of(self, rank: int) -> str:
        """The host identity of ``rank`` (used for topology decisions)."""
        return ""

    def shares_memory_with(self, ranks: Sequence[int]) -> bool:
        """Whether this rank can map the memory of every rank in ``ranks`` (see ``arena``)."""
        return False

    def arena(self, key: int, members: Sequence[int], chunk: int | None = None,
              timeout: float | None = None,
              check: Callable[[], None] | None = None) -> "Arena":
        """Shared staging memory with ``members`` (collective over them); shm only.
        ``check()``, run while waiting for the first member's hand-over, may raise."""
        raise StateError(f"the {type(self).__name__} cannot share memory between ranks")

    # -- helpers for implementations ---------------------------------------------------------
    def _send_slot(self, peer: int, header: Header) -> Slot:
        return Slot(peer, (peer, header.kind, header.group, header.seq, header.step), None, b"",
                    header.site)

    def _send_to_self(self, header: Header, payload: memoryview) -> Slot:
        """A message to this very rank: copied now, delivered through the mailbox."""
        self.mailbox.arrive(self.rank, header, reader_of(memoryview(bytes(payload))))
        slot = self._send_slot(self.rank, header)
        slot.finish(header)
        return slot

    def _check_peer(self, peer: int, known: bool, what: str) -> None:
        """Raise if ``peer`` has no link (``what`` names the link) or was lost."""
        if not known:
            raise PeerLostError(f"rank {self.rank} has no {what} to rank {peer}", peer)
        lost = self.lost(peer)
        if lost is not None:
            raise lost


def _abort_message(group: int, error: TandemError, reporter: int,
                   relay: Sequence[int] = ()) -> tuple[Header, bytes]:
    """The ABORT message telling peers that ``group`` failed with ``error`` (``relay``:
    see ``encode_error``)."""
    code = next((c for c, t in ABORT_CODES.items() if type(error) is t), 0)
    data = encode_error(error, reporter, relay)
    return Header(Kind.ABORT, group, 0, code, len(data)), data


def check_size(nbytes: int, cap: int, peer: int) -> None:
    if nbytes > cap:
        raise ProtocolError(f"rank {peer} announced a {nbytes}-byte message; the cap is {cap} "
                            f"(TANDEM_MAX_FRAME here)")


def check_header(header: Header, cap: int, peer: int) -> None:
    """Refuse a message its receiver would refuse (past ``cap``, TANDEM_MAX_FRAME, which
    every rank shares) or whose signature or call site cannot be framed."""
    if len(header.sig) <= SIG_MAX and len(header.site) <= SIG_MAX and header.nbytes <= cap:
        return  # every send passes here: keep the common case to one test
    if header.nbytes > cap:
        raise ArgumentError(
            f"a message of {header.nbytes} bytes to rank {peer} exceeds TANDEM_MAX_FRAME="
            f"{cap}, the most a rank takes in one message: its receiver would refuse it and "
            f"close the connection; raise TANDEM_MAX_FRAME on every rank, or send less at once")
    for name, value in (("signature", header.sig), ("call site", header.site)):
        if len(value) > SIG_MAX:
            raise ArgumentError(
                f"a message {name} of {len(value)} bytes exceeds the frame's {SIG_MAX}; "
                f"long signatures must be shortened (ProcessGroup hashes them)")
