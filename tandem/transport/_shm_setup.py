"""Connecting same-host ranks for the shm transport: authenticated UNIX sockets between them.

Every rank listens on an *abstract* UNIX socket (Linux; no file exists, so none
can be left behind) whose name carries 128 random bits and is published only in
the job's store. A rank connects to every lower local rank and accepts every
higher one. On each connection both sides prove the job secret with the
``tandem._wire`` HMAC handshake and must run as the same user (``SO_PEERCRED``);
then each sends its rank, world size and pid. No memory changes hands here: a ring
is made by its writer on the pair's first message in that direction and handed over
these same connections then (``ShmTransport``), so pairs that never talk reserve
nothing. Strangers, junk and wrong secrets are dropped without disturbing the job.
The listener closes as soon as the local mesh is complete; the connections stay
open: a peer's death closes them at once, and rings and arena segments travel on them.

    links = connect_local(store, rank, world, local_peers, secret, timeout)
    for peer, link in links.items(): link.sock, link.pid
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import struct
import threading
import time
from typing import Iterable

from tandem import _gate, _wire
from tandem.errors import AuthenticationError, NetworkError, ProtocolError, TandemError
from tandem.store.base import Store

__all__ = ["Link", "connect_local"]

_PURPOSE = b"tandem-shm-transport"
_HELLO = struct.Struct("!III")  # rank, world size, pid
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


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
    sock.sendall(_HELLO.pack(rank, world, os.getpid()))
    return int(pid)


def _recv_hello(sock: socket.socket) -> tuple[int, int, int]:
    """The peer's HELLO: its (rank, world, pid)."""
    peer, peer_world, peer_pid = _HELLO.unpack(_wire.recv_exact(sock, _HELLO.size))
    return peer, peer_world, peer_pid


def connect_local(store: Store, rank: int, world: int, peers: Iterable[int], secret: bytes,
                  timeout: float) -> dict[int, Link]:
    """Connect ``rank`` to every rank of ``peers`` (all on this host)."""
    mine = set(peers)
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
                                   )).start()
        lower = sorted(p for p in mine if p < rank)
        names = store.multi_get([f"shm/addr/{p}" for p in lower])  # one store round trip
        _connect_lower(rank, world, dict(zip(lower, names)), secret, deadline, links, cond)
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
            links.clear()
            higher.clear()  # an admission still in flight is refused and closed
        raise
    finally:
        listener.close()


def _connect_lower(rank: int, world: int, names: dict[int, bytes], secret: bytes, deadline: float, links: dict[int, Link],
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
        for sock in socks.values():
            _send_hello(sock, rank, world)
        for peer, sock in list(socks.items()):
            got, got_world, pid = _recv_hello(sock)
            if (got, got_world) != (peer, world):
                raise ProtocolError(f"rank {rank} reached rank {got}/{got_world} at the "
                                    f"address of rank {peer}/{world}")
            sock.settimeout(None)
            with cond:
                links[peer] = Link(peer, socks.pop(peer), pid)
    finally:
        for sock in socks.values():  # the connections not yet handed to ``links``
            sock.close()


def _accept_loop(listener: socket.socket, rank: int, world: int, secret: bytes,
                 higher: set[int], links: dict[int, Link], cond: threading.Condition,
                 deadline: float) -> None:
    def waiting() -> bool:
        with cond:
            return not higher <= links.keys()

    gate = _gate.Gate(listener, secret, _PURPOSE,
                      lambda sock: _admit(sock, rank, world, higher, links, cond),
                      name=f"tandem-shm-accept-{rank}")
    gate.run(deadline, waiting)


def _admit(sock: socket.socket, rank: int, world: int, higher: set[int],
           links: dict[int, Link], cond: threading.Condition) -> None:
    """Take one authenticated connection (the gate checked the secret); anything wrong
    just closes it."""
    try:
        sock.settimeout(_wire.HANDSHAKE_TIMEOUT)  # the gate checked the secret already
        # the connector speaks first, so we learn its rank before answering
        peer, peer_world, pid = _recv_hello(sock)
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
        if _CRED.unpack(creds)[1] != os.getuid():
            raise AuthenticationError("peer runs as another user")
        with cond:
            wanted = peer in higher and peer not in links and peer_world == world
        if not wanted:
            raise ProtocolError(f"unexpected rank {peer}/{peer_world}")
        sock.sendall(_HELLO.pack(rank, world, os.getpid()))
        sock.settimeout(None)
    except (OSError, TandemError):
        sock.close()
        return
    with cond:
        if peer in higher and peer not in links:
            links[peer] = Link(peer, sock, pid)
            cond.notify_all()
            return
    sock.close()
