"""TCP transport: authenticated connections between ranks, made on first use.

Set-up: every rank listens on its bind address (port 0, so jobs never collide) for
the transport's whole life and publishes ``host:port`` in the store (for a listener
on every interface, ``0.0.0.0``, the address peers can dial: ``advertise``). Only host
leaders (each host's lowest rank) connect at set-up, with one another, and a leader
with the ranks of its own host that tcp links it to (backend ``tcp``): the lower rank
dials, and every rank has proved the job secret before anything runs. Any other pair
connects when one of them first sends. Each connection proves the job secret
(``tandem._wire``) before the peer's rank is read; strangers, junk and wrong secrets
are dropped without disturbing the job. Two ranks dialing each other at once both
get through and keep both connections: each reads both and sends on the first it
had, so each direction is one stream, and one closing while its twin is open is not
a loss (a leaving rank says goodbye on one). A host thus holds a connection per other
host between leaders, plus one per pair that exchanged messages directly.

Data path: one reader thread serves every connection (a selector): it reads a frame's
header and receives its payload straight into posted tensor memory (``recv_into``, GIL
released). A send of up to 4 MiB to a connection with nothing queued goes out inline
from the caller, as far as the kernel takes it at once (it moves the bytes on while the
caller reduces the next chunk, and no thread has to be woken); larger ones, and whatever
the kernel does not take at once, are queued to one sender thread. The sender never
blocks on a peer: a full socket is set aside until it drains, so a stopped peer holds up
nobody else, and a frame once begun always completes (which is what lets one reader read
a frame to its end). Threads per rank are thus three (reader, sender, the listener's
gate), whatever the number of peers. A stopped peer that began a frame and stalls
mid-frame holds the reader (and so the other connections) until its connection closes or
the waits time out. ``sendmsg`` writes header and payload in one call without copying. A
connection that closes reports the peer as lost at once; a read or write that fails in
any other way closes that connection and reports why, so nothing fails silently. A write
that meets a closed connection is settled once the peer's stream was read to its end (or
the connect timeout passed): completed unread if the peer said goodbye, else failed. Queues
are bounded (:mod:`.sendqueue`). ``close`` lets sends already queued (aborts, goodbyes)
go out for a moment, then ends every thread and closes the listener.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Callable, Sequence

from tandem._words import secs
from tandem import _gate, _wire
from tandem.errors import (ArgumentError, AuthenticationError, NetworkError, PeerLostError,
                           ProtocolError, TandemError)
from tandem.store.base import Store
from tandem.transport import forks
from tandem.transport.base import (Transport, check_header, check_size, join_all,
                                   one_drop_warning)
from tandem.transport.failures import decode_error, split_relay
from tandem.transport.mailbox import DEFAULT_PARK_LIMIT, Mailbox
from tandem.transport.message import Header, Kind, Reader, Slot
from tandem.transport.sendqueue import DEFAULT_SEND_LIMIT, BoundedSends, Entry, SendQueue

__all__ = ["TcpTransport"]

_HDR = struct.Struct("!BIQiQHH")
_HELLO = struct.Struct("!II")
# sends up to this size go straight into an idle socket from the caller (what the kernel
# takes at once; the rest goes to the sender): a ring's 512 KiB pieces handed to the
# sender thread waited 9-23 ms for it under load, most of what 4 hosts lost to gloo
_INLINE_MAX = 4 << 20
_PURPOSE = b"tandem-transport"
_IOV_MAX = 1024  # the most buffers one sendmsg takes (Linux)
_JOIN_S = 2.0  # how long close() waits for this transport's threads to end
# A reader receiving a large payload wakes once per this many bytes instead of once per
# 64 KB packet (see _wire.BufferedReader). Measured with loopback all-reduce at real-time
# priority, alternating runs: tcp busbw +13% at 3 ranks x 64 MB (1236 -> 1391 MB/s,
# 2 runs each), +6% at 3 x 16 MB, +2% at 4 x 16 MB, -2% at 4 x 64 MB (within the noise);
# 1 MiB gave +15% at 3 x 64 MB but nothing at 3 x 16 MB, 256 KiB +10% and +3%.
_WAKE_BYTES = 512 << 10


# the ABORT "group" of a lost-rank notice: a rank died, not a group failed (mixed.py)
LOST_NOTICE = 0xFFFFFFFF


def act_on_abort(mailbox: Mailbox, rank: int, header: Header, data: bytes) -> None:
    """What an ABORT payload ``data`` (relay list removed) tells this rank: a group
    failed, or (``LOST_NOTICE``) a rank died."""
    reporter, reported = decode_error(header.step, data)
    if header.group == LOST_NOTICE:
        if isinstance(reported, PeerLostError) and reported.rank not in (-1, rank):
            mailbox.peer_lost(reported.rank, reported)
        return
    mailbox.failures.report(header.group, reporter, reported)
    mailbox.abort_group(header.group, reported)


def _sendall_vec(sock: socket.socket, parts: list[memoryview], flags: int = 0) -> None:
    """Write every buffer with as few system calls as the kernel allows.

    ``parts`` is consumed in place, so after a ``BlockingIOError`` (with
    ``MSG_DONTWAIT``) it holds exactly what is left to send.
    """
    while parts:
        sent = sock.sendmsg(parts[:_IOV_MAX], [], flags)
        while sent:
            if sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            else:
                parts[0] = parts[0][sent:]
                sent = 0
        while parts and len(parts[0]) == 0:
            parts.pop(0)


class _Peer:
    """One connection to ``rank``: what the caller and the sender write, what the reader reads."""

    def __init__(self, me: int, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.cv = threading.Condition()
        self.busy = False  # a thread is writing to the socket now; protected by cv
        self.current: Entry | None = None  # the frame being written, partly sent; under cv
        self.queue = SendQueue(me, rank)
        self.reader = _wire.BufferedReader(sock, wake_bytes=_WAKE_BYTES)

    def flush(self, deadline: float) -> None:
        """Wait (until ``deadline``, monotonic) for queued sends to be written."""
        with self.cv:
            while ((self.queue or self.busy or self.current is not None)
                   and time.monotonic() < deadline):
                self.cv.wait(max(0.0, deadline - time.monotonic()))


class TcpTransport(BoundedSends, Transport):
    """Connects ``rank`` to its ``peers`` (default: all ``world_size - 1`` others) through
    ``store``. The mixed transport passes the ranks of other hosts only: a same-host
    peer talks through shared memory alone, so there is one link per peer and one
    stream of that peer's messages (two links could deliver a goodbye on one before a
    message still in flight on the other).

    ``hosts``: every rank's host key (``mixed.exchange_hosts``), which the mixed
    transport already has; without it the transport exchanges them itself.

    ``lazy``: connect host leaders only at set-up and every other pair on first use
    (the mixed transport, which carries failure news across hosts itself); else every
    pair at set-up, so each rank sees any peer's connection close."""

    def __init__(self, rank: int, world_size: int, store: Store, host: str, secret: bytes,
                 connect_timeout: float, max_frame: int, hostname: str = "",
                 debug: bool = False, *, advertise: str = "",
                 park_limit: int = DEFAULT_PARK_LIMIT, send_limit: int = DEFAULT_SEND_LIMIT,
                 peers: Sequence[int] | None = None,
                 hosts: Sequence[str] | None = None, lazy: bool = False,
                 published: Callable[[], None] | None = None) -> None:
        self.rank = rank
        self._debug_log = debug  # TANDEM_DEBUG, read once with the other settings
        self.world_size = world_size
        self.links = (set(range(world_size)) if peers is None else set(peers)) - {rank}
        if not self.links <= set(range(world_size)):
            raise ArgumentError(f"peers {sorted(peers or ())} must be ranks of a "
                                f"{world_size}-rank job")
        if hosts is not None and len(hosts) != world_size:
            raise ArgumentError(f"hosts has {len(hosts)} entries; a {world_size}-rank job "
                                f"needs one per rank")
        self.mailbox = Mailbox(rank, park_limit)
        self.mailbox.reply = self._refuse
        # news that names ranks to pass it on to (only a mixed transport sends such, and
        # passes it on): what came before one took over, e.g. on a leader still setting
        # up its host's shared memory, waits for it (``pass_news_on``)
        self._news_lock = threading.Lock()
        self._held_news: list[tuple[Header, bytes]] = []
        self._news_taker: Callable[[Header, bytes], object] | None = None
        # refusals this rank sends before a mixed transport takes over, to ranks only it
        # reaches (same-host senders, over shared memory): held for it (``pass_refusals_on``)
        self._held_refusals: list[tuple[list[int], int, TandemError]] = []
        self._refusal_taker: Callable[[list[int], int, TandemError], object] | None = None
        if lazy:  # news of ranks it never connected to comes as notices (mixed.py)
            self.mailbox.handle(Kind.ABORT, self._on_abort)
        self._secret = secret
        self._max_frame = max_frame
        self._timeout = connect_timeout
        self._lazy = lazy
        self._store = store
        self._closing = False
        self._peers: dict[int, _Peer] = {}  # the connection each peer's messages go out on
        self._extra: list[_Peer] = []  # a second connection, when both ranks dialed at once
        self._conns: dict[int, int] = {}  # open connections per peer
        self._dialing: dict[int, threading.Lock] = {}
        self._addrs: dict[int, tuple[str, int]] = {}
        self._hosts: dict[int, str] = {rank: hostname}
        self.host_keys: list[str] = []  # every rank's host (``mixed.host_key``), by rank
        self._refused: tuple[int, int] | None = None  # (rank, its world_size) at set-up
        self._advertise = advertise or _wire.advertised_address(host, None)
        self.send_limit = send_limit
        # one reader for every connection and one sender for what cannot go out inline:
        # a rank's threads do not grow with the number of peers
        self._io_lock = threading.Condition()
        self._read_sel = selectors.DefaultSelector()
        self._read_wake_r, self._read_wake_w = socket.socketpair()
        self._read_sel.register(self._read_wake_r, selectors.EVENT_READ, None)
        self._send_sel = selectors.DefaultSelector()
        self._send_wake_r, self._send_wake_w = socket.socketpair()
        self._send_sel.register(self._send_wake_r, selectors.EVENT_READ, None)
        for s in (self._read_wake_r, self._read_wake_w, self._send_wake_r, self._send_wake_w):
            s.setblocking(False)
        self._ready: set[_Peer] = set()  # peers with frames for the sender; under _io_lock
        self._to_watch: list[_Peer] = []  # new connections for the reader; under _io_lock
        # sends that met a closed connection before the peer's stream was read to its end,
        # by rank, and their deadline timers: settled once its fate is known (_settle_unsent)
        self._unsent: dict[int, list[tuple[Header, Slot, OSError]]] = {}  # under _io_lock
        self._unsent_timers: dict[int, threading.Timer] = {}  # under _io_lock
        self._ended: set[int] = set()  # ranks whose every connection was read to its end
        self._sender: threading.Thread | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"tandem-read-{rank}")
        self._reader.start()
        self._listener: socket.socket | None = None
        self._gate: _gate.Gate | None = None
        self._acceptor: threading.Thread | None = None
        try:
            self._connect(store, host, connect_timeout, hostname, hosts, published)
        except BaseException:
            self._stop()
            raise
        forks.track(self)

    def _send_queues(self) -> list[SendQueue]:
        return [p.queue for p in list(self._peers.values())]

    def forget_in_child(self) -> None:
        """In a forked child: drop the inherited connections (see :mod:`.forks`)."""
        if not self._closing:
            self._closing = True
            for p in self._all_links():
                p.sock.close()  # the child's descriptor only: the parent's connection stays up
            for s in (self._read_wake_r, self._read_wake_w, self._send_wake_r,
                      self._send_wake_w):
                s.close()
            if self._listener is not None:
                self._listener.close()

    def _all_links(self) -> list[_Peer]:
        with self._io_lock:
            return list(self._peers.values()) + list(self._extra)

    # -- set-up ----------------------------------------------------------------------
    def eager_peers(self, hosts: Sequence[str]) -> set[int]:
        """The peers connected at set-up, which prove the job secret before anything runs:
        host leaders (each host's lowest rank) with one another, and a leader with the
        ranks of its own host that this transport links it to (backend ``tcp``). Every
        other connection is made on first use."""
        if not self._lazy:
            return set(self.links)
        leaders: dict[str, int] = {}
        for r, h in enumerate(hosts):
            leaders.setdefault(h, r)
        mine = hosts[self.rank]
        if leaders[mine] == self.rank:
            wanted = set(leaders.values()) | {r for r, h in enumerate(hosts) if h == mine}
        else:
            wanted = {leaders[mine]}
        return wanted & self.links

    def _connect(self, store: Store, host: str, timeout: float, hostname: str,
                 hosts: Sequence[str] | None,
                 published: Callable[[], None] | None = None) -> None:
        """Listen for the whole life of the transport (peers dial on first use), publish
        the address, and make the set-up connections (:meth:`eager_peers`); ``published``
        is called once this rank's address (and host key, when it exchanges them) is in
        the store, before it waits for the others'."""
        deadline = time.monotonic() + timeout
        self._listener = listener = _wire.listen(host, 0)
        self._gate = _gate.Gate(listener, self._secret, _PURPOSE, self._admit,
                                name=f"tandem-accept-{self.rank}")
        self._acceptor = threading.Thread(target=self._gate.run, daemon=True,
                                          name=f"tandem-accept-{self.rank}")
        self._acceptor.start()
        port = listener.getsockname()[1]
        store.set(f"addr/{self.rank}", f"{self._advertise}:{port}|{hostname}|{self.world_size}")
        if hosts is None:
            from tandem.transport.mixed import exchange_hosts  # mixed builds on tcp

            hosts = exchange_hosts(store, self.rank, self.world_size, hostname, published)
        elif published is not None:
            published()
        self.host_keys = list(hosts)
        for r, key in enumerate(hosts):
            self._hosts.setdefault(r, key.partition("|")[0])
        eager = self.eager_peers(hosts)
        lower = sorted(p for p in eager if p < self.rank)
        self._connect_lower(dict(zip(lower, self._entries(store, lower))), deadline)
        expected = {p for p in eager if p > self.rank}
        with self._io_lock:
            while not expected <= self._conns.keys():
                if self._refused is not None:
                    raise self._world_error(*self._refused)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(expected - self._conns.keys())
                    raise NetworkError(
                        f"rank {self.rank}: rank(s) {missing} did not connect within "
                        f"{secs(timeout)}s"
                    )
                self._io_lock.wait(left)

    def _connect_lower(self, entries: dict[int, tuple[str, str, int]], deadline: float) -> None:
        """Connect to ``entries``' ranks, each handshake step on all connections before the
        next, so the peers answer in parallel (one after another, rank n waited for n - 1
        peers' replies in turn)."""
        socks: dict[int, socket.socket] = {}
        try:
            for peer, (addr, peer_host, _) in entries.items():
                peer_ip, _, peer_port = addr.rpartition(":")
                self._hosts[peer] = peer_host
                left = max(0.1, deadline - time.monotonic())
                socks[peer] = _wire.connect(peer_ip, int(peer_port), left, f"rank {peer}")
            proofs = {peer: _wire.client_handshake_start(sock, self._secret, _PURPOSE,
                                                         f"rank {peer}")
                      for peer, sock in socks.items()}
            for peer, sock in socks.items():
                _wire.client_handshake_finish(sock, proofs[peer], f"rank {peer}")
                sock.sendall(_HELLO.pack(self.rank, self.world_size))
            for peer, (_, _, world) in entries.items():
                if world != self.world_size:  # after our hello: the peer learns it too
                    raise self._world_error(peer, world)
            for peer in entries:
                self._adopt(peer, socks.pop(peer))
        finally:
            for sock in socks.values():  # the connections not handed over
                sock.close()

    def _dial(self, peer: int) -> _Peer:
        """The connection to ``peer``, made now if there is none (first use).

        Two ranks dialing each other at once both succeed: each then reads both
        connections and sends on the first it had, so each direction is one stream."""
        with self._io_lock:
            lock = self._dialing.setdefault(peer, threading.Lock())
        with lock:
            p = self._peers.get(peer)
            if p is not None:
                return p
            lost = self.lost(peer)
            if lost is not None:
                raise lost
            if self._closing:  # a closing rank connects to nobody new
                raise self.closed_error()
            try:
                if peer not in self._addrs:
                    addr, _, _ = self._entries(self._store, [peer])[0]
                    ip, _, port_text = addr.rpartition(":")
                    self._addrs[peer] = (ip, int(port_text))
                sock = socket.create_connection(self._addrs[peer], timeout=self._timeout)
            except (OSError, TandemError) as exc:
                raise self._unreachable(peer, exc) from exc
            try:
                _wire.client_handshake(sock, self._secret, _PURPOSE, f"rank {peer}")
                sock.sendall(_HELLO.pack(self.rank, self.world_size))
                sock.settimeout(None)
                _wire.tune(sock)
            except AuthenticationError:
                sock.close()
                raise
            except (OSError, TandemError) as exc:  # it died, or stopped, mid-handshake
                sock.close()
                raise self._unreachable(peer, exc) from exc
            except BaseException:
                sock.close()
                raise
            self._adopt(peer, sock)
            p = self._peers.get(peer)
            if p is None:  # closing meanwhile
                raise self.closed_error()
            return p

    def _on_abort(self, peer: int, header: Header, read: Reader) -> None:
        try:
            buf = bytearray(header.nbytes)
            read(memoryview(buf))
            relay, passed = split_relay(bytes(buf))
            if relay:
                with self._news_lock:
                    taker = self._news_taker
                    if taker is None:
                        self._held_news.append((header, bytes(buf)))
                if taker is not None:  # it took over while this arrived
                    taker(header, bytes(buf))
            act_on_abort(self.mailbox, self.rank, header, passed)
        except Exception:  # noqa: BLE001 - a handler must not raise (Mailbox.handle)
            pass

    def pass_news_on(self, taker: Callable[[Header, bytes], object]) -> None:
        """From now on ``taker(header, payload)`` passes on news that names ranks to pass
        it on to (an ABORT with a relay list, see ``failures.with_relay``) that reaches
        this transport's handler; it gets what came before at once (this rank acted on
        that when it came: its own calls fail at once, the ranks it names hear now). A
        mixed transport calls this once its own handler is in place."""
        with self._news_lock:
            self._news_taker = taker
            held, self._held_news = self._held_news, []
        for header, data in held:
            taker(header, data)

    def _refuse(self, peers: list[int], group: int, error: TandemError) -> None:
        """The mailbox's reply: tell ``peers`` that ``group`` failed here with ``error``
        (a refused message); those this transport has no link to are told by the mixed
        transport once it exists (``pass_refusals_on``)."""
        mine = [p for p in peers if p in self.links]
        others = [p for p in peers if p != self.rank and p not in self.links]
        if others:
            with self._news_lock:
                taker = self._refusal_taker
                if taker is None:
                    self._held_refusals.append((others, group, error))
            if taker is not None:  # it took over while this was refused
                taker(others, group, error)
        self.abort(group, mine, error)

    def pass_refusals_on(self, taker: Callable[[list[int], int, TandemError], object]) -> None:
        """From now on ``taker(peers, group, error)`` tells the ranks this transport has
        no link to of a message this rank refused (``Mailbox.reply``); it gets at once the
        refusals made before, e.g. of a same-host sender that overran the park limit
        while this rank set up its shared memory. A mixed transport calls this once it is
        the mailbox's reply."""
        with self._news_lock:
            self._refusal_taker = taker
            held, self._held_refusals = self._held_refusals, []
        for peers, group, error in held:
            taker(peers, group, error)

    def _unreachable(self, peer: int, exc: BaseException) -> PeerLostError:
        """``peer`` cannot be connected to: it is lost from now on; the error to raise."""
        error = PeerLostError(f"rank {self.rank} could not connect to rank {peer} (host "
                              f"{self._hosts.get(peer) or '?'}): {exc}; did it exit, crash "
                              f"or stop?", peer)
        if not self._closing:
            self.mailbox.peer_lost(peer, error)
        return error

    def _adopt(self, peer: int, sock: socket.socket) -> None:
        """Hand a connection to ``peer`` to the reader; the first one carries the sends."""
        with self._io_lock:
            if self._closing:
                sock.close()
                return
            p = _Peer(self.rank, peer, sock)
            p.queue.limit = self._send_limit
            self._conns[peer] = self._conns.get(peer, 0) + 1
            if peer in self._peers:
                self._extra.append(p)
            else:
                self._peers[peer] = p
            self._to_watch.append(p)
            self._io_lock.notify_all()
        self._wake(self._read_wake_w)

    def _admit(self, sock: socket.socket) -> None:
        """Take one authenticated connection (the gate checked the secret); anything wrong
        just closes it."""
        try:
            sock.settimeout(_wire.HANDSHAKE_TIMEOUT)
            peer, world = _HELLO.unpack(_wire.recv_exact(sock, _HELLO.size))
            sock.settimeout(None)
            _wire.tune(sock)
        except (OSError, TandemError) as exc:
            self._debug(f"rejected a connection: {exc}")
            sock.close()
            return
        if peer in self.links and world == self.world_size:
            self._adopt(peer, sock)
            return
        if world != self.world_size:  # authenticated: a rank of this job, misconfigured
            with self._io_lock:
                self._refused = (peer, world)
                self._io_lock.notify_all()
        self._debug(f"rejected an authenticated connection claiming rank {peer}/{world}")
        sock.close()

    def _entries(self, store: Store, peers: list[int]) -> list[tuple[str, str, int]]:
        """Each of ``peers``' published address, host and world size, in one store read."""
        entries = []
        for value in store.multi_get([f"addr/{p}" for p in peers]):
            addr, _, rest = value.decode().partition("|")
            host, _, world = rest.partition("|")
            entries.append((addr, host, int(world) if world else self.world_size))
        return entries

    def _world_error(self, peer: int, world: int) -> ArgumentError:
        return ArgumentError(f"rank {self.rank} was started with world_size={self.world_size} "
                             f"but rank {peer} with world_size={world}: every rank must be "
                             f"given the same world size")

    def _debug(self, message: str) -> None:
        if self._debug_log:
            print(f"[tandem rank {self.rank}] {message}", file=sys.stderr)

    # -- data path -------------------------------------------------------------------
    def _read_loop(self) -> None:
        """Read every connection on this one thread: whichever has data, one frame at a time.

        A frame once begun is read to its end before another peer is served: senders
        write a frame without pause (the sender multiplexes its peers, never waits on
        one), so a begun frame completes unless its sender dies, which ends the read."""
        sel = self._read_sel
        try:
            while not self._closing:
                for key, _ in sel.select():
                    peer = key.data
                    if peer is None:
                        self._drain_wake(self._read_wake_r)
                        with self._io_lock:
                            new, self._to_watch = self._to_watch, []
                        for p in new:
                            sel.register(p.sock, selectors.EVENT_READ, p)
                    elif not self._read_frames(peer):
                        try:
                            sel.unregister(peer.sock)
                        except (KeyError, ValueError):
                            pass
        except Exception as exc:  # noqa: BLE001 - the reader must never die silently
            if not self._closing:
                for p in self._all_links():
                    self._shutdown(p.sock)
                    self.mailbox.peer_lost(p.rank, PeerLostError(
                        f"rank {self.rank}'s reader failed ({type(exc).__name__}: {exc}); "
                        f"its connection to rank {p.rank} was closed", p.rank))
                    self._settle_unsent(p.rank)

    def _read_frames(self, peer: _Peer) -> bool:
        """Deliver the frames ``peer`` sent, as long as bytes of one are at hand; False
        once the connection is gone (and reported)."""
        reader = peer.reader
        read = reader.read_into
        try:
            while True:
                kind, group, seq, step, nbytes, siglen, sitelen = _HDR.unpack(
                    reader.read(_HDR.size))
                check_size(nbytes, self._max_frame, peer.rank)
                extra = self._read_extra(reader, siglen + sitelen)
                header = Header(kind, group, seq, step, nbytes, extra[:siglen], extra[siglen:])
                self.mailbox.arrive(peer.rank, header, read)
                if reader.end == reader.start:
                    return True
        except (OSError, NetworkError) as exc:
            if isinstance(exc, ProtocolError):
                # refuse the rest of this peer's stream; closing tells the sender at once
                self._shutdown(peer.sock)
                why = f"rank {self.rank} dropped its connection to rank {peer.rank}: {exc}"
            else:
                why = (f"rank {peer.rank} (host {self._hosts.get(peer.rank) or '?'}) closed its "
                       f"connection to rank {self.rank} ({exc}); did it exit or crash?")
                if self._closed_one(peer):
                    return False  # its other connection still carries what it says
            if not self._closing:
                self.mailbox.peer_lost(peer.rank, PeerLostError(why, peer.rank))
        except Exception as exc:  # noqa: BLE001 - a reader must never die silently
            self._shutdown(peer.sock)
            if not self._closing:
                self.mailbox.peer_lost(peer.rank, PeerLostError(
                    f"rank {self.rank} failed reading from rank {peer.rank} "
                    f"({type(exc).__name__}: {exc}); the connection was closed", peer.rank))
        self._settle_unsent(peer.rank)  # its goodbye, if any, was read: the book says which
        return False

    def _closed_one(self, peer: _Peer) -> bool:
        """``peer``'s connection closed; whether another one to that rank is still open
        (a rank leaving says goodbye on one and closes both, in either order)."""
        with self._io_lock:
            left = self._conns.get(peer.rank, 1) - 1
            self._conns[peer.rank] = left
            return left > 0

    @staticmethod
    def _drain_wake(sock: socket.socket) -> None:
        try:
            while sock.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    @staticmethod
    def _wake(sock: socket.socket) -> None:
        try:
            sock.send(b"x")
        except (BlockingIOError, InterruptedError):
            pass  # the buffer holds wake-ups enough
        except OSError:
            pass  # closed: the thread is gone

    @staticmethod
    def _read_extra(reader: _wire.BufferedReader, n: int) -> bytes:
        """A message's signature and call site (up to twice ``SIG_MAX`` bytes)."""
        if n <= len(reader.buf):
            return reader.read(n) if n else b""
        extra = bytearray(n)
        reader.read_into(memoryview(extra))
        return bytes(extra)

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def isend(self, peer: int, header: Header, payload: memoryview) -> Slot:
        if peer == self.rank:
            return self._send_to_self(header, payload)
        return self.isendv(peer, header, [payload])

    def isendv(self, peer: int, header: Header, pieces: Sequence[memoryview]) -> Slot:
        if peer == self.rank:
            return super().isendv(peer, header, pieces)
        p = self._peers.get(peer)
        if p is None:
            self._check_peer(peer, peer in self.links, "link")
            check_header(header, self._max_frame, peer)  # refused: no connection made for it
            p = self._dial(peer)
        else:
            self._check_peer(peer, True, "connection")
            check_header(header, self._max_frame, peer)
        slot = self._send_slot(peer, header)
        head = _HDR.pack(header.kind, header.group, header.seq, header.step, header.nbytes,
                         len(header.sig), len(header.site)) + header.sig + header.site
        parts = [memoryview(head)]
        parts += [b if b.ndim == 1 and b.format == "B" else b.cast("B") for b in pieces]
        with p.cv:
            inline = (not p.queue and not p.busy and p.current is None
                      and header.nbytes <= _INLINE_MAX)
            if inline:
                p.busy = True
            else:
                p.queue.push((parts, header, slot))
        if not inline:
            self._hand_to_sender(p)
            return slot
        # never block the caller: a stopped peer with full buffers must not stall us past
        # the op's deadline, so what the kernel does not take now goes to the sender
        failed = False
        try:
            _sendall_vec(p.sock, parts, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError as exc:
            parts, failed = [], True
            self._send_failed(p, slot, exc, header)  # settles the slot, maybe later
        with p.cv:
            p.busy = False
            if parts:
                p.current = (parts, header, slot)  # the rest of a begun frame goes first
            more = bool(parts) or bool(p.queue)
            p.cv.notify_all()
        if not parts and not failed:
            slot.finish(header)
        if more:
            self._hand_to_sender(p)  # the rest, or sends queued while this one went out
        return slot

    def _hand_to_sender(self, p: _Peer) -> None:
        """``p`` has frames to write: wake the sender (started on first use)."""
        with self._io_lock:
            if self._closing:
                return
            self._ready.add(p)
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                                name=f"tandem-write-{self.rank}")
                self._sender.start()
        self._wake(self._send_wake_w)

    def _send_failed(self, p: _Peer, slot: Slot, exc: OSError,
                     header: Header | None = None) -> None:
        """A write to ``p`` failed. A closed connection (``header`` given) is settled once
        the peer's stream was read to its end: its goodbye, if it left, comes before the
        close, but the reader may not have reached it when the write met the close."""
        if header is not None and self.mailbox.failures.left(p.rank) is None:
            with self._io_lock:
                if p.rank not in self._ended and not self._closing:
                    self._unsent.setdefault(p.rank, []).append((header, slot, exc))
                    if p.rank not in self._unsent_timers:
                        # nothing hangs: a stream not ended by then is taken for a crash
                        timer = threading.Timer(self._timeout, self._settle_unsent,
                                                (p.rank, True))
                        timer.daemon = True
                        self._unsent_timers[p.rank] = timer
                        timer.start()
                    return
        self._settle(p.rank, slot, exc, header)

    def _settle(self, rank: int, slot: Slot, exc: OSError, header: Header | None) -> None:
        """Finish a send the connection to ``rank`` did not take: completed if ``rank``
        said goodbye (nobody reads it, as nobody reads a frame the kernel took just before
        its close; a gather's root announcing itself to a member that finished and left),
        else failed as a send to a dead rank."""
        failures = self.mailbox.failures
        if header is not None and failures.left(rank) is not None:
            slot.finish(header)
            return
        own = PeerLostError(f"rank {self.rank} could not send to rank {rank}: {exc}; did it "
                            f"exit or crash?", rank)
        # a closed connection: why the peer is gone, as the reader found it; else (a bug
        # writing, no header) this failure is the cause
        error = (failures.lost(rank) or own) if header is not None else own
        if not self._closing:
            self.mailbox.peer_lost(rank, error)
        slot.finish(None, error)

    def _settle_unsent(self, rank: int, timed_out: bool = False) -> None:
        """``rank``'s stream was read to its end (or, ``timed_out``, was not within the
        connect timeout): settle the sends that met its closed connection."""
        with self._io_lock:
            if not timed_out:
                self._ended.add(rank)
            unsent = self._unsent.pop(rank, [])
            timer = self._unsent_timers.pop(rank, None)
        if timer is not None and not timed_out:
            timer.cancel()
        if timed_out and unsent and not self._closing and self.lost(rank) is None \
                and self.mailbox.failures.left(rank) is None:
            self.mailbox.peer_lost(rank, PeerLostError(
                f"rank {self.rank} could not send to rank {rank} ({unsent[0][2]}), and rank "
                f"{rank}'s stream did not end within {secs(self._timeout)}s; did it exit, crash "
                f"or stop?", rank))
        if self._closing:
            self.give_up_sends(slot for _, slot, _ in unsent)
            return
        for header, slot, exc in unsent:
            self._settle(rank, slot, exc, header)

    def _send_loop(self) -> None:
        """Write every peer's queued frames on this one thread, never waiting on one peer:
        a peer whose socket is full is set aside until the kernel says it is writable."""
        sel = self._send_sel
        waiting: set[_Peer] = set()  # registered for writability
        while not self._closing:
            with self._io_lock:
                work, self._ready = self._ready, set()
            for p in work:
                if p in waiting:
                    continue  # its socket is full: the selector says when it drains
                if self._pump(p):
                    try:
                        sel.register(p.sock, selectors.EVENT_WRITE, p)
                        waiting.add(p)
                    except (KeyError, ValueError, OSError):
                        pass  # closed meanwhile: its frames were failed or dropped
            try:
                events = sel.select()
            except OSError:
                return  # closed under us
            for key, _ in events:
                if key.data is None:
                    self._drain_wake(self._send_wake_r)
                    continue
                p = key.data
                try:
                    sel.unregister(p.sock)
                except (KeyError, ValueError):
                    pass
                waiting.discard(p)
                with self._io_lock:
                    self._ready.add(p)

    def _pump(self, p: _Peer) -> bool:
        """Write ``p``'s frames until none is left (False) or its socket is full (True)."""
        while True:
            with p.cv:
                if p.busy:
                    return False  # the caller writes inline; it hands the rest back after
                if p.current is None:
                    if not p.queue:
                        p.cv.notify_all()
                        return False
                    p.current = p.queue.popleft()
                parts, header, slot = p.current
                p.busy = True
            full = False
            try:
                _sendall_vec(p.sock, parts, socket.MSG_DONTWAIT)
                slot.finish(header)
            except BlockingIOError:
                full = True
            except OSError as exc:
                self._send_failed(p, slot, exc, header)
            except Exception as exc:  # noqa: BLE001 - the sender must never die silently
                self._shutdown(p.sock)
                self._send_failed(p, slot, OSError(f"{type(exc).__name__}: {exc}"))
            with p.cv:
                p.busy = False
                if not full:
                    p.current = None
                p.cv.notify_all()
            if full:
                return True

    @property
    def closing(self) -> bool:
        """Whether ``close`` began (or the process forked and this is the child's copy)."""
        return self._closing

    def connected(self, peer: int) -> bool:
        """Whether a connection to ``peer`` is up (made at set-up or by an earlier send)."""
        return peer in self._peers

    def host_of(self, rank: int) -> str:
        return self._hosts.get(rank, "")

    def close(self) -> None:
        """Say goodbye, let queued sends go out briefly, then end every thread and
        connection; operations still pending fail with ``StateError``."""
        if self._closing:
            return
        with one_drop_warning(self.rank):  # every peer's dropped sends in one warning
            self._take_leave(list(self._peers.values()))
            forks.untrack(self)
            self._stop()

    def _stop(self) -> None:
        self._closing = True
        with self._io_lock:
            waiting = list(self._unsent)
        for rank in waiting:  # sends still waiting on a peer's fate fail now
            self._settle_unsent(rank)
        self.mailbox.close(self.closed_error())
        if self._gate is not None:
            self._gate.close()
        if self._listener is not None:
            self._listener.close()
        links = self._all_links()
        for p in links:
            with p.cv:
                dropped = p.queue.drain()
                if p.current is not None:
                    dropped.append(p.current)
                    p.current = None
                p.cv.notify_all()
            self.give_up_sends(slot for _, _, slot in dropped)
            self._shutdown(p.sock)
        self._wake(self._read_wake_w)
        self._wake(self._send_wake_w)
        join_all([self._reader, self._sender, self._acceptor], _JOIN_S)
        reading = self._reader is not None and self._reader.is_alive()
        for p in links:
            p.sock.close()
            if not reading:
                p.reader.close()
        for s in (self._read_wake_r, self._read_wake_w, self._send_wake_r, self._send_wake_w):
            s.close()
        self._read_sel.close()
        self._send_sel.close()
