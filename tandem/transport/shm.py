"""Shared-memory transport: same-host ranks exchange messages through memory rings.

Usage (normally through the backend registry)::

    tandem.init_process_group("shm", ...)     # every rank on this host, or an error
    tandem.init_process_group("auto", ...)    # shm between same-host ranks, tcp across hosts
    t = ShmTransport(rank, world_size, store, secret, peers=[0, 1, 2, 3])  # directly

Each ordered pair of ranks has a single-producer/single-consumer byte ring of a
few MiB (:mod:`tandem.transport._ring`) in an anonymous memfd segment created by
the reader and handed to the writer over an authenticated UNIX socket
(:mod:`tandem.transport._shm_setup`). Frames are the TCP transport's: a fixed
header, signature, call site, payload. A payload larger than the ring streams
through it; no segment is tensor-sized.

Sending: a frame that fits in the ring's free space is copied in by the caller
(never waits, lowest latency); otherwise it is queued to a per-peer writer thread,
so a caller never blocks past its deadline on a slow or stopped peer. Receiving:
one reader thread per peer copies frames out, straight into posted memory, via
``Mailbox.arrive``. Waits spin ~50 us (yielding the CPU), then sleep on a futex.

A dead peer: the kernel closes its sockets, a watcher thread sees EOF, and the
reader reports ``PeerLostError`` after draining what the peer wrote before dying.
Hygiene: segments and sockets have no names, so normal exit, exceptions and
SIGKILL leave nothing in ``/dev/shm`` or on disk.
"""

from __future__ import annotations

import collections
import mmap
import os
import selectors
import socket
import struct
import threading
import time
from typing import Sequence

from tandem.errors import NetworkError, PeerLostError, StateError, TandemError
from tandem.store.base import Store
from tandem.transport._ring import Ring, init_segment, segment_size
from tandem.transport._shm_setup import Link, connect_local
from tandem.transport._shmem import create_segment
from tandem.transport.base import Header, Mailbox, Slot, Transport, check_size

__all__ = ["ShmTransport", "ring_capacity"]

_HDR = struct.Struct("<BIQiQHH")


class _Closed(TandemError):
    """This transport is closing: waiting threads stop quietly."""


def ring_capacity(peers: int) -> int:
    """Default bytes per ring: 4 MiB, shrinking to 256 KiB so a rank maps <= ~32 MiB."""
    cap = 4 << 20
    while cap > 256 << 10 and cap * peers > 32 << 20:
        cap >>= 1
    return cap


class _Peer:
    def __init__(self, link: Link, inbound: Ring, outbound: Ring) -> None:
        self.rank = link.peer
        self.pid = link.pid
        self.sock = link.sock
        self.inbound = inbound
        self.outbound = outbound
        self.eof = False
        self.wlock = threading.Lock()
        self.cv = threading.Condition()
        self.queue: collections.deque[tuple[list[memoryview], Header, Slot]] = collections.deque()
        self.writer: threading.Thread | None = None


class ShmTransport(Transport):
    """Connects ``rank`` to the ranks ``peers`` (default: all) of this host through memory.

    ``mailbox`` lets a mixed transport share one mailbox between shm and tcp;
    ``ring_bytes`` (a power of two) and ``spin`` (seconds) tune the rings;
    ``shm_dir`` puts segments in a directory (e.g. ``/dev/shm``) instead of memfds.
    """

    def __init__(self, rank: int, world_size: int, store: Store, secret: bytes, *,
                 peers: Sequence[int] | None = None, hostname: str = "",
                 connect_timeout: float = 60.0, max_frame: int = 16 << 30,
                 mailbox: Mailbox | None = None, ring_bytes: int | None = None,
                 spin: float = float(os.environ.get("XSPIN", "20e-6")), shm_dir: str | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.mailbox = mailbox if mailbox is not None else Mailbox(rank)
        self.hostname = hostname
        self._max_frame = max_frame
        self._closing = False
        self._threads: list[threading.Thread] = []
        local = sorted(set(range(world_size) if peers is None else peers) - {rank})
        cap = ring_bytes or int(os.environ.get("XRING", "0")) or ring_capacity(len(local))
        if cap <= 0 or cap & (cap - 1):
            raise StateError(f"ring_bytes must be a power of two, got {cap}")
        inbound: dict[int, mmap.mmap] = {}
        mine: dict[int, int] = {}
        links: dict[int, Link] = {}
        try:
            for p in local:
                mine[p] = create_segment(segment_size(cap), shm_dir)
                inbound[p] = mmap.mmap(mine[p], segment_size(cap))
                init_segment(inbound[p], cap)
            links = connect_local(store, rank, world_size, mine, secret, connect_timeout)
            self._peers = {p: _Peer(links[p], Ring(inbound[p], spin), self._map(links[p], spin))
                           for p in local}
        except BaseException:
            for link in links.values():
                link.sock.close()
            for m in inbound.values():
                m.close()
            raise
        finally:
            for fd in mine.values():
                os.close(fd)
            for link in links.values():
                os.close(link.fd)
        for peer in self._peers.values():
            peer.sock.setblocking(False)
            self._start(self._read_loop, peer, f"tandem-shm-read-{rank}<{peer.rank}")
        self._start(self._watch, None, f"tandem-shm-watch-{rank}")

    @staticmethod
    def _map(link: Link, spin: float) -> Ring:
        size = os.fstat(link.fd).st_size
        if size < segment_size(4096):
            raise NetworkError(f"rank {link.peer} handed over a {size}-byte ring")
        return Ring(mmap.mmap(link.fd, size), spin)

    def _start(self, target: object, arg: object, name: str) -> None:
        args = () if arg is None else (arg,)
        t = threading.Thread(target=target, args=args, daemon=True, name=name)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _lost(self, p: _Peer, why: str) -> PeerLostError:
        return PeerLostError(
            f"rank {p.rank} (pid {p.pid}, host {self.hostname or '?'}) {why} its shared-memory "
            f"connection to rank {self.rank}; did it exit or crash?", p.rank)

    # -- receiving -------------------------------------------------------------------
    def _read_loop(self, p: _Peer) -> None:
        ring = p.inbound

        def check() -> None:
            if self._closing:
                raise _Closed()
            if p.eof and ring.empty():
                raise self._lost(p, "closed")

        def read(view: memoryview) -> None:
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")
            ring.read_into(view, check)

        head = memoryview(bytearray(_HDR.size))
        try:
            while True:
                ring.read_into(head, check, release=False)
                kind, group, seq, step, nbytes, siglen, sitelen = _HDR.unpack(head)
                check_size(nbytes, self._max_frame, p.rank)
                extra = bytearray(siglen + sitelen)
                if extra:
                    ring.read_into(memoryview(extra), check, release=False)
                header = Header(kind, group, seq, step, nbytes, bytes(extra[:siglen]),
                                bytes(extra[siglen:]))
                self.mailbox.arrive(p.rank, header, read)
                ring.release()
        except _Closed:
            return
        except TandemError as exc:
            if not self._closing:
                error = exc if isinstance(exc, PeerLostError) else self._lost(p, f"broke ({exc})")
                self.mailbox.peer_lost(p.rank, error)

    def _watch(self) -> None:
        """Notice peers dying: the kernel closes their end of the socket."""
        sel = selectors.DefaultSelector()
        for p in self._peers.values():
            sel.register(p.sock, selectors.EVENT_READ, p)
        try:
            while not self._closing and sel.get_map():
                for key, _ in sel.select(0.5):
                    p = key.data
                    try:
                        if p.sock.recv(64):
                            continue  # peers send nothing after set-up; ignore it
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    sel.unregister(p.sock)
                    p.eof = True
                    p.inbound.wake_local()
                    p.outbound.wake_local()
        finally:
            sel.close()

    # -- sending ---------------------------------------------------------------------
    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        slot = Slot(peer, (peer, header.kind, header.group, header.seq, header.step), None, b"")
        data = payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
        if peer == self.rank:
            copy = bytes(data)

            def read(view: memoryview) -> None:
                view[:] = copy

            self.mailbox.arrive(peer, header, read)
            slot.finish(header)
            return slot
        p = self._peers.get(peer)
        if p is None:
            raise PeerLostError(f"rank {self.rank} has no shared-memory ring to rank {peer}", peer)
        lost = self.mailbox.dead.get(peer)
        if lost is not None:
            raise lost
        frame = [memoryview(_HDR.pack(header.kind, header.group, header.seq, header.step,
                                      header.nbytes, len(header.sig), len(header.site))
                            + header.sig + header.site), data]
        with p.cv:
            inline = not p.queue and len(frame[0]) + len(data) <= p.outbound.free()
            if inline:
                p.wlock.acquire()
            else:
                p.queue.append((frame, header, slot))
                if p.writer is None:
                    p.writer = threading.Thread(target=self._write_loop, args=(p,), daemon=True,
                                                name=f"tandem-shm-write-{self.rank}>{peer}")
                    self._threads.append(p.writer)
                    p.writer.start()
                p.cv.notify()
        if inline:
            try:
                self._write(p, frame, header, slot)
            finally:
                p.wlock.release()
        return slot

    def _write(self, p: _Peer, frame: list[memoryview], header: Header, slot: Slot) -> None:
        def check() -> None:
            if self._closing:
                raise StateError(f"rank {self.rank} closed its shared-memory transport")
            if p.eof:
                raise self._lost(p, "closed")

        try:
            p.outbound.write(frame, check)
        except TandemError as exc:
            slot.finish(None, exc)
            return
        slot.finish(header)

    def _write_loop(self, p: _Peer) -> None:
        while True:
            with p.cv:
                while not p.queue:
                    if self._closing:
                        return
                    p.cv.wait(0.5)
                frame, header, slot = p.queue[0]
            with p.wlock:
                self._write(p, frame, header, slot)
            with p.cv:
                p.queue.popleft()

    # -- lifetime --------------------------------------------------------------------
    def reaches(self, rank: int) -> bool:
        """Whether messages to ``rank`` go through this transport's rings."""
        return rank == self.rank or rank in self._peers

    def host_of(self, rank: int) -> str:
        return self.hostname if self.reaches(rank) else ""

    def close(self) -> None:
        """Stop every thread, close the sockets (peers see EOF) and unmap the rings."""
        if self._closing:
            return
        self._closing = True
        for p in self._peers.values():
            with p.cv:
                p.cv.notify_all()
            p.inbound.wake_local()
            p.outbound.wake_local()
            try:
                p.sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher; peers see EOF
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
        stuck = any(t.is_alive() for t in self._threads if t is not me)
        for p in self._peers.values():
            p.sock.close()
            if not stuck:  # a thread still inside a ring must not see it unmapped
                p.inbound.close()
                p.outbound.close()
