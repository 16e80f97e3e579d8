"""One local peer of the shm transport: its two rings, the send queue, the reader loop.

Frames are the TCP transport's: a fixed header (kind, group, seq, step, nbytes,
signature and call-site lengths), the signature, the call site, the payload.

Sending (:meth:`ShmPeer.send`): a frame that fits in the ring's free space right
now is copied in by the caller, which therefore never waits on the peer; any other
frame is queued to this peer's writer thread (started on first use), which waits
for space as long as it takes. Frames leave in the order they were sent, inline
or queued. Receiving (:meth:`ShmPeer.read_loop`): one thread per peer reads
frames and hands each to ``Mailbox.arrive``, which copies the payload out of the
ring straight into the posted buffer (or parks it). A thread that waits for a frame
may read it itself instead (:meth:`ShmPeer.poll`, leader/follower): whoever holds the
read lock reads the next frame, so a reply reaches its waiter without waking the
reader thread to hand it over (~35-40 us per hand-off on a busy 2-core machine).

Large payloads go *by reference* once the peer has probed that it may read this
process's memory (:mod:`~tandem.transport._cma`): the frame carries, instead of the
big pieces, their addresses and lengths (small pieces still follow in the ring); the
reader copies each big piece straight from the sender's memory into the posted
buffer (one copy instead of two, no wake-up per ring-sized piece) and answers with an
acknowledgement frame, which completes the send. Until then the sender holds the
pieces, so the memory stays valid; close waits for outstanding acknowledgements like
it waits for queued sends.

    peer = ShmPeer(link, inbound_ring, outbound_ring, me=0, hostname="h")
    peer.send(header, payload, slot, check)       # caller thread
    peer.read_loop(mailbox, max_frame)            # reader thread
    peer.watch(True); peer.poll(); peer.watch(False)  # any thread that waits for a frame
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
import time
from typing import Callable

from tandem.errors import PeerLostError, ProtocolError, StateError, TandemError
from tandem.transport import _cma
from tandem.transport._ring import Ring
from tandem.transport._shm_setup import Link
from tandem.transport.base import Reader, check_size
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import Header, Slot
from tandem.transport.sendqueue import SendQueue

__all__ = ["ShmPeer", "Closed", "frame", "BY_REFERENCE_MIN"]

_HDR = struct.Struct("<BIQiQHH")
_REF, _ACK = 0x80, 0x40  # kind-byte flags: the payload goes by reference; an acknowledgement
_DESC = struct.Struct("<QI")  # by reference: token, number of pieces
_PIECE = struct.Struct("<QQ")  # address in the sender (0: the bytes follow in the ring), length
_MAX_PIECES = 1 << 16
# Pieces at least this large go by reference. Below ~1 MiB the ring's two copies are cheap
# and need no acknowledgement; measured in tandem.bench rpc (16 MB echo).
BY_REFERENCE_MIN = 1 << 20
_LOCK_S = 0.1  # the reader thread re-checks the transport's state this often while a
# polling thread reads


class Closed(TandemError):
    """The transport is closing: waiting threads stop quietly."""


def _head(header: Header, flags: int = 0) -> bytes:
    return _HDR.pack(header.kind | flags, header.group, header.seq, header.step, header.nbytes,
                     len(header.sig), len(header.site)) + header.sig + header.site


def frame(header: Header, data: memoryview) -> list[memoryview]:
    """The views making up one frame on the wire."""
    return [memoryview(_head(header)), data]


class ShmPeer:
    """Rank ``link.peer`` as seen from rank ``me``."""

    def __init__(self, link: Link, inbound: Ring, outbound: Ring, me: int, hostname: str) -> None:
        self.rank = link.peer
        self.pid = link.pid
        self.sock = link.sock
        self.inbound = inbound
        self.outbound = outbound
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
        self._rlock = threading.Lock()  # held by whichever thread reads a frame
        self._mailbox: Mailbox | None = None  # set when the reader thread starts
        self._max_frame = 0
        self._probed = False
        self._dead = False  # no more frames: the peer is gone or the stream broke
        self._head = memoryview(bytearray(_HDR.size))

    def lost(self, why: str) -> PeerLostError:
        return PeerLostError(
            f"rank {self.rank} (pid {self.pid}, host {self.hostname or '?'}) {why} its "
            f"shared-memory connection to rank {self.me}; did it exit or crash?", self.rank)

    # -- sending ---------------------------------------------------------------------
    def post(self, header: Header, views: list[memoryview], slot: Slot) -> None:
        """Send one message (``views``: 1-D byte views); ``slot`` finishes once the peer
        may have every byte: written into the ring, or read by reference and acknowledged."""
        if (header.nbytes >= BY_REFERENCE_MIN and self.outbound.readable()
                and any(len(v) >= BY_REFERENCE_MIN for v in views)):
            self._post_by_reference(header, views, slot)
            return
        self.send(frame(header, views[0] if views else memoryview(b"")) + views[1:], header,
                  slot)

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
        with self._cv:
            entries = list(self._acks.values())
            self._acks.clear()
            self.queue.held = self.queue.held_count = 0
            self._cv.notify_all()
        for _, _, slot in entries:
            slot.finish(None, error)

    def send(self, parts: list[memoryview], header: Header, slot: Slot) -> None:
        """Write ``parts`` now if they fit, else queue them; ``slot`` finishes when written."""
        with self._cv:
            # inline only when nothing is queued or being written and the frame fits now
            inline = not self.queue and self._wlock.acquire(blocking=False)
            if inline and sum(len(p) for p in parts) > self.outbound.free():
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
            raise self.lost("closed")

    def _write(self, parts: list[memoryview], header: Header, slot: Slot) -> None:
        try:
            self.outbound.write(parts, self._check_out)
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
            self._acks.clear()
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
        self.inbound.wake_local()
        self.outbound.wake_local()

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
        try:
            while not self._dead:
                if not self._probed:  # before the first frame if the peer announced itself
                    with self._rlock:
                        self._probed = self._probed or self._probe()
                ring.wait_readable(self._check_in)
                if not self._rlock.acquire(timeout=_LOCK_S):
                    continue  # a poller is inside a (large) frame; check again
                try:
                    if not self._dead and not ring.empty():
                        self._frame(mailbox, max_frame)
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
        head = self._head
        ring.read_into(head, self._check_in, release=False)
        kind, group, seq, step, nbytes, siglen, sitelen = _HDR.unpack(head)
        if kind & _ACK:
            ring.release()
            self._acked(seq)
            return
        check_size(nbytes, max_frame, self.rank)
        extra = bytearray(siglen + sitelen)
        if extra:
            ring.read_into(memoryview(extra), self._check_in, release=False)
        header = Header(kind & ~_REF, group, seq, step, nbytes, bytes(extra[:siglen]),
                        bytes(extra[siglen:]))
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

    def _by_reference(self, nbytes: int, check: Callable[[], None]
                      ) -> tuple[int, Reader, Callable[[], bool]]:
        """Read a by-reference frame's piece table; return its token, a reader of the
        payload and whether the payload was read to its end."""
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

