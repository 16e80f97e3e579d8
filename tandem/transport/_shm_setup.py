"""Connecting same-host ranks for the shm transport: authenticated UNIX sockets, fd exchange.

Every rank listens on an *abstract* UNIX socket (Linux; no file exists, so none
can be left behind) whose name carries 128 random bits and is published only in
the job's store. A rank connects to every lower local rank and accepts every
higher one. On each connection both sides prove the job secret with the
``tandem._wire`` HMAC handshake and must run as the same user (``SO_PEERCRED``);
then each sends, with ``SCM_RIGHTS``, the descriptor of the ring it will *read*
from the other. Strangers, junk and wrong secrets are dropped without disturbing
the job. The listener closes as soon as the local mesh is complete; the
connections stay open for one reason: a peer's death closes them at once.

    mine = {peer: fd_of_the_ring_i_read_from_peer for peer in local_peers}
    links = connect_local(store, rank, world, mine, secret, timeout)
    for peer, link in links.items(): link.sock, link.fd (the peer's ring for us), link.pid
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import struct
import threading
import time
from tandem import _gate, _wire
from tandem.errors import AuthenticationError, NetworkError, ProtocolError, TandemError
from tandem.store.base import Store

__all__ = ["Link", "connect_local"]

_PURPOSE = b"tandem-shm-transport"
_HELLO = struct.Struct("!III")  # rank, world size, pid
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


@dataclasses.dataclass
class Link:
    """An authenticated connection to one local peer, and the ring it gave us to write."""

    peer: int
    sock: socket.socket
    fd: int
    pid: int


def _send_hello(sock: socket.socket, rank: int, world: int, my_fd: int) -> int:
    """Check the peer runs as this user, send our HELLO with ``my_fd``; the peer's pid."""
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise AuthenticationError(f"peer process {pid} runs as uid {uid}, not {os.getuid()}")
    socket.send_fds(sock, [_HELLO.pack(rank, world, os.getpid())], [my_fd])
    return int(pid)


def _recv_hello(sock: socket.socket, pid: int) -> tuple[int, int, int, int]:
    """The peer's HELLO: its (rank, world, pid, fd)."""
    msg, fds, _, _ = socket.recv_fds(sock, _HELLO.size, 1)
    if len(msg) < _HELLO.size:
        msg += _wire.recv_exact(sock, _HELLO.size - len(msg))
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"peer process {pid} sent {len(fds)} descriptors, expected 1")
    peer, peer_world, peer_pid = _HELLO.unpack(msg)
    return peer, peer_world, peer_pid, fds[0]


def connect_local(store: Store, rank: int, world: int, mine: dict[int, int], secret: bytes,
                  timeout: float) -> dict[int, Link]:
    """Connect ``rank`` to every peer in ``mine``, handing each ``mine[peer]`` (a ring fd)."""
    deadline = time.monotonic() + timeout
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0tandem-shm-{secrets.token_hex(16)}"
    listener.bind(name)
    listener.listen(_wire.BACKLOG)
    links: dict[int, Link] = {}
    higher = {p for p in mine if p > rank}
    cond = threading.Condition()
    try:
        store.set(f"shm/addr/{rank}", name[1:])
        if higher:
            threading.Thread(target=_accept_loop, daemon=True, name=f"tandem-shm-accept-{rank}",
                             args=(listener, rank, world, secret, higher, links, cond, deadline,
                                   mine)).start()
        lower = sorted(p for p in mine if p < rank)
        names = store.multi_get([f"shm/addr/{p}" for p in lower])  # one store round trip
        _connect_lower(rank, world, dict(zip(lower, names)), mine, secret, deadline, links,
                       cond)
        with cond:
            while not higher <= links.keys():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise NetworkError(f"rank {rank}: local rank(s) {sorted(higher - links.keys())}"
                                       f" did not connect through shared memory within "
                                       f"{timeout:.0f}s")
                cond.wait(left)
            return dict(links)
    except BaseException:
        with cond:
            for link in links.values():
                link.sock.close()
                os.close(link.fd)
            links.clear()
            higher.clear()  # an admission still in flight is refused and closed
        raise
    finally:
        listener.close()


def _connect_lower(rank: int, world: int, names: dict[int, bytes], mine: dict[int, int],
                   secret: bytes, deadline: float, links: dict[int, Link],
                   cond: threading.Condition) -> None:
    """Connect to every lower local rank, each step of the handshake on all connections
    before the next step, so the peers answer in parallel: one after another, rank n
    waited for n - 1 peers' replies in turn (O(world^2) waits for the host)."""
    socks: dict[int, socket.socket] = {}
    try:
        for peer, name in names.items():
            sock = socks[peer] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock.connect("\0" + name.decode())
            except OSError as exc:
                raise NetworkError(
                    f"rank {rank} cannot reach rank {peer} through its shared-memory socket "
                    f"({exc}): did rank {peer} exit?") from exc
        proofs = {peer: _wire.client_handshake_start(sock, secret, _PURPOSE, f"local rank {peer}")
                  for peer, sock in socks.items()}
        for peer, sock in socks.items():
            _wire.client_handshake_finish(sock, proofs[peer], f"local rank {peer}")
        pids = {peer: _send_hello(sock, rank, world, mine[peer]) for peer, sock in socks.items()}
        for peer, sock in list(socks.items()):
            got, got_world, pid, peer_fd = _recv_hello(sock, pids[peer])
            if (got, got_world) != (peer, world):
                os.close(peer_fd)
                raise ProtocolError(f"rank {rank} reached rank {got}/{got_world} at the "
                                    f"address of rank {peer}/{world}")
            sock.settimeout(None)
            with cond:
                links[peer] = Link(peer, socks.pop(peer), peer_fd, pid)
    finally:
        for sock in socks.values():  # the connections not yet handed to ``links``
            sock.close()


def _accept_loop(listener: socket.socket, rank: int, world: int, secret: bytes,
                 higher: set[int], links: dict[int, Link], cond: threading.Condition,
                 deadline: float, mine: dict[int, int]) -> None:
    def waiting() -> bool:
        with cond:
            return not higher <= links.keys()

    gate = _gate.Gate(listener, secret, _PURPOSE,
                      lambda sock: _admit(sock, rank, world, secret, higher, links, cond, mine),
                      name=f"tandem-shm-accept-{rank}")
    gate.run(deadline, waiting)


def _admit(sock: socket.socket, rank: int, world: int, secret: bytes, higher: set[int],
           links: dict[int, Link], cond: threading.Condition, mine: dict[int, int]) -> None:
    """Take one authenticated connection (the gate checked the secret); anything wrong
    just closes it."""
    peer_fd = -1
    try:
        sock.settimeout(_wire.HANDSHAKE_TIMEOUT)  # the gate checked the secret already
        # the connector speaks first, so we learn its rank before handing over its ring
        msg, fds, _, _ = socket.recv_fds(sock, _HELLO.size, 1)
        if len(msg) < _HELLO.size:
            msg += _wire.recv_exact(sock, _HELLO.size - len(msg))
        for extra in fds[1:]:
            os.close(extra)
        if len(fds) != 1:
            raise ProtocolError(f"expected 1 descriptor, got {len(fds)}")
        peer_fd = fds[0]
        peer, peer_world, pid = _HELLO.unpack(msg)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        if _CRED.unpack(creds)[1] != os.getuid():
            raise AuthenticationError("peer runs as another user")
        with cond:
            wanted = peer in higher and peer not in links and peer_world == world
        if not wanted:
            raise ProtocolError(f"unexpected rank {peer}/{peer_world}")
        socket.send_fds(sock, [_HELLO.pack(rank, world, os.getpid())], [mine[peer]])
        sock.settimeout(None)
    except (OSError, TandemError):
        if peer_fd >= 0:
            os.close(peer_fd)
        sock.close()
        return
    with cond:
        if peer in higher and peer not in links:
            links[peer] = Link(peer, sock, peer_fd, pid)
            cond.notify_all()
            return
    os.close(peer_fd)
    sock.close()
