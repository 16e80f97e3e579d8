"""Connecting same-host ranks for the shm transport: one authenticated UNIX socket per pair.

The host's first local rank (its *leader*) listens on an *abstract* UNIX socket (Linux;
no file exists, so none can be left behind) whose name carries 128 random bits and is
published only in the job's store. Every other local rank connects to it; on each
connection both sides prove the job secret with the ``tandem._wire`` HMAC handshake
and must run as the same user (``SO_PEERCRED``); then each sends its rank, world size
and pid. Once every local rank has proven itself, the leader makes one socket pair
(``socketpair``) for every other pair of local ranks and hands each end to its rank
(``SCM_RIGHTS``, with the peer's rank and pid) over the authenticated connection: R - 1
handshakes per host instead of R (R - 1) / 2 (at 32 ranks, 31 instead of 496, which
took most of start-up), and every pair still has a socket of its own, so a peer's
death closes it at once and rings and arena segments travel on it. A ring is made by
its writer on the pair's first message in that direction (``ShmTransport``); the only
memory that may change hands here is one segment the leader made before (``gift``: the
default group's arena), which rides in each rank's first hand-over message, so a rank
holds it when this returns instead of waiting for a later record on the socket.
Strangers, junk and wrong secrets are dropped without disturbing the job. The listener
closes as soon as every local rank has connected.

    links, gift = connect_local(store, rank, world, local_peers, secret, timeout, gift)
    for peer, link in links.items(): link.sock, link.pid
"""

from __future__ import annotations

import _socket
import dataclasses
import os
import secrets
import selectors
import socket
import struct
import time
from typing import Callable, Iterable

from tandem._words import secs
from tandem import _gate, _wire
from tandem.errors import AuthenticationError, NetworkError, ProtocolError, TandemError
from tandem.store.base import Store

__all__ = ["Link", "Segment", "connect_local", "HAND_BATCH", "HOLD_LIMIT"]

_PURPOSE = b"tandem-shm-transport"
_HELLO = struct.Struct("!IIII")  # rank, world size, pid, segments the sender will hand over
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_BATCH = struct.Struct("!II")  # sockets, then segments (0 or 1), in this hand-over message
_PAIR = struct.Struct("!II")  # the peer at the other end of one socket: rank, pid
_SEGMENT = struct.Struct("!QQ")  # a segment handed over: key, bytes
# sockets per hand-over message: the kernel passes at most 253 descriptors at once
HAND_BATCH = 250
# peer ends the leader keeps before handing them over; more go out early (descriptors)
HOLD_LIMIT = 256


@dataclasses.dataclass(frozen=True)
class Segment:
    """A shared segment handed over at set-up: its key, descriptor and size in bytes."""

    key: int
    fd: int
    size: int


@dataclasses.dataclass
class Link:
    """An authenticated connection to one local peer (its process id: where to read it)."""

    peer: int
    sock: socket.socket
    pid: int


def _send_hello(sock: socket.socket, rank: int, world: int) -> int:
    """Check the peer runs as this user and send our HELLO; the peer's pid."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise AuthenticationError(f"peer process {pid} runs as uid {uid}, not {os.getuid()}")
    sock.sendall(_HELLO.pack(rank, world, os.getpid(), 0))
    return int(pid)


def _recv_hello(sock: socket.socket) -> tuple[int, int, int, int]:
    """The peer's HELLO: its (rank, world, pid, segments it will hand over)."""
    peer, peer_world, peer_pid, segments = _HELLO.unpack(_wire.recv_exact(sock, _HELLO.size))
    return peer, peer_world, peer_pid, segments


def connect_local(store: Store, rank: int, world: int, peers: Iterable[int], secret: bytes,
                  timeout: float, gift: Segment | None = None,
                  published: Callable[[], None] = lambda: None
                  ) -> tuple[dict[int, Link], Segment | None]:
    """Connect ``rank`` to every rank of ``peers`` (all on this host): the links, and the
    segment the host's first rank handed over with them (its ``gift``; it keeps its own
    descriptor). A ``gift`` given to any other rank is ignored (it stays the caller's).
    ``published`` is called once what the others wait for is out (the first rank's
    address; another rank's hello), before this rank waits for them."""
    mine = set(peers) - {rank}
    if not mine:
        return {}, None
    deadline = time.monotonic() + timeout
    leader = min(mine | {rank})
    if rank == leader:
        return _lead(store, rank, world, mine, secret, timeout, deadline, gift, published), None
    return _follow(store, rank, world, leader, mine, secret, timeout, deadline, published)


def _lead(store: Store, rank: int, world: int, mine: set[int], secret: bytes, timeout: float,
          deadline: float, gift: Segment | None, published: Callable[[], None]
          ) -> dict[int, Link]:
    """The leader: admit every local rank, then hand out a socket for every other pair."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0tandem-shm-{secrets.token_hex(16)}"
    listener.bind(name)
    listener.listen(_wire.BACKLOG)
    links: dict[int, Link] = {}
    proven: list[socket.socket] = []
    hello = _HELLO.pack(rank, world, os.getpid(), int(gift is not None))
    try:
        store.set(f"shm/addr/{rank}", name[1:])
        published()
        while not mine <= links.keys() and time.monotonic() < deadline:
            # every handshake on this thread, none waiting for another: the ranks' hellos
            # are read once all have proven the secret (read one by one as each proved
            # it, 15 ranks took turns for a CPU behind each other at 1x16 on 2 CPUs)
            _accept_loop(listener, rank, secret, proven, len(mine - links.keys()), hello,
                         deadline)
            _read_hellos(proven, world, mine, links, deadline)
        if not mine <= links.keys():
            raise NetworkError(f"rank {rank}: local rank(s) {sorted(mine - links.keys())}"
                               f" did not connect through shared memory within "
                               f"{secs(timeout)}s")
        listener.close()  # every local rank is in: no stranger gets a socket from now on
        _hand_out(rank, links, deadline, gift)
        return links
    except BaseException:
        for link in links.values():
            link.sock.close()
        raise
    finally:
        for sock in proven:
            sock.close()
        listener.close()


def _hand_out(rank: int, links: dict[int, Link], deadline: float,
              gift: Segment | None) -> None:
    """Make a socket pair for every two non-leader ranks and send each end to its rank
    over that rank's link, at most ``HOLD_LIMIT`` ends kept waiting at a time; ``gift``
    goes in each rank's first message."""
    ranks = sorted(links)
    pending: dict[int, list[tuple[int, int, _socket.socket]]] = {r: [] for r in ranks}
    owed = set(ranks) if gift is not None else set()
    held = 0
    try:
        for i, a in enumerate(ranks):
            for b in ranks[i + 1:]:
                # C sockets: only their descriptors are sent, a wrapper is cost alone
                one, two = _socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                pending[a].append((b, links[b].pid, one))
                pending[b].append((a, links[a].pid, two))
                held += 2
            # rank a's sockets are all made: send them; the others' when full
            held -= _send_ends(rank, links[a], pending[a], deadline, gift, owed)
            if held >= HOLD_LIMIT:
                for r in ranks[i + 1:]:
                    held -= _send_ends(rank, links[r], pending[r], deadline, gift, owed)
    finally:
        for ends in pending.values():
            for _, _, sock in ends:
                sock.close()


def _send_ends(rank: int, link: Link, ends: list[tuple[int, int, _socket.socket]],
               deadline: float, gift: Segment | None, owed: set[int]) -> int:
    """Send ``ends`` (peer rank, peer pid, socket) to ``link``'s rank and close them here,
    with ``gift`` if that rank is still ``owed`` it; how many ends went."""
    count = len(ends)
    while ends or link.peer in owed:
        batch = ends[:HAND_BATCH]
        extra = [gift] if gift is not None and link.peer in owed else []
        data = (_BATCH.pack(len(batch), len(extra))
                + b"".join(_PAIR.pack(p, pid) for p, pid, _ in batch)
                + b"".join(_SEGMENT.pack(g.key, g.size) for g in extra))
        fds = [s.fileno() for _, _, s in batch] + [g.fd for g in extra]
        link.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            sent = socket.send_fds(link.sock, [data], fds)
            if sent < len(data):
                link.sock.sendall(data[sent:])
        except OSError as exc:
            raise NetworkError(f"rank {rank} could not hand local rank {link.peer} its "
                               f"shared-memory connections ({exc}): did it exit?") from exc
        finally:
            link.sock.settimeout(None)
        for _, _, s in batch:
            s.close()
        del ends[:len(batch)]
        owed.discard(link.peer)
    return count


def _follow(store: Store, rank: int, world: int, leader: int, mine: set[int], secret: bytes,
            timeout: float, deadline: float, published: Callable[[], None]
            ) -> tuple[dict[int, Link], Segment | None]:
    """A non-leader: connect to the leader, then take a socket to every other local rank
    (and the segment the leader announced in its HELLO, if any)."""
    name = store.get(f"shm/addr/{leader}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    links: dict[int, Link] = {}
    gifts: list[Segment] = []
    try:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            sock.connect("\0" + name.decode())
        except OSError as exc:
            raise NetworkError(
                f"rank {rank} cannot reach rank {leader} through its shared-memory socket "
                f"({exc}): did rank {leader} exit?") from exc
        _wire.client_handshake(sock, secret, _PURPOSE, f"local rank {leader}")
        _send_hello(sock, rank, world)
        published()
        got, got_world, pid, segments = _recv_hello(sock)
        if (got, got_world) != (leader, world) or segments > 1:
            raise ProtocolError(f"rank {rank} reached rank {got}/{got_world} (handing over "
                                f"{segments} segments) at the address of rank "
                                f"{leader}/{world}")
        links[leader] = Link(leader, sock, pid)
        _take_ends(rank, leader, sock, mine - {leader}, links, timeout, deadline,
                   segments, gifts)
        sock.settimeout(None)
        return links, gifts[0] if gifts else None
    except BaseException:
        for link in links.values():
            link.sock.close()
        sock.close()
        for g in gifts:
            os.close(g.fd)
        raise


def _take_ends(rank: int, leader: int, sock: socket.socket, wanted: set[int],
               links: dict[int, Link], timeout: float, deadline: float, segments: int,
               gifts: list[Segment]) -> None:
    """Read the leader's hand-over messages until every rank of ``wanted`` has a socket
    and ``gifts`` holds the ``segments`` announced; no byte past them (the transport's
    records follow on this socket)."""
    fds: list[int] = []
    try:
        while not wanted <= links.keys() or len(gifts) < segments:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(wanted - links.keys())
                what = (f"local rank(s) {missing} did not connect" if missing else
                        f"rank {leader} did not hand over the shared segment it announced")
                raise NetworkError(
                    f"rank {rank}: {what} through shared memory within {secs(timeout)}s "
                    f"(rank {leader}, the first rank of this host, hands out the "
                    f"connections once every local rank reached it)")
            sock.settimeout(left)
            try:
                head, got, _, _ = socket.recv_fds(sock, _BATCH.size, HAND_BATCH + 3)
                fds += got
                if head and len(head) < _BATCH.size:
                    head += _wire.recv_exact(sock, _BATCH.size - len(head))
            except TimeoutError:
                continue
            except OSError as exc:
                raise NetworkError(f"rank {rank} lost its shared-memory connection to rank "
                                   f"{leader} during set-up ({exc})") from exc
            if not head:
                raise NetworkError(
                    f"rank {rank}: rank {leader}, the first rank of this host, closed its "
                    f"shared-memory connection before handing out every local connection "
                    f"(still missing: rank(s) {sorted(wanted - links.keys())}); it failed "
                    f"or exited during set-up")
            count, extra = _BATCH.unpack(head)
            if (not 0 <= count <= HAND_BATCH or count + extra == 0
                    or extra > segments - len(gifts) or len(fds) != count + extra):
                raise ProtocolError(f"rank {leader} handed rank {rank} {len(fds)} descriptors "
                                    f"announced as {count} sockets and {extra} segments")
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            body = _wire.recv_exact(sock, count * _PAIR.size + extra * _SEGMENT.size)
            for i in range(extra):
                key, size = _SEGMENT.unpack_from(body, count * _PAIR.size + i * _SEGMENT.size)
                gifts.append(Segment(key, fds.pop(count), size))
            for i in range(count):
                peer, pid = _PAIR.unpack_from(body, i * _PAIR.size)
                fd = fds.pop(0)
                if peer not in wanted or peer in links:
                    os.close(fd)
                    raise ProtocolError(f"rank {leader} handed rank {rank} a socket for "
                                        f"rank {peer}, not one of its local peers "
                                        f"{sorted(wanted)} still to come")
                links[peer] = Link(peer, socket.socket(fileno=fd), pid)
    finally:
        for fd in fds:
            os.close(fd)


def _accept_loop(listener: socket.socket, rank: int, secret: bytes,
                 proven: list[socket.socket], wanted: int, hello: bytes,
                 deadline: float) -> None:
    """Run the handshakes until ``wanted`` connections proved the secret (in ``proven``,
    each sent our ``hello``)."""
    gate = _gate.Gate(listener, secret, _PURPOSE, lambda sock: _admit(sock, hello, proven),
                      name=f"tandem-shm-accept-{rank}", inline=True)
    gate.run(deadline, lambda: len(proven) < wanted)


def _admit(sock: socket.socket, hello: bytes, proven: list[socket.socket]) -> None:
    """Take one authenticated connection (the gate checked the secret) and say who we
    are without waiting for its hello, read later; anything wrong just closes it."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        if _CRED.unpack(creds)[1] != os.getuid():
            raise AuthenticationError("peer runs as another user")
        sock.settimeout(_wire.HANDSHAKE_TIMEOUT)  # 16 bytes into an empty socket buffer
        sock.sendall(hello)
    except (OSError, TandemError):
        sock.close()
        return
    proven.append(sock)


def _read_hellos(proven: list[socket.socket], world: int, mine: set[int],
                 links: dict[int, Link], deadline: float) -> None:
    """Read the hellos of the ``proven`` connections as they come, keeping each wanted
    rank's first in ``links``; the others, and any silent past the handshake's time,
    are closed (``proven`` ends empty)."""
    sel = selectors.DefaultSelector()
    until = min(deadline, time.monotonic() + _wire.HANDSHAKE_TIMEOUT)
    try:
        for sock in proven:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, sock)
        proven.clear()
        while sel.get_map() and time.monotonic() < until:
            for key, _ in sel.select(max(0.0, until - time.monotonic())):
                sock = key.data
                sel.unregister(sock)
                try:
                    sock.settimeout(_wire.HANDSHAKE_TIMEOUT)
                    peer, peer_world, pid, _ = _recv_hello(sock)
                    sock.settimeout(None)
                except (OSError, TandemError):
                    sock.close()
                    continue
                if peer in mine and peer not in links and peer_world == world:
                    links[peer] = Link(peer, sock, pid)
                else:
                    sock.close()
    finally:
        for key in list(sel.get_map().values()):
            key.data.close()
        sel.close()
