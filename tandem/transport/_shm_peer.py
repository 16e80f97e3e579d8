"""One local peer of the shm transport: its two rings, the send queue, the sending half.

Frames are the TCP transport's: a fixed header (kind, group, seq, step, nbytes,
signature and call-site lengths), the signature, the call site, the payload.

Sending (:meth:`ShmPeer.send`): a frame that fits in the ring's free space right
now is copied in by the caller, which therefore never waits on the peer; any other
frame is queued to this peer's writer thread (started on first use), which waits
for space as long as it takes. Frames leave in the order they were sent, inline
or queued. A small message may skip even that (:meth:`ShmPeer.send_now`, the RPC hot
path): header and payload go into the ring at once, with no send handle, when nothing is
queued before them. Receiving is the other half (:mod:`~tandem.transport._shm_receive`): the
peer's reader thread, or a thread that waits for a frame and reads it itself.

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

    peer = ShmPeer(link, inbound_ring, outbound_ring, me=0, hostname="h")
    peer.send_now(header, views) or peer.post(header, views, slot)  # caller thread
    peer.read_loop(mailbox, max_frame)            # reader thread
    peer.watch(True); peer.poll(); peer.watch(False)  # any thread that waits for a frame
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import threading
import time

from tandem.errors import PeerLostError, ProtocolError, StateError, TandemError
from tandem.transport import _cma
from tandem.transport._lend import LEND_MIN, Lender
from tandem.transport._ring import Ring
from tandem.transport._shm_receive import (_DESC, _DROP, _HDR, _LENT, _PIECE, _REF, _RETURN,
                                           SMALL_FRAME, Closed, Receiver)
from tandem.transport._shm_setup import Link
from tandem.transport.message import Header, Kind, Slot
from tandem.transport.sendqueue import SendQueue

__all__ = ["ShmPeer", "Closed", "frame", "BY_REFERENCE_MIN"]

# Pieces at least this large go by reference. Below ~1 MiB the ring's two copies are cheap
# and need no acknowledgement; measured in tandem.bench rpc (16 MB echo).
BY_REFERENCE_MIN = 1 << 20


_RPC = Kind.RPC


def _head(header: Header, flags: int = 0) -> bytes:
    return _HDR.pack(header.kind | flags, header.group, header.seq, header.step, header.nbytes,
                     len(header.sig), len(header.site)) + header.sig + header.site


def frame(header: Header, data: memoryview) -> list[memoryview]:
    """The views making up one frame on the wire."""
    return [memoryview(_head(header)), data]


class ShmPeer(Receiver):
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
        self.lender: Lender | None = None  # segments lent to the peer (set by the transport)
        Receiver.__init__(self)

    def lost(self, why: str) -> PeerLostError:
        return PeerLostError(
            f"rank {self.rank} (pid {self.pid}, host {self.hostname or '?'}) {why} its "
            f"shared-memory connection to rank {self.me}; did it exit or crash?", self.rank)

    # -- sending ---------------------------------------------------------------------
    def post(self, header: Header, views: list[memoryview], slot: Slot) -> None:
        """Send one message (``views``: 1-D byte views); ``slot`` finishes once the peer
        may have every byte: written into the ring, or read by reference and acknowledged."""
        if (header.kind == _RPC and header.nbytes >= LEND_MIN and self.lender is not None
                and self._post_lent(header, views, slot)):
            return
        if (header.nbytes >= BY_REFERENCE_MIN and self.outbound.readable()
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
        if header.nbytes > SMALL_FRAME or not self._wlock.acquire(False):
            return False
        try:  # a queued frame, or one being written by the writer thread, goes first
            if self.queue or self.closing:
                return False
            return self.outbound.try_write([_head(header), *views])
        finally:
            self._wlock.release()

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
                if not self.queue and not self.closing and self.outbound.try_write(
                        [frame], wake=False):
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
