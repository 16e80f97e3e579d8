"""One local peer of the shm transport: its two rings, the send queue, sending and receiving.

Frames are the TCP transport's: a fixed header (kind, group, seq, step, nbytes,
signature and call-site lengths), the signature, the call site, the payload.

Sending (:meth:`ShmPeer.send`): a frame that fits in the ring's free space right
now is copied in by the caller, which therefore never waits on the peer; any other
frame is queued to this peer's writer thread (started on first use), which waits
for space as long as it takes. Frames leave in the order they were sent, inline
or queued. A small message may skip even that (:meth:`ShmPeer.send_now`, the RPC hot
path): header and payload go into the ring at once, with no send handle, when nothing is
queued before them.

Large payloads go *by reference* once the peer has probed that it may read this
process's memory (:mod:`~tandem.transport._cma`): the frame carries, instead of the
big pieces, their addresses and lengths (small pieces still follow in the ring); the
reader copies each big piece straight from the sender's memory into the posted
buffer (one copy instead of two, no wake-up per ring-sized piece) and answers with an
acknowledgement frame, which completes the send. Until then the sender holds the
pieces, so the memory stays valid; close waits for outstanding acknowledgements like
it waits for queued sends. Large pieces of an RPC message are rather *lent*
(:mod:`~tandem.transport._lend`): copied by the sender into a shared segment of its
own that the receiver's tensor then views, so no copy is left for the receiver; the
send completes once the frame is written. When the segments for a peer are all in use,
the message goes by reference as before.

Receiving: frames are read by whichever thread holds the read lock. One reader thread
per peer waits between frames (:meth:`ShmPeer.read_loop`) and hands each frame to
``Mailbox.arrive``. A thread that waits for a frame may read it itself instead
(leader/follower): between ``watch(True)`` and ``watch(False)`` it calls
:meth:`ShmPeer.poll`, which reads the next frame if one is there and nobody else is
reading. An RPC caller thus reads its own reply, and an idle RPC server thread the
next call, without waking the reader thread to hand it over (~35-40 us per hand-off
on a busy 2-core machine); while anyone watches, the writer does not wake the reader
thread at all (see ``Ring.watch``). A small frame that is wholly in the ring is
delivered straight from there: one copy into the receiver's memory, no per-read
waiting machinery (``ShmPeer._in_place``). A by-reference frame is read straight out
of the sender's memory and acknowledged once it was read to its end; a frame with lent
pieces offers each as a view of the sender's segment (``read.lend(nbytes)``, what the
RPC codec asks for), which goes back to the sender once the last view of it is freed,
or at once if the piece was copied out.

    peer = ShmPeer(link, me=0, hostname="h", open_ring=make_and_hand_over, mailbox=mailbox)
    peer.take_inbound(ring, max_frame)            # the peer's ring arrived (watcher thread)
    peer.send_now(header, views) or peer.post(header, views, slot)  # caller thread
    peer.read_loop(mailbox, max_frame)            # reader thread
    peer.watch(True); peer.poll(); peer.watch(False)  # any thread that waits for a frame
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import struct
import threading
import time
from typing import Callable

from tandem.errors import PeerLostError, ProtocolError, StateError, TandemError
from tandem.transport import _cma
from tandem.transport._lend import LEND_MIN, Borrowed, Lender, LentReader
from tandem.transport._ring import Ring
from tandem.transport._shm_setup import Link
from tandem.transport.base import Reader, check_size
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import Header, Kind, Slot
from tandem.transport.sendqueue import SendQueue

__all__ = ["ShmPeer", "Closed", "HungUp", "frame", "unframe", "BY_REFERENCE_MIN", "SMALL_FRAME"]

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
# wholly there (``ShmPeer._in_place``). Both copy under the GIL in one slice assignment
# per piece (larger copies release it; see ``_ring``): ~25 us for the largest. Up to a
# 256 KB tensor with its table; measured (2 workers, RPC echo, alternating blocks of 100
# calls, load 9-18): a 64 KB tensor 552/406/297 us per call against 680/595/580 us with a
# 64 KiB limit, a 256 KB one 629/610 us against 710/696 us.
SMALL_FRAME = 260 << 10
_LOCK_S = 0.1  # the reader thread re-checks the transport's state this often while a
# polling thread reads

# Pieces at least this large go by reference. Below ~1 MiB the ring's two copies are cheap
# and need no acknowledgement; measured in tandem.bench rpc (16 MB echo).
BY_REFERENCE_MIN = 1 << 20

_RPC = Kind.RPC
_LENDING_LOCK = threading.Lock()  # makes a peer's lending state once (rarely taken)


class Closed(TandemError):
    """The transport is closing: waiting threads stop quietly."""


class HungUp(PeerLostError):
    """The peer's connection closed before a message to it could be written: whether it
    left (said goodbye) or died is known only once everything it sent has been read."""


def _head(header: Header, flags: int = 0) -> bytes:
    return _HDR.pack(header.kind | flags, header.group, header.seq, header.step, header.nbytes,
                     len(header.sig), len(header.site)) + header.sig + header.site


def frame(header: Header, data: memoryview) -> list[memoryview]:
    """The views making up one frame on the wire."""
    return [memoryview(_head(header)), data]


def unframe(blob: bytes, peer: int) -> tuple[Header, bytes]:
    """One plain frame held whole in ``blob``: its header and payload."""
    if len(blob) < _HDR.size:
        raise ProtocolError(f"rank {peer} sent a {len(blob)}-byte frame")
    kind, group, seq, step, nbytes, siglen, sitelen = _HDR.unpack_from(blob)
    start = _HDR.size + siglen + sitelen
    if kind & (_ACK | _REF | _LENT) or start + nbytes != len(blob):
        raise ProtocolError(f"rank {peer} sent a malformed {len(blob)}-byte frame")
    return (Header(kind, group, seq, step, nbytes, blob[_HDR.size:_HDR.size + siglen],
                   blob[_HDR.size + siglen:start]), blob[start:])


class ShmPeer:
    """Rank ``link.peer`` as seen from rank ``me``."""

    def __init__(self, link: Link, me: int, hostname: str, open_ring: Callable[[], Ring],
                 mailbox: Mailbox) -> None:
        self.rank = link.peer
        self.pid = link.pid
        self.sock = link.sock
        # each ring is made by its writer on the first message that way (``open_ring``
        # makes ours and hands it over the socket; the peer's arrives through
        # :meth:`take_inbound`): a pair that never talks reserves no memory
        self._in: Ring | None = None
        self._out: Ring | None = None
        self._open_ring = open_ring
        self._out_lock = threading.Lock()
        self._in_lock = threading.Lock()
        self._early_watchers = 0  # watch() calls before the peer's ring arrived
        self.me = me
        self.hostname = hostname
        self.eof = False  # set by the transport's watcher when the peer's socket closes
        self.closing = False
        self.writer: threading.Thread | None = None
        self._wlock = threading.Lock()
        self._cv = threading.Condition()
        self.queue = SendQueue(me, self.rank)
        # sends by reference awaiting the peer's acknowledgement: token -> (pieces, header, slot)
        self._acks: dict[int, tuple[list[memoryview], Header, Slot]] = {}
        self._tokens = itertools.count(1)
        # segments lent to the peer and lent by it: made by ``lending`` (set by the
        # transport) on the first large RPC message either way, not for every local pair
        self.lender: Lender | None = None
        self.lending: Callable[[ShmPeer], tuple[Lender, Borrowed]] | None = None
        self._rlock = threading.Lock()  # held by whichever thread reads a frame
        self._mailbox = mailbox
        self._max_frame = 0
        self._probed = False
        self._dead = False  # no more frames: the peer is gone or the stream broke
        # sends that found the connection closed, settled once the peer's stream ended
        # (``_settle_unsent``): dropped if it said goodbye, failed if it died
        self._unsent: list[tuple[Header, Slot]] = []
        self._ended = False
        self._head = memoryview(bytearray(_HDR.size))
        self.borrowed: Borrowed | None = None  # segments the peer lent us (see ``lender``)

    @property
    def outbound(self) -> Ring:
        """The ring this rank writes to the peer, made (and handed over) on first use."""
        out = self._out
        if out is None:
            with self._out_lock:
                if self._out is None:
                    self._check_out()
                    self._out = self._open_ring()
                out = self._out
        return out

    @property
    def inbound(self) -> Ring:
        """The ring the peer writes to this rank (only once it arrived: readers run then)."""
        assert self._in is not None, "the peer has not sent anything yet"
        return self._in

    def has_rings(self) -> tuple[bool, bool]:
        """Whether the (inbound, outbound) rings exist yet."""
        return self._in is not None, self._out is not None

    def take_inbound(self, ring: Ring, max_frame: int) -> None:
        """The peer made the ring it writes to us (its first message to us follows in it)."""
        with self._in_lock:
            if self._in is not None:
                raise ProtocolError(f"rank {self.rank} handed rank {self.me} a second ring")
            # before the ring is published: a polling thread may read its first frame
            # before the reader thread starts, and must not see every frame as oversized
            self._max_frame = max_frame
            for _ in range(self._early_watchers):
                ring.watch(True)
            self._in = ring

    def send_unwritten(self, send: Callable[[], None]) -> bool:
        """If this rank never wrote to the peer, ``send()`` a message another way (news
        on the socket: no ring made just to tell) and return True; else False: it goes
        through the ring, after everything written before it."""
        with self._out_lock:
            if self._out is not None:
                return False
            send()
            return True

    def lost(self, why: str) -> PeerLostError:
        return PeerLostError(self._lost_text(why), self.rank)

    def hung_up(self) -> HungUp:
        """What a send raises when the peer's connection is closed (see :meth:`gone`)."""
        return HungUp(self._lost_text("closed"), self.rank)

    def _lost_text(self, why: str) -> str:
        return (f"rank {self.rank} (pid {self.pid}, host {self.hostname or '?'}) {why} its "
                f"shared-memory connection to rank {self.me}; did it exit or crash?")

    def gone(self, header: Header, slot: Slot) -> None:
        """A message the peer's closed connection could not take: complete ``slot`` as
        sent if the peer left on purpose (a message to a rank that left is never read,
        like one written into its ring after it left), fail it if the peer died. Known
        once the peer's stream ended (its goodbye, if any, comes before the close)."""
        with self._cv:
            if not self._ended:
                self._unsent.append((header, slot))
                return
        self._settle(header, slot, None)

    def _settle(self, header: Header, slot: Slot, error: BaseException | None) -> None:
        failures = self._mailbox.failures
        if error is None and failures.left(self.rank) is not None:
            slot.finish(header)
            return
        slot.finish(None, error or failures.lost(self.rank) or self.lost("closed"))

    def _settle_unsent(self, error: BaseException | None) -> None:
        """The peer's stream ended (its fate is recorded) or the transport closes
        (``error``): settle the sends that found its connection closed."""
        with self._cv:
            self._ended = True
            unsent, self._unsent = self._unsent, []
        for header, slot in unsent:
            self._settle(header, slot, error)

    # -- sending ---------------------------------------------------------------------
    def post(self, header: Header, views: list[memoryview], slot: Slot) -> None:
        """Send one message (``views``: 1-D byte views); ``slot`` finishes once the peer
        may have every byte: written into the ring, or read by reference and acknowledged."""
        try:
            self._post(header, views, slot)
        except HungUp:  # e.g. a segment to lend could not be handed over
            self.gone(header, slot)

    def _post(self, header: Header, views: list[memoryview], slot: Slot) -> None:
        if (header.kind == _RPC and header.nbytes >= LEND_MIN and self._lends()
                and self._post_lent(header, views, slot)):
            return
        out = self._out  # a ring made by this very message is not readable yet
        if (header.nbytes >= BY_REFERENCE_MIN and out is not None and out.readable()
                and any(len(v) >= BY_REFERENCE_MIN for v in views)):
            self._post_by_reference(header, views, slot)
            return
        self.send(frame(header, views[0] if views else memoryview(b"")) + views[1:], header,
                  slot)

    def send_now(self, header: Header, views: list[memoryview]) -> bool:
        """Write one small message (``views``: 1-D byte views, at most ``SMALL_FRAME`` bytes
        in all) into the ring now, if nothing is queued before it and it fits without waiting;
        whether it was written (complete: nothing to wait for). False: nothing was written,
        send it with :meth:`post`. No Slot, no Condition: the hot path of small RPCs."""
        if header.nbytes > SMALL_FRAME or self._out is None or not self._wlock.acquire(False):
            return False
        try:  # a queued frame, or one being written by the writer thread, goes first
            if self.queue or self.closing:
                return False
            return self.outbound.try_write([_head(header), *views])
        finally:
            self._wlock.release()

    def _lends(self) -> bool:
        """Whether segments may be lent either way; their state is made on first use."""
        if self.lender is None and self.lending is not None:
            with _LENDING_LOCK:  # the sender and the reader thread may both get here first
                if self.lender is None and self.lending is not None and not self.closing:
                    self.lender, self.borrowed = self.lending(self)
        return self.lender is not None

    def _post_by_reference(self, header: Header, views: list[memoryview], slot: Slot) -> None:
        token = next(self._tokens)
        pieces, inline = [], []
        for v in views:
            if len(v) >= BY_REFERENCE_MIN:
                pieces.append(_PIECE.pack(_cma.address_of_view(v), len(v)))
            elif len(v):
                pieces.append(_PIECE.pack(0, len(v)))
                inline.append(v)
        desc = _head(header, _REF) + _DESC.pack(token, len(pieces)) + b"".join(pieces)
        written = Slot(self.rank, slot.key, None, b"")

        def failed(s: Slot) -> None:  # the descriptor never made it into the ring
            if s.error is None:
                return
            with self._cv:
                entry = self._acks.pop(token, None)
                if entry is not None:
                    self.queue.release(header.nbytes)
            if entry is not None:
                slot.finish(None, s.error)

        written.on_done = failed
        with self._cv:
            self.queue.hold(header.nbytes)  # raises past the queue's caps
            self._acks[token] = (views, header, slot)
        try:
            self.send([memoryview(desc), *inline], header, written)
        except BaseException:
            with self._cv:
                if self._acks.pop(token, None) is not None:
                    self.queue.release(header.nbytes)
            raise

    def _post_lent(self, header: Header, views: list[memoryview], slot: Slot) -> bool:
        """Copy the large pieces into segments lent to the peer and send the frame naming
        them; False (nothing sent) when the segments are all in use."""
        assert self.lender is not None
        pieces: list[bytes] = []
        inline: list[memoryview] = []
        keys: list[int] = []
        try:
            for v in views:
                if len(v) >= LEND_MIN:
                    taken = self.lender.take(len(v))
                    if taken is None:
                        for key in keys:
                            self.lender.untake(key)
                        return False
                    keys.append(taken[0])
                    ctypes.memmove(taken[1], _cma.address_of_view(v), len(v))
                    pieces.append(_PIECE.pack(taken[0], len(v)))
                elif len(v):
                    pieces.append(_PIECE.pack(0, len(v)))
                    inline.append(v)
            desc = _head(header, _LENT) + _DESC.pack(0, len(pieces)) + b"".join(pieces)
            self.send([memoryview(desc), *inline], header, slot)
        except BaseException:
            for key in keys:  # the frame was not queued: nobody will read these
                self.lender.untake(key)
            raise
        return True

    def _returned(self, key: int) -> None:
        if self.lender is not None:
            self.lender.returned(key)

    def give_back(self, key: int) -> None:
        """Return segment ``key`` that the peer lent us (its last view here was freed; runs
        in whichever thread freed it). Best effort: a peer that is gone needs nothing."""
        if self.closing or self._dead or self.eof:
            return
        frame = _HDR.pack(_RETURN, 0, key, 0, 0, 0, 0)
        if self._wlock.acquire(False):
            try:
                # unwoken: the peer reads it with its next frame (every frame it waits for
                # comes after), so a return costs it no wake-up of its reader thread.
                # Measured (1 MB echo, 2 workers, alternating blocks of 100 calls, load
                # ~8.6): 944 and 827 us per call against 1,086 and 1,040 us woken
                if (not self.queue and not self.closing and self._out is not None
                        and self._out.try_write([frame], wake=False)):
                    return
            finally:
                self._wlock.release()
        try:
            self._control(_RETURN, key)
        except Exception:  # noqa: BLE001 - a finalizer must not raise; the segment stays lent
            pass

    def _dropped(self, key: int) -> None:
        """Tell the peer that segment ``key`` (returned, so unviewed) is gone."""
        if not (self.closing or self._dead or self.eof):
            try:
                self._control(_DROP, key)
            except Exception:  # noqa: BLE001 - a peer that is gone keeps no mapping
                pass

    def _control(self, kind: int, key: int) -> None:
        self.send([memoryview(_HDR.pack(kind, 0, key, 0, 0, 0, 0))], Header(0, 0, key, 0, 0),
                  Slot(self.rank, (self.rank, 0, 0, key, 0), None, b""))

    def _acked(self, token: int) -> None:
        with self._cv:
            entry = self._acks.pop(token, None)
            if entry is not None:
                self.queue.release(entry[1].nbytes)
            self._cv.notify_all()
        if entry is None:
            raise ProtocolError(f"rank {self.rank} acknowledged message {token}, which rank "
                                f"{self.me} did not send by reference")
        entry[2].finish(entry[1])

    def _fail_acks(self, error: BaseException) -> None:
        if self.lender is not None:  # no segment will come back
            self.lender.close()
        with self._cv:
            entries = list(self._acks.values())
            self._acks.clear()
            self.queue.held = self.queue.held_count = 0
            self._cv.notify_all()
        for _, _, slot in entries:
            slot.finish(None, error)

    def send(self, parts: list[memoryview], header: Header, slot: Slot) -> None:
        """Write ``parts`` now if they fit, else queue them; ``slot`` finishes when written."""
        try:
            out = self.outbound  # made here on the first message, outside the locks below
        except HungUp:
            self.gone(header, slot)
            return
        with self._cv:
            # inline only when nothing is queued or being written and the frame fits now
            inline = not self.queue and self._wlock.acquire(blocking=False)
            if inline and sum(len(p) for p in parts) > out.free():
                self._wlock.release()
                inline = False
            if not inline:
                self.queue.push((parts, header, slot))
                if self.writer is None:
                    self.writer = threading.Thread(target=self._write_loop, daemon=True,
                                                   name=f"tandem-shm-write-{self.me}>{self.rank}")
                    self.writer.start()
                self._cv.notify()
        if inline:
            try:
                self._write(parts, header, slot)
            finally:
                self._wlock.release()

    def _check_out(self) -> None:
        if self.closing:
            raise StateError(f"rank {self.me} closed its shared-memory transport")
        if self.eof:
            raise self.hung_up()

    def _write(self, parts: list[memoryview], header: Header, slot: Slot) -> None:
        try:
            self.outbound.write(parts, self._check_out)
        except HungUp:
            self.gone(header, slot)
            return
        except TandemError as exc:
            slot.finish(None, exc)
            return
        except Exception as exc:  # noqa: BLE001 - a writer must never die silently
            self._break()
            slot.finish(None, PeerLostError(
                f"rank {self.me} failed writing to rank {self.rank} ({type(exc).__name__}: "
                f"{exc}); the connection was closed", self.rank))
            return
        slot.finish(header)

    def _break(self) -> None:
        """End the connection: the peer learns at once, as with a TCP reset."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def flush(self, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic) for queued sends to be written."""
        with self._cv:
            while (self.queue or self._acks) and not self.eof and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))

    def drain(self) -> list[Slot]:
        """Remove every queued send (the transport is closing); their slots."""
        with self._cv:
            slots = [slot for _, _, slot in self.queue.drain()]
            slots += [slot for _, _, slot in self._acks.values()]
            slots += [slot for _, slot in self._unsent]
            self._acks.clear()
            self._unsent.clear()
            self._ended = True
            self.queue.held = self.queue.held_count = 0
            return slots

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self.queue:
                    if self.closing:
                        return
                    self._cv.wait(0.5)
                parts, header, slot = self.queue.first()
            with self._wlock:
                self._write(parts, header, slot)
            with self._cv:
                if self.queue and self.queue.first()[2] is slot:
                    self.queue.popleft()
                self._cv.notify_all()

    def wake(self) -> None:
        """Wake this process's threads waiting on either ring (they re-check their state)."""
        with self._cv:
            self._cv.notify_all()
        for ring in (self._in, self._out):
            if ring is not None:
                ring.wake_local()

    # -- receiving -------------------------------------------------------------------
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
        ring = self._in
        if ring is None:
            with self._in_lock:
                ring = self._in
                if ring is None:  # counted now, applied to the ring when it arrives
                    self._early_watchers += 1 if on else -1
                    return
        ring.watch(on)

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
        if self._in is None or self._dead or self.closing or not self._rlock.acquire(False):
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
        if self._in is not None:
            self._in.wake_local()  # the reader thread, if asleep, sees _dead
        if isinstance(exc, Closed) or self.closing:
            closed = StateError(f"rank {self.me} closed its shared-memory transport")
            self._fail_acks(closed)
            self._settle_unsent(closed)
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
        self._mailbox.peer_lost(self.rank, exc)
        self._settle_unsent(None)  # its goodbye, if any, was read: the book says which

    def stop(self, exc: BaseException) -> None:
        """Stop reading from the peer and report why (from outside the reader: e.g. its
        connection closed before it wrote us anything, so no reader thread runs)."""
        with self._rlock:
            self._stop_reading(exc)

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
        if not self._lends() or self.borrowed is None:
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


