"""One local peer of the shm transport: its two rings, the send queue, the reader loop.

Frames are the TCP transport's: a fixed header (kind, group, seq, step, nbytes,
signature and call-site lengths), the signature, the call site, the payload.

Sending (:meth:`ShmPeer.send`): a frame that fits in the ring's free space right
now is copied in by the caller, which therefore never waits on the peer; any other
frame is queued to this peer's writer thread (started on first use), which waits
for space as long as it takes. Frames leave in the order they were sent, inline
or queued. Receiving (:meth:`ShmPeer.read_loop`): one thread per peer reads
frames and hands each to ``Mailbox.arrive``, which copies the payload out of the
ring straight into the posted buffer (or parks it).

    peer = ShmPeer(link, inbound_ring, outbound_ring, me=0, hostname="h")
    peer.send(header, payload, slot, check)       # caller thread
    peer.read_loop(mailbox, max_frame, closing)   # reader thread
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from tandem.errors import PeerLostError, StateError, TandemError
from tandem.transport._ring import Ring
from tandem.transport._shm_setup import Link
from tandem.transport.base import check_size
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import Header, Slot
from tandem.transport.sendqueue import SendQueue

__all__ = ["ShmPeer", "Closed", "frame"]

_HDR = struct.Struct("<BIQiQHH")


class Closed(TandemError):
    """The transport is closing: waiting threads stop quietly."""


def frame(header: Header, data: memoryview) -> list[memoryview]:
    """The views making up one frame on the wire."""
    head = _HDR.pack(header.kind, header.group, header.seq, header.step, header.nbytes,
                     len(header.sig), len(header.site)) + header.sig + header.site
    return [memoryview(head), data]


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

    def lost(self, why: str) -> PeerLostError:
        return PeerLostError(
            f"rank {self.rank} (pid {self.pid}, host {self.hostname or '?'}) {why} its "
            f"shared-memory connection to rank {self.me}; did it exit or crash?", self.rank)

    # -- sending ---------------------------------------------------------------------
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
            while self.queue and not self.eof and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))

    def drain(self) -> list[Slot]:
        """Remove every queued send (the transport is closing); their slots."""
        with self._cv:
            return [slot for _, _, slot in self.queue.drain()]

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
    def read_loop(self, mailbox: Mailbox, max_frame: int) -> None:
        """Deliver frames until the peer is gone (reported) or the transport closes."""
        ring = self.inbound

        def check() -> None:
            if self.closing:
                raise Closed()
            if self.eof and ring.empty():  # everything the peer wrote has been read
                raise self.lost("closed")

        def read(view: memoryview) -> None:
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            ring.read_into(view, check)

        head = memoryview(bytearray(_HDR.size))
        try:
            while True:
                ring.read_into(head, check, release=False)
                kind, group, seq, step, nbytes, siglen, sitelen = _HDR.unpack(head)
                check_size(nbytes, max_frame, self.rank)
                extra = bytearray(siglen + sitelen)
                if extra:
                    ring.read_into(memoryview(extra), check, release=False)
                mailbox.arrive(self.rank, Header(kind, group, seq, step, nbytes,
                                                 bytes(extra[:siglen]), bytes(extra[siglen:])),
                               read)
                ring.release()
        except Closed:
            return
        except Exception as exc:  # noqa: BLE001 - a reader must never die silently
            if self.closing:
                return
            if not isinstance(exc, PeerLostError):
                # the stream is broken (e.g. an oversized frame): end the connection, so the
                # peer learns at once, as with a TCP reset, instead of at its deadline
                self._break()
                exc = PeerLostError(
                    f"the shared-memory stream from rank {self.rank} (pid {self.pid}) to rank "
                    f"{self.me} broke ({type(exc).__name__}: {exc}); the connection was closed",
                    self.rank)
            mailbox.peer_lost(self.rank, exc)

