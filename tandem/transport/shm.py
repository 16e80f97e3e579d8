"""Shared-memory transport: same-host ranks exchange messages through memory rings.

Usage (normally through the backend registry)::

    tandem.init_process_group("shm", ...)     # every rank on this host, or an error
    tandem.init_process_group("auto", ...)    # shm between same-host ranks, tcp across hosts
    t = ShmTransport(rank, world_size, store, secret, peers=[0, 1, 2, 3])  # directly

Each ordered pair of ranks that talks has a single-producer/single-consumer byte
ring of up to a few MiB (:mod:`~tandem.transport._ring`) in an anonymous memfd
segment. Start-up only connects every pair of local ranks with an authenticated
UNIX socket (:mod:`~tandem.transport._shm_setup`); a ring is made by its writer on
the first message in its direction and handed to the reader over that socket, and
the reader's thread for that peer starts when it arrives. Same-host collectives go
through the arena, so most pairs never make a ring: at 32 ranks, reserving all
31 x 32 of them at start-up took half of each rank's start-up time. Frames are the TCP transport's; a payload
larger than the ring streams through it, so no segment is tensor-sized. A frame
that fits is copied in by the caller (never waiting on the peer); others go to a
per-peer writer thread; one reader thread per peer that wrote to us copies frames out straight
into posted memory (:mod:`~tandem.transport._shm_peer`). Waits poll briefly, then sleep
on a futex (:func:`default_spin`). Payloads of 1 MiB and more skip the ring where the
kernel lets the reader copy them straight out of the writer's memory (cross-memory
attach, :mod:`~tandem.transport._cma`): one copy instead of two.

Collectives of a same-host group also get an *arena* (:meth:`ShmTransport.arena`,
:mod:`~tandem.transport._arena`): its first member creates one segment holding
every member's staging area and hands it to each other member over the same
authenticated sockets (members - 1 hand-overs, one mapping each); each member
reserves its own staging as its calls first write it. When one host holds the whole
job, the default group's arena is made by the first rank before the others connect
and sent with each rank's sockets (``first_arena``): the first collective maps it at
once instead of waiting for the first rank to arrive and hand it over.

A dead peer: the kernel closes its sockets, a watcher thread sees EOF, and the
reader reports ``PeerLostError`` once it has drained what the peer wrote before
dying (the watcher reports it at once if the peer never wrote to us). A rank that
closes says goodbye through the ring, or, if it never wrote to that peer, in a
record on the socket (as are aborts to such a peer). A message to a peer whose
connection closed completes unread if the peer said goodbye and fails if it died,
decided once everything it sent was read (``ShmPeer.gone``). Hygiene: segments and sockets have no names (memfd, abstract UNIX
sockets), so normal exit, exceptions and SIGKILL leave nothing behind.
"""

from __future__ import annotations

import mmap
import os
import selectors
import socket
import struct
import threading
import time
from typing import Callable, Sequence

from tandem.config import at_most, memory_text, shm_chunk_limit, size_text
from tandem.errors import (ArgumentError, CollectiveTimeoutError, NetworkError, PeerLostError,
                           ProtocolError, StateError, TandemError)
from tandem.store.base import Store
from tandem.transport._arena import Arena, default_chunk, segment_bytes, CONTROL_BYTES
from tandem.transport._lend import KEY_BIT, Borrowed, Lender, lend_budget
from tandem.transport._ring import DATA_OFFSET, Ring, init_segment, initial_data, segment_size
from tandem.transport._shm_peer import HungUp, ShmPeer, frame, unframe
from tandem.transport._shm_setup import Link, Segment, connect_local
from tandem.transport import forks
from tandem.transport._shmem import create_segment, reserve_more, unsupported_reason
from tandem.transport.base import Poller, Transport, check_header, join_all, one_drop_warning
from tandem.transport.mailbox import DEFAULT_PARK_LIMIT, Mailbox
from tandem.transport.message import Header, Kind, Slot
from tandem.transport.sendqueue import DEFAULT_SEND_LIMIT, BoundedSends, SendQueue

__all__ = ["ShmTransport", "ring_capacity", "default_spin", "unsupported_reason"]

_JOIN_S = 2.0  # how long close() waits for this transport's threads to end
_CHECK_S = 0.1  # how often a wait for an arena hand-over runs its caller's check

_MIN_RING = 4096
_OFFER = struct.Struct("<QQ")  # a segment handed over the socket: key, bytes
# keys of records on the socket apart from arena (group ids) and lent (KEY_BIT) ones:
_RING_KEY = 1 << 63  # the sender's ring to us (fd attached)
# news (an abort or a goodbye) from a sender that never wrote to us: a whole frame
# follows the record (no fd); a ring made for it would cost the sender 1-4 MiB and,
# under load, enough time that news to later peers missed the sender's exit
_NEWS_KEY = (1 << 63) | 1
_NEWS_KINDS = (Kind.ABORT, Kind.BYE)
_NEWS_MAX = 64 << 10  # bytes of a news frame sent on the socket; larger ones take the ring


def _reader(payload: bytes, peer: int) -> Callable[[memoryview], None]:
    """Reads ``payload`` in order into the views it is given."""
    at = 0

    def read(view: memoryview) -> None:
        nonlocal at
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        if at + len(view) > len(payload):
            raise ProtocolError(f"read past the end of a message from rank {peer}")
        view[:] = payload[at:at + len(view)]
        at += len(view)

    return read


def _check_chunk(chunk: int | None, members: int) -> None:
    if chunk:
        # before the segment is reserved: posix_fallocate of more than the host has
        # would run it out of memory, and the OOM killer stops other jobs' processes
        limit = shm_chunk_limit(members)
        at_most("TANDEM_SHM_CHUNK", chunk, limit,
                f"{size_text(limit)} for {members} ranks on this host: the two "
                f"staging halves of all of them together may take a quarter of the "
                f"{memory_text()}",
                f"unset it (0 picks 1-4 MiB) or choose a power of two up to {limit}")


def default_spin(local_ranks: int) -> float:
    """Seconds a waiter polls before sleeping: long only if every local rank has a CPU.

    Measured on a 2-vCPU VM, 2 ranks: polling up to 300 us (with sched_yield) halved
    the 4 KB round trip (~210 us vs 360-520 us), since a sleeping vCPU wakes slowly;
    with 4 ranks on those 2 CPUs it gained nothing, so oversubscribed hosts sleep soon.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 200e-6 if local_ranks <= (cpus or 1) else 5e-6


def ring_capacity(peers: int) -> int:
    """Default bytes per ring: 4 MiB, shrinking to 256 KiB so a rank maps <= ~32 MiB."""
    cap = 4 << 20
    while cap > 256 << 10 and cap * peers > 32 << 20:
        cap >>= 1
    return cap


class ShmTransport(BoundedSends, Transport):
    """Connects ``rank`` to the ranks ``peers`` (default: all) of this host through memory.

    ``mailbox`` lets a mixed transport share one mailbox between shm and tcp;
    ``ring_bytes`` (a power of two) and ``spin`` (seconds) tune the rings; ``shm_dir``
    puts segments in a directory (e.g. ``/dev/shm``) instead of anonymous memfds;
    ``first_arena`` (group key, chunk; 0: the default) has the first rank make that
    group's arena over every rank of this transport at init (:meth:`arena`).
    """

    def __init__(self, rank: int, world_size: int, store: Store, secret: bytes, *,
                 peers: Sequence[int] | None = None, hostname: str = "",
                 connect_timeout: float = 60.0, max_frame: int = 16 << 30,
                 mailbox: Mailbox | None = None, ring_bytes: int | None = None,
                 spin: float | None = None, shm_dir: str | None = None,
                 park_limit: int = DEFAULT_PARK_LIMIT,
                 send_limit: int = DEFAULT_SEND_LIMIT,
                 first_arena: tuple[int, int] | None = None) -> None:
        local = sorted(set(range(world_size) if peers is None else peers) - {rank})
        cap = ring_bytes or ring_capacity(len(local))
        if cap < _MIN_RING or cap & (cap - 1):
            raise ArgumentError(f"ring_bytes must be a power of two >= {_MIN_RING}, got {cap}")
        # a ring per ordered pair of local ranks: n (n - 1) of them, twice n (n - 1) / 2
        pairs = max(1, len(local) * (len(local) + 1) // 2)
        at_most("ring_bytes", cap, shm_chunk_limit(pairs),
                f"the rings of all local ranks together may take a quarter of the "
                f"{memory_text()}", "leave it unset or lower it")
        self.rank = rank
        self.world_size = world_size
        if mailbox is None:  # a shared mailbox's owner (the mixed transport) sets the reply
            mailbox = Mailbox(rank, park_limit)
            mailbox.reply = lambda peers, group, error: self.abort(group, peers, error)
        self.mailbox = mailbox
        self.hostname = hostname
        self._closing = False
        self._threads: list[threading.Thread] = []
        spin = default_spin(len(local) + 1) if spin is None else spin
        self._spin = spin
        self._shm_dir = shm_dir
        self._connect_timeout = connect_timeout
        self._ring_bytes = cap
        self._max_frame = max_frame
        self._threads_lock = threading.Lock()
        # arena segments peers handed us: (peer, key) -> (fd, bytes)
        self._offers: dict[tuple[int, int], tuple[int, int]] = {}
        self._offer_cv = threading.Condition()
        # the first rank's arena for group key ``first_arena[0]`` over all of this
        # transport's ranks, made and handed over at init: (key, members, fd, bytes)
        self._premade: tuple[int, list[int], int, int] | None = None
        everyone = sorted(local + [rank])
        self._local_ranks = len(everyone)
        gift: Segment | None = None
        if first_arena is not None and local and rank == everyone[0]:
            # made before the others connect (this rank waits for them anyway), handed
            # over in the same message as each rank's sockets: the first collective
            # waits for no hand-over, nor for a watcher thread to take one
            key, chunk = first_arena
            gift = Segment(key, *self._make_segment(everyone, chunk or None))
            self._premade = (key, everyone, gift.fd, gift.size)
        # started once what the others wait for is out (its address or hello), while this
        # rank waits for them: Thread.start waits for the new thread to get a CPU
        self._connected = threading.Event()
        watching: list[bool] = []

        def watch() -> None:
            if not watching:
                watching.append(True)
                self._start(self._watch, (), f"tandem-shm-watch-{rank}")

        try:
            links, got = connect_local(store, rank, world_size, local, secret,
                                       connect_timeout, gift, watch)
            watch()  # no local peer to wait for: now
            if got is not None:  # the first rank's, for the same group over the same ranks
                self._premade = (got.key, everyone, got.fd, got.size)
            self._peers = {p: self._peer(links[p]) for p in local}
            self._lend_budget = lend_budget(len(local))
            for peer in self._peers.values():
                peer.lending = self._lending
                peer.sock.setblocking(False)
        except BaseException:
            self._closing = True  # the watcher leaves without looking
            self._connected.set()
            self._drop_premade()
            raise
        self._connected.set()
        self.send_limit = send_limit
        forks.track(self)


    def _peer(self, link: Link) -> ShmPeer:
        peer: ShmPeer | None = None

        def open_ring() -> Ring:
            assert peer is not None
            return self._open_ring(peer)

        peer = ShmPeer(link, self.rank, self.hostname, open_ring, self.mailbox)
        return peer

    def _open_ring(self, peer: ShmPeer) -> Ring:
        """Make the ring this rank writes to ``peer`` and hand it over (first message)."""
        if self._closing:
            raise StateError(f"rank {self.rank} closed its shared-memory transport")
        size = segment_size(self._ring_bytes)
        # the rest is reserved as writes reach it: a pair that only ever exchanges small
        # messages (the first barrier across hosts) reserves 64 KiB instead of 1-4 MiB
        fd = create_segment(size, self._shm_dir,
                            reserve=DATA_OFFSET + initial_data(self._ring_bytes))
        try:
            mm = mmap.mmap(fd, size)
            init_segment(mm, self._ring_bytes)
        except BaseException:
            os.close(fd)
            raise
        ring = Ring(mm, self._spin, fd, self._where())  # it owns fd now
        try:
            ring.announce(os.getpid())  # where the peer may read us by reference (_cma)
            self._offer(peer, _RING_KEY, ring.descriptor(), size)
            ring.handed_over()
        except BaseException:
            ring.close()
            raise
        return ring

    def _take_ring(self, peer: ShmPeer, fd: int, size: int) -> None:
        """The ring ``peer`` writes to us arrived (watcher thread): map it, start reading."""
        try:
            if size < segment_size(_MIN_RING) or os.fstat(fd).st_size != size:
                raise NetworkError(f"rank {peer.rank} handed over a bad {size}-byte ring")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            peer.take_inbound(Ring(mm, self._spin), self._max_frame)
        except BaseException:
            mm.close()
            raise
        with self._threads_lock:
            if not self._closing:
                self._start(peer.read_loop, (self.mailbox, self._max_frame),
                            f"tandem-shm-read-{self.rank}<{peer.rank}")

    def _lending(self, peer: ShmPeer) -> tuple[Lender, Borrowed]:
        """What lets ``peer``'s large RPC pieces travel in shared segments (see ``_lend``):
        made by the peer on its first such message, so a pair that never sends one pays
        nothing for it at init (31 of them per rank at 32 ranks on a host)."""
        def offer(key: int, fd: int, size: int) -> None:
            self._offer(peer, KEY_BIT | key, fd, size)

        def accept(key: int) -> mmap.mmap:
            deadline = time.monotonic() + self._connect_timeout
            return self._accept_offer(peer.rank, KEY_BIT | key, deadline, 1)

        return Lender(self._lend_budget, self._shm_dir, offer, peer._dropped), Borrowed(accept)

    def _send_queues(self) -> list[SendQueue]:
        return [p.queue for p in self._peers.values()]

    def forget_in_child(self) -> None:
        """In a forked child (e.g. a DataLoader worker): never use the rings, and drop the
        inherited sockets, or this process's death would go unseen by its peers."""
        if not self._closing:
            self._closing = True  # the child has no threads of ours
            for p in self._peers.values():
                p.closing = True
                p.sock.close()  # the child's copy only: the parent's connection stays up

    def _start(self, target: object, args: tuple[object, ...], name: str) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=name)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _watch(self) -> None:
        """Notice peers dying (the kernel closes their end of the socket) and take the
        arena segments they hand over (:meth:`arena`)."""
        self._connected.wait(self._connect_timeout + 5.0)  # set however set-up ends
        if self._closing or not self._connected.is_set():
            return
        sel = selectors.DefaultSelector()
        pending: dict[int, tuple[bytearray, list[int]]] = {}
        for p in self._peers.values():
            sel.register(p.sock, selectors.EVENT_READ, p)
            pending[p.rank] = (bytearray(), [])
        try:
            while not self._closing and sel.get_map():
                for key, _ in sel.select(0.5):
                    p = key.data
                    try:
                        data, fds, _, _ = socket.recv_fds(p.sock, 4096, 16)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data, fds = b"", []
                    if data or fds:
                        try:
                            self._take_offers(p, data, fds, *pending[p.rank])
                        except ProtocolError as exc:
                            p.stop(exc)  # this peer's stream is broken; the others go on
                        continue
                    sel.unregister(p.sock)
                    p.eof = True
                    if p.has_rings()[0]:
                        p.wake()  # its reader drains the ring, then reports the loss
                    else:
                        p.stop(p.lost("closed"))  # it never wrote to us: nothing to drain
                    with self._offer_cv:
                        self._offer_cv.notify_all()
        except Exception as exc:  # noqa: BLE001 - unwatched peers could die unnoticed
            if not self._closing:
                for p in self._peers.values():
                    p.closing = True  # its reader stops; the loss below is the news
                    p.wake()
                    self.mailbox.peer_lost(p.rank, PeerLostError(
                        f"rank {self.rank} stopped watching its shared-memory connections "
                        f"({type(exc).__name__}: {exc}); rank {p.rank} can no longer be "
                        f"reached", p.rank))
                    try:
                        p.sock.shutdown(socket.SHUT_RDWR)  # the peer learns at once
                    except OSError:
                        pass
        finally:
            sel.close()
            for _, fds in pending.values():
                for fd in fds:
                    os.close(fd)

    def _take_offers(self, p: ShmPeer, data: bytes, fds: list[int], buf: bytearray,
                     queued: list[int]) -> None:
        """Records arrive as bytes; each one's descriptor (all but a goodbye's) comes
        with its first byte."""
        buf += data
        queued += fds
        peer = p.rank
        while len(buf) >= _OFFER.size:
            key, size = _OFFER.unpack_from(buf)
            if key == _NEWS_KEY:
                if size > _NEWS_MAX:
                    raise ProtocolError(f"rank {peer} sent a {size}-byte message on its "
                                        f"shared-memory socket (at most {_NEWS_MAX})")
                if len(buf) < _OFFER.size + size:
                    return  # the rest of the frame comes with the next read
                blob = bytes(buf[_OFFER.size:_OFFER.size + size])
                del buf[:_OFFER.size + size]
                header, payload = unframe(blob, peer)
                self.mailbox.arrive(peer, header, _reader(payload, peer))
                continue
            if not queued:
                return
            del buf[:_OFFER.size]
            fd = queued.pop(0)
            if key == _RING_KEY:
                try:
                    self._take_ring(p, fd, size)
                except (TandemError, OSError, ValueError) as exc:
                    p.stop(exc)  # this peer's stream is broken; the others go on
                continue
            with self._offer_cv:
                old = self._offers.pop((peer, key), None)
                self._offers[(peer, key)] = (fd, size)
                self._offer_cv.notify_all()
            if old is not None:
                os.close(old[0])

    def shares_memory_with(self, ranks: Sequence[int]) -> bool:
        return all(self.reaches(r) for r in ranks)

    def arena(self, key: int, members: Sequence[int], chunk: int | None = None,
              timeout: float | None = None,
              check: Callable[[], None] | None = None) -> Arena:
        """Map the staging areas of ``members``: one segment, made by the first member
        and handed to each other one (members - 1 hand-overs, one mapping each).

        Collective over ``members`` (global ranks, all on this host, this rank among
        them); ``key`` (e.g. the group id) tells concurrent calls apart. The area size
        is the first member's choice, so members that computed different defaults
        still agree. The arena made at init (``first_arena``) serves the first call
        with its key and every rank of this transport as members, whatever ``chunk``.
        """
        if not self.shares_memory_with(members) or self.rank not in members:
            raise ArgumentError(f"an arena needs ranks that share memory with rank "
                                f"{self.rank}, got {list(members)}")
        _check_chunk(chunk, len(members))  # again: the host's memory may have changed
        members = list(members)
        first, count = members[0], len(members)
        premade = self._premade
        if premade is not None and premade[0] == key:  # one call with its key uses it
            self._premade = None
            if premade[1] != members:  # the key's group is not every rank of this host
                os.close(premade[2])
                premade = None
        else:
            premade = None
        if premade is not None:
            # made or handed over at init (its size the first rank's choice, as always)
            fd = premade[2]
            if self.rank == first:
                try:
                    whole = mmap.mmap(fd, premade[3])
                except BaseException:
                    os.close(fd)
                    raise
            else:
                whole = self._map_handed(first, fd, premade[3], count * segment_bytes(4096))
                self._check_split(first, whole, fd, count)
        elif self.rank == first:
            fd, size = self._make_segment(members, chunk)
            try:
                whole = mmap.mmap(fd, size)
                try:
                    for r in members[1:]:
                        try:
                            self._offer(self._peers[r], key, fd, size)
                        except HungUp as exc:  # a member that is gone cannot take part
                            raise self._peers[r].lost("closed") from exc
                except BaseException:
                    whole.close()
                    raise
            except BaseException:
                os.close(fd)
                raise
        else:
            deadline = time.monotonic() + (timeout or self._connect_timeout)
            whole, fd = self._accept_segment(first, key, deadline, count * segment_bytes(4096),
                                             check)
            self._check_split(first, whole, fd, count)
        per = len(whole) // count
        return Arena(members, members.index(self.rank), whole, (per - CONTROL_BYTES) // 2,
                     self._spin, fd, self._where())

    @staticmethod
    def _check_split(first: int, whole: mmap.mmap, fd: int, count: int) -> None:
        """Refuse (closing both) a segment that is not ``count`` whole areas of pages."""
        if len(whole) % count or (len(whole) // count) % mmap.PAGESIZE:
            size = len(whole)
            whole.close()
            os.close(fd)
            raise NetworkError(f"rank {first} handed over a {size}-byte arena for "
                               f"{count} ranks: not {count} whole areas of pages")

    def _make_segment(self, members: Sequence[int], chunk: int | None) -> tuple[int, int]:
        """A new arena segment for ``members`` (``chunk`` None: the default): its
        descriptor and size, only the control areas reserved."""
        _check_chunk(chunk, len(members))
        per = segment_bytes(chunk or default_chunk(self._local_ranks))
        count = len(members)
        # only the control areas now (peers write sleep flags there); each member
        # reserves its own staging as its calls first need it (Arena): 64 MiB
        # reserved here while the others waited took most of the first barrier
        fd = create_segment(per * count, self._shm_dir, "tandem-arena", CONTROL_BYTES)
        try:
            for q in range(1, count):
                reserve_more(fd, q * per, CONTROL_BYTES, self._where())
        except BaseException:
            os.close(fd)
            raise
        return fd, per * count

    def _drop_premade(self) -> None:
        premade, self._premade = self._premade, None
        if premade is not None:
            os.close(premade[2])

    def _where(self) -> str:
        """Where this transport's segments live, for a full-memory error."""
        return self._shm_dir or "memory (memfd)"

    def _offer(self, peer: ShmPeer, key: int, fd: int | None, size: int,
               follow: bytes = b"") -> None:
        """Send a record (``follow``: bytes after it) with ``fd`` attached, if any."""
        deadline = time.monotonic() + self._connect_timeout
        data = memoryview(_OFFER.pack(key, size) + follow)
        fds = [] if fd is None else [fd]
        while True:
            try:
                sent = socket.send_fds(peer.sock, [data], fds) if fds else peer.sock.send(data)
                data, fds = data[sent:], []  # the descriptor went with the first byte
                if not data:
                    return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NetworkError(f"rank {peer.rank} does not take its shared-memory "
                                       f"arena segment from rank {self.rank}") from None
                time.sleep(0.001)
            except OSError as exc:
                raise peer.hung_up() from exc

    def _news(self, p: ShmPeer, header: Header, pieces: Sequence[memoryview]) -> None:
        blob = b"".join([bytes(v) for v in frame(header, memoryview(b""))] +
                        [bytes(v) for v in pieces])
        self._offer(p, _NEWS_KEY, None, len(blob), blob)

    def _accept_offer(self, peer: int, key: int, deadline: float,
                      smallest: int = segment_bytes(4096)) -> mmap.mmap:
        mapped, fd = self._accept_segment(peer, key, deadline, smallest)
        os.close(fd)
        return mapped

    def _accept_segment(self, peer: int, key: int, deadline: float, smallest: int,
                        check: Callable[[], None] | None = None) -> tuple[mmap.mmap, int]:
        """The segment ``peer`` offered under ``key``, mapped, and its descriptor;
        ``check()`` (run between waits, outside the lock the watcher takes to deliver
        news) may raise: a group abort or a member's death ends the wait at once."""
        p = self._peers[peer]
        while True:
            with self._offer_cv:
                if (peer, key) in self._offers:
                    fd, size = self._offers.pop((peer, key))
                    break
                if self._closing:
                    raise StateError(f"rank {self.rank} closed its shared-memory transport")
                if p.eof:
                    raise p.lost("closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeoutError(
                        f"rank {peer} did not hand rank {self.rank} its shared-memory arena "
                        f"segment (key {key}) in time: did it call the same collective?",
                        (peer,))
                self._offer_cv.wait(min(left, 0.5 if check is None else _CHECK_S))
            if check is not None:
                check()
        return self._map_handed(peer, fd, size, smallest), fd

    @staticmethod
    def _map_handed(peer: int, fd: int, size: int, smallest: int) -> mmap.mmap:
        """Map the segment ``peer`` handed over as ``size`` bytes, or refuse it (closing
        ``fd``) when it is not that size or is under ``smallest`` bytes."""
        try:
            if os.fstat(fd).st_size != size or size < smallest:
                raise NetworkError(f"rank {peer} handed over a bad shared segment ({size} bytes)")
            return mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise

    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        data = payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
        if peer == self.rank:
            return self._send_to_self(header, data)
        return self.isendv(peer, header, [data])

    def isendv(self, peer: int, header: Header, pieces: Sequence[memoryview]) -> Slot:
        if peer == self.rank:
            return super().isendv(peer, header, pieces)
        p = self._peers.get(peer)
        self._check_peer(peer, p is not None, "shared-memory ring")
        assert p is not None
        check_header(header, self._max_frame, peer)
        slot = self._send_slot(peer, header)
        try:
            told = (header.kind in _NEWS_KINDS and header.nbytes <= _NEWS_MAX // 2
                    and p.send_unwritten(lambda: self._news(p, header, pieces)))
        except HungUp:
            p.gone(header, slot)
            return slot
        if told:
            slot.finish(header)  # no ring made just to tell
            return slot
        views = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in pieces]
        p.post(header, views, slot)
        return slot

    def send_now(self, peer: int, header: Header, pieces: Sequence[memoryview]) -> bool:
        """A frame that fits the ring's free space goes in at once: one lock, no Slot."""
        p = self._peers.get(peer)
        if p is None or self.mailbox.failures.lost(peer) is not None:
            return False  # isendv says what is wrong
        check_header(header, self._max_frame, peer)
        for b in pieces:
            if b.format != "B" or b.ndim != 1:
                return False
        return p.send_now(header, pieces if type(pieces) is list else list(pieces))

    def poller(self, peer: int) -> Poller | None:
        return self._peers.get(peer)

    def reaches(self, rank: int) -> bool:
        """Whether messages to ``rank`` go through this transport's rings."""
        return rank == self.rank or rank in self._peers

    def host_of(self, rank: int) -> str:
        return self.hostname if self.reaches(rank) else ""

    def close(self) -> None:
        """Say goodbye, let queued sends go out briefly, stop every thread, close the
        sockets (peers see EOF) and unmap the rings; pending operations fail."""
        with one_drop_warning(self.rank):  # every peer's dropped sends in one warning
            self._close()

    def _close(self) -> None:
        if self._closing:
            return
        self._take_leave(self._peers.values())
        with self._threads_lock:  # no reader thread starts after this
            self._closing = True
        forks.untrack(self)
        self.mailbox.close(self.closed_error())
        for p in self._peers.values():
            p.closing = True
            self.give_up_sends(p.drain())
            p.wake()
            try:
                p.sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher; peers see EOF
            except OSError:
                pass
        with self._threads_lock:
            threads = list(self._threads)
        stuck = not join_all(threads + [p.writer for p in self._peers.values()], _JOIN_S)
        deadline = time.monotonic() + _JOIN_S  # threads polling a ring (RPC callers) leave it
        stuck = not all([p.quiesce(deadline) for p in self._peers.values()]) or stuck
        for p in self._peers.values():
            p.sock.close()
            if p.lender is not None:
                p.lender.close()
            if p.borrowed is not None:
                p.borrowed.clear()
            if not stuck:  # a thread still inside a ring must not see it unmapped
                for ring in (p._in, p._out):
                    if ring is not None:
                        ring.close()
        self._drop_premade()
        with self._offer_cv:  # segments offered for arenas this rank never made
            for fd, _ in self._offers.values():
                os.close(fd)
            self._offers.clear()
