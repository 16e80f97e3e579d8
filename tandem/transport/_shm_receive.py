"""The receiving half of a shm peer: frames read by whichever thread holds the read lock.

One reader thread per peer waits between frames (:meth:`Receiver.read_loop`) and hands
each frame to ``Mailbox.arrive``. A thread that waits for a frame may read it itself
instead (leader/follower): between ``watch(True)`` and ``watch(False)`` it calls
:meth:`Receiver.poll`, which reads the next frame if one is there and nobody else is
reading. An RPC caller thus reads its own reply, and an idle RPC server thread the
next call, without waking the reader thread to hand it over (~35-40 us per hand-off
on a busy 2-core machine); while anyone watches, the writer does not wake the reader
thread at all (see ``Ring.watch``).

A small frame that is wholly in the ring is delivered straight from there: one copy
into the receiver's memory, no per-read waiting machinery (``Receiver._in_place``).

A frame sent by reference (see :mod:`~tandem.transport._shm_peer`) is read straight
out of the sender's memory and acknowledged once it was read to its end. A frame with
lent pieces (:mod:`~tandem.transport._lend`) offers each as a view of the sender's
segment (``read.lend(nbytes)``, what the RPC codec asks for); the segment goes back to
the sender once the last view of it is freed, or at once if the piece was copied out.

    peer.read_loop(mailbox, max_frame)                # the reader thread
    peer.watch(True); peer.poll(); peer.watch(False)  # any thread waiting for a frame
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Callable

from tandem.errors import PeerLostError, ProtocolError, StateError, TandemError
from tandem.transport import _cma
from tandem.transport._lend import Borrowed, LentReader
from tandem.transport._ring import Ring
from tandem.transport.base import Reader, check_size
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import Header, Slot

__all__ = ["Receiver", "Closed", "SMALL_FRAME"]

_HDR = struct.Struct("<BIQiQHH")
_REF, _ACK = 0x80, 0x40  # kind-byte flags: the payload goes by reference; an acknowledgement
_LENT = 0x20  # kind-byte flag: the payload has pieces in lent segments (see _lend)
# control frames (no payload; the segment's key in ``seq``): a lent segment given back
# by its receiver, and one its sender dropped
_RETURN, _DROP = _ACK | _LENT, _ACK | _REF | _LENT
_DESC = struct.Struct("<QI")  # by reference: token, number of pieces
_PIECE = struct.Struct("<QQ")  # address in the sender (0: the bytes follow in the ring), length
_MAX_PIECES = 1 << 16
# Small frames have a short path each way: up to this size a frame is written into the
# ring at once by its sender (``ShmPeer.send_now``) and delivered straight from it when
# wholly there (``Receiver._in_place``). Both copy under the GIL in one slice assignment
# per piece (larger copies release it; see ``_ring``): ~25 us for the largest. Up to a
# 256 KB tensor with its table; measured (2 workers, RPC echo, alternating blocks of 100
# calls, load 9-18): a 64 KB tensor 552/406/297 us per call against 680/595/580 us with a
# 64 KiB limit, a 256 KB one 629/610 us against 710/696 us.
SMALL_FRAME = 260 << 10
_LOCK_S = 0.1  # the reader thread re-checks the transport's state this often while a
# polling thread reads


class Closed(TandemError):
    """The transport is closing: waiting threads stop quietly."""


class Receiver:
    """Reads one peer's inbound ring; :class:`~tandem.transport._shm_peer.ShmPeer` adds
    the sending half (and the acknowledgements this half sends and receives)."""

    rank: int
    pid: int
    me: int
    inbound: Ring
    eof: bool
    closing: bool

    def __init__(self) -> None:
        self._rlock = threading.Lock()  # held by whichever thread reads a frame
        self._mailbox: Mailbox | None = None  # set when the reader thread starts
        self._max_frame = 0
        self._probed = False
        self._dead = False  # no more frames: the peer is gone or the stream broke
        self._head = memoryview(bytearray(_HDR.size))
        self.borrowed: Borrowed | None = None  # segments the peer lent us (set by the transport)

    # the sending half's (ShmPeer)
    def lost(self, why: str) -> PeerLostError:
        raise NotImplementedError

    def send(self, parts: list[memoryview], header: Header, slot: Slot) -> None:
        raise NotImplementedError

    def _acked(self, token: int) -> None:
        raise NotImplementedError

    def _fail_acks(self, error: BaseException) -> None:
        raise NotImplementedError

    def _returned(self, key: int) -> None:
        raise NotImplementedError

    def give_back(self, key: int) -> None:
        raise NotImplementedError

    def _break(self) -> None:
        raise NotImplementedError

    # Frames are read one at a time under ``_rlock`` by whoever holds it: the reader
    # thread, or a thread that polls while it waits (:meth:`poll`, e.g. an RPC caller
    # reading its own reply), so that a reply needs no hand-off between threads.
    def read_loop(self, mailbox: Mailbox, max_frame: int) -> None:
        """Deliver frames until the peer is gone (reported) or the transport closes."""
        self._mailbox, self._max_frame = mailbox, max_frame
        ring = self.inbound
        if not _cma.available():
            ring.set_readable(False)
            self._probed = True
        busy = False  # whether the last round read a frame
        try:
            while not self._dead:
                if not self._probed:  # before the first frame if the peer announced itself
                    with self._rlock:
                        self._probed = self._probed or self._probe()
                ring.wait_readable(self._check_in, busy)
                busy = False
                if not self._rlock.acquire(timeout=_LOCK_S):
                    continue  # a poller is inside a (large) frame; check again
                try:
                    if not self._dead and not ring.empty():
                        self._frame(mailbox, max_frame)
                        busy = True
                finally:
                    self._rlock.release()
        except Exception as exc:  # noqa: BLE001 - a reader must never die silently
            with self._rlock:
                self._stop_reading(exc)

    def watch(self, on: bool) -> None:
        """Start (``on``) or stop polling this peer's frames from the calling thread."""
        self.inbound.watch(on)

    def quiesce(self, deadline: float) -> bool:
        """After ``closing`` is set: wait until no polling thread is inside a frame (they
        check ``closing`` under the read lock), so the rings may be unmapped; False if
        one still is at ``deadline``."""
        if not self._rlock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        self._rlock.release()
        return True

    def poll(self) -> bool:
        """Read and deliver the next frame if one is there and no other thread is reading;
        whether a frame was read (call between ``watch(True)`` and ``watch(False)``)."""
        mailbox = self._mailbox
        if mailbox is None or self._dead or self.closing or not self._rlock.acquire(False):
            return False
        try:
            if self._dead or self.closing or self.inbound.empty():
                return False
            self._frame(mailbox, self._max_frame)
        except Exception as exc:  # noqa: BLE001 - the stream is broken for every reader
            self._stop_reading(exc)
        finally:
            self._rlock.release()
        return True

    def _check_in(self) -> None:
        if self.closing or self._dead:
            raise Closed()
        if self.eof and self.inbound.empty():  # everything the peer wrote has been read
            raise self.lost("closed")

    def _read(self, view: memoryview) -> None:
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        self.inbound.read_into(view, self._check_in)

    def _frame(self, mailbox: Mailbox, max_frame: int) -> None:
        """Read and deliver one frame (under ``_rlock``)."""
        ring = self.inbound
        if not self._probed:
            self._probed = self._probe()
        whole = ring.peek(_HDR.size)
        if whole is not None:
            fields = _HDR.unpack(whole)
            if (not fields[0] & (_ACK | _REF | _LENT) and fields[4] <= SMALL_FRAME
                    and self._in_place(mailbox, max_frame, fields)):
                return
        head = self._head
        ring.read_into(head, self._check_in, release=False)
        kind, group, seq, step, nbytes, siglen, sitelen = _HDR.unpack(head)
        if kind & _ACK:
            ring.release()
            if kind == _RETURN:
                self._returned(seq)
            elif kind == _DROP:
                if self.borrowed is not None:
                    self.borrowed.drop(seq)
            else:
                self._acked(seq)
            return
        check_size(nbytes, max_frame, self.rank)
        extra = bytearray(siglen + sitelen)
        if extra:
            ring.read_into(memoryview(extra), self._check_in, release=False)
        header = Header(kind & ~(_REF | _LENT), group, seq, step, nbytes, bytes(extra[:siglen]),
                        bytes(extra[siglen:]))
        if kind & _LENT:
            lent = self._lent(nbytes, self._check_in)
            try:
                mailbox.arrive(self.rank, header, lent)
            finally:
                lent.settle()  # pieces copied out or never read go back at once
            if not lent.finished():
                raise ProtocolError(f"a message from rank {self.rank} was not read to its end")
            ring.release()
            return
        if not kind & _REF:
            mailbox.arrive(self.rank, header, self._read)
            ring.release()
            return
        token, remote_read, finished = self._by_reference(nbytes, self._check_in)
        mailbox.arrive(self.rank, header, remote_read)
        if not finished():
            raise ProtocolError(f"a message from rank {self.rank} was not read to its end")
        ring.release()
        ack = Header(0, 0, token, 0, 0)
        self.send([memoryview(_HDR.pack(_ACK, 0, token, 0, 0, 0, 0))], ack,
                  Slot(self.rank, (self.rank, 0, 0, token, 0), None, b""))

    def _in_place(self, mailbox: Mailbox, max_frame: int,
                  fields: tuple[int, int, int, int, int, int, int]) -> bool:
        """Deliver a small frame that is wholly in the ring, in one piece, straight from
        there (one copy into the receiver's memory, no waiting); False if it is not."""
        kind, group, seq, step, nbytes, siglen, sitelen = fields
        ring = self.inbound
        start = _HDR.size + siglen + sitelen
        frame = ring.peek(start + nbytes)
        if frame is None:
            return False
        check_size(nbytes, max_frame, self.rank)
        header = Header(kind, group, seq, step, nbytes,
                        bytes(frame[_HDR.size:_HDR.size + siglen]) if siglen else b"",
                        bytes(frame[_HDR.size + siglen:start]) if sitelen else b"")
        at = start

        def read(view: memoryview) -> None:
            nonlocal at
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            k = len(view)
            if at + k > len(frame):
                raise ProtocolError(f"read past the end of a message from rank {self.rank}")
            view[:] = frame[at:at + k]
            at += k

        mailbox.arrive(self.rank, header, read)
        if at != len(frame):
            raise ProtocolError(f"a message from rank {self.rank} was not read to its end")
        ring.skip(len(frame))
        ring.release()
        return True

    def _stop_reading(self, exc: BaseException) -> None:
        """No frame will be read any more (under ``_rlock``): fail what waits on this
        peer, naming why, once."""
        if self._dead:
            return
        self._dead = True
        self.inbound.wake_local()  # the reader thread, if asleep, sees _dead
        if isinstance(exc, Closed) or self.closing:
            self._fail_acks(StateError(f"rank {self.me} closed its shared-memory transport"))
            return
        if not isinstance(exc, PeerLostError):
            # the stream is broken (e.g. an oversized frame): end the connection, so the
            # peer learns at once, as with a TCP reset, instead of at its deadline
            self._break()
            exc = PeerLostError(
                f"the shared-memory stream from rank {self.rank} (pid {self.pid}) to rank "
                f"{self.me} broke ({type(exc).__name__}: {exc}); the connection was closed",
                self.rank)
        self._fail_acks(exc)
        assert self._mailbox is not None
        self._mailbox.peer_lost(self.rank, exc)

    def _probe(self) -> bool:
        """Whether this reader has decided if it can read the peer's memory (and told the
        peer); False while the peer has not announced where to look."""
        pid, address, expected = self.inbound.producer_memory()
        if not address:
            return False
        self.inbound.set_readable(pid == self.pid and _cma.probe(pid, address, expected))
        return True

    def _pieces(self, nbytes: int, check: Callable[[], None]
                ) -> tuple[int, list[tuple[int, int]]]:
        """Read a frame's piece table (by reference or lent): its token and pieces."""
        ring = self.inbound
        raw = bytearray(_DESC.size)
        ring.read_into(memoryview(raw), check, release=False)
        token, count = _DESC.unpack(raw)
        if count > _MAX_PIECES:
            raise ProtocolError(f"rank {self.rank} sent a message in {count} pieces")
        raw = bytearray(count * _PIECE.size)
        ring.read_into(memoryview(raw), check, release=False)
        pieces = [_PIECE.unpack_from(raw, i * _PIECE.size) for i in range(count)]
        if sum(n for _, n in pieces) != nbytes:
            raise ProtocolError(f"rank {self.rank} sent a message of {nbytes} bytes whose "
                                f"pieces add up to {sum(n for _, n in pieces)}")
        return token, pieces

    def _lent(self, nbytes: int, check: Callable[[], None]) -> LentReader:
        """A reader of a frame whose big pieces are in segments the peer lent us."""
        _, pieces = self._pieces(nbytes, check)
        if self.borrowed is None:
            raise ProtocolError(f"rank {self.rank} lent memory to rank {self.me}, which "
                                f"does not take it")
        spans = [(self.borrowed.find(key, n) if key else None, key, n) for key, n in pieces]
        return LentReader(self, spans, check)

    def _by_reference(self, nbytes: int, check: Callable[[], None]
                      ) -> tuple[int, Reader, Callable[[], bool]]:
        """Read a by-reference frame's piece table; return its token, a reader of the
        payload and whether the payload was read to its end."""
        ring = self.inbound
        token, pieces = self._pieces(nbytes, check)
        count = len(pieces)
        state = [0, 0]  # piece, offset in it
        pid = self.pid

        def read(view: memoryview) -> None:
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            got, want = 0, len(view)
            while got < want:
                if state[0] >= count:
                    raise ProtocolError(f"read past the end of a message from rank {self.rank}")
                address, n = pieces[state[0]]
                k = min(want - got, n - state[1])
                if address:
                    _cma.read_from(pid, _cma.address_of_view(view) + got, address + state[1], k)
                else:
                    ring.read_into(view[got:got + k], check, release=False)
                got += k
                state[1] += k
                if state[1] == n:
                    state[0] += 1
                    state[1] = 0

        return token, read, lambda: state[0] == count


