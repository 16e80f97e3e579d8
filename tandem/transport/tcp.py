"""TCP transport: a full mesh of authenticated connections, one per pair of ranks.

Set-up: every rank listens on its bind address (port 0, so jobs never collide),
publishes ``host:port`` in the store, connects to every lower rank and accepts
every higher one. Each connection proves the job secret (``tandem._wire``)
before the peer's rank is read; strangers, junk and wrong secrets are dropped
without disturbing the job. The listener is closed once the mesh is complete.

Data path: one reader thread per peer reads headers and receives payloads
straight into posted tensor memory (``recv_into``, GIL released). Small sends go
out inline from the caller (lowest latency); large ones are queued to a per-peer
writer thread so a pipelined algorithm can reduce one chunk while the next is on
the wire. ``sendmsg`` writes header and payload in one call without copying.
A reader that sees its socket close reports the peer as lost at once.
"""

from __future__ import annotations

import collections
import os
import socket
import struct
import sys
import threading
import time
import weakref
from typing import Sequence

from tandem import _wire
from tandem.errors import NetworkError, PeerLostError, ProtocolError, TandemError
from tandem.store.base import Store
from tandem.transport.base import Header, Mailbox, Slot, Transport, check_size

__all__ = ["TcpTransport"]

_HDR = struct.Struct("!BIQiQHH")
_HELLO = struct.Struct("!II")
_INLINE_MAX = 256 << 10
_PURPOSE = b"tandem-transport"
_IOV_MAX = 1024  # the most buffers one sendmsg takes (Linux)


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
    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.cv = threading.Condition()
        self.busy = False  # someone is writing to the socket; protected by cv
        self.queue: collections.deque[tuple[list[memoryview], Header, Slot]] = collections.deque()
        self.writer: threading.Thread | None = None


def _forget_in_child(ref: "weakref.ref[TcpTransport]") -> None:
    """In a forked child (a DataLoader worker, say), drop the inherited connections.

    Otherwise the child's copies keep them open after the parent dies, and peers
    would not see the parent's death until their deadline.
    """
    t = ref()
    if t is not None and not t._closing:
        t._closing = True
        for p in t._peers.values():
            p.sock.close()  # the child's descriptor only: the parent's connection stays up


class TcpTransport(Transport):
    """Connects ``rank`` to all ``world_size - 1`` peers through ``store``."""

    def __init__(self, rank: int, world_size: int, store: Store, host: str, secret: bytes,
                 connect_timeout: float, max_frame: int, hostname: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.mailbox = Mailbox(rank)
        self.mailbox.reply = lambda peer, group, error: self.abort(group, [peer], error)
        self._secret = secret
        self._max_frame = max_frame
        self._closing = False
        self._peers: dict[int, _Peer] = {}
        self._hosts: dict[int, str] = {rank: hostname}
        self._connect(store, host, connect_timeout, hostname)
        for peer in self._peers.values():
            threading.Thread(target=self._read_loop, args=(peer,), daemon=True,
                             name=f"tandem-read-{rank}<{peer.rank}").start()
        me = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_in_child(me))

    # -- set-up ----------------------------------------------------------------------
    def _connect(self, store: Store, host: str, timeout: float, hostname: str) -> None:
        deadline = time.monotonic() + timeout
        listener = _wire.listen(host, 0)
        cond = threading.Condition()
        accepted: dict[int, socket.socket] = {}
        expected = set(range(self.rank + 1, self.world_size))
        try:
            port = listener.getsockname()[1]
            store.set(f"addr/{self.rank}", f"{host}:{port}|{hostname}")
            if expected:
                threading.Thread(target=self._accept_loop,
                                 args=(listener, expected, accepted, cond, deadline),
                                 daemon=True, name=f"tandem-accept-{self.rank}").start()
            for peer in range(self.rank):
                addr, _, peer_host = store.get(f"addr/{peer}").decode().partition("|")
                peer_ip, _, peer_port = addr.rpartition(":")
                self._hosts[peer] = peer_host
                left = max(0.1, deadline - time.monotonic())
                sock = _wire.connect(peer_ip, int(peer_port), left, f"rank {peer}")
                try:
                    _wire.client_handshake(sock, self._secret, _PURPOSE)
                    sock.sendall(_HELLO.pack(self.rank, self.world_size))
                except BaseException:
                    sock.close()
                    raise
                self._peers[peer] = _Peer(peer, sock)
            with cond:
                while not expected <= accepted.keys():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = sorted(expected - accepted.keys())
                        raise NetworkError(
                            f"rank {self.rank}: rank(s) {missing} did not connect within "
                            f"{timeout:.0f}s"
                        )
                    cond.wait(left)
            for peer in expected:
                self._peers[peer] = _Peer(peer, accepted[peer])
                addr = store.get(f"addr/{peer}").decode()
                self._hosts[peer] = addr.partition("|")[2]
        except BaseException:
            for p in self._peers.values():
                p.sock.close()
            for s in accepted.values():
                s.close()
            raise
        finally:
            listener.close()

    def _accept_loop(self, listener: socket.socket, expected: set[int],
                     accepted: dict[int, socket.socket], cond: threading.Condition,
                     deadline: float) -> None:
        def waiting() -> bool:
            with cond:
                return not expected <= accepted.keys()

        _wire.accept_while(listener, deadline, waiting,
                           lambda sock: self._admit(sock, expected, accepted, cond))

    def _admit(self, sock: socket.socket, expected: set[int],
               accepted: dict[int, socket.socket], cond: threading.Condition) -> None:
        """Authenticate one incoming connection; anything wrong just closes it."""
        try:
            sock.settimeout(_wire.HANDSHAKE_TIMEOUT)
            _wire.server_handshake(sock, self._secret, _PURPOSE)
            peer, world = _HELLO.unpack(_wire.recv_exact(sock, _HELLO.size))
            sock.settimeout(None)
            _wire.tune(sock)
        except (OSError, TandemError) as exc:
            self._debug(f"rejected a connection: {exc}")
            sock.close()
            return
        with cond:
            if peer in expected and peer not in accepted and world == self.world_size:
                accepted[peer] = sock
                cond.notify_all()
                return
        self._debug(f"rejected an authenticated connection claiming rank {peer}/{world}")
        sock.close()

    def _debug(self, message: str) -> None:
        if os.environ.get("TANDEM_DEBUG", "0") not in ("", "0"):
            print(f"[tandem rank {self.rank}] {message}", file=sys.stderr)

    # -- data path -------------------------------------------------------------------
    def _read_loop(self, peer: _Peer) -> None:
        reader = _wire.BufferedReader(peer.sock)
        read = reader.read_into
        try:
            while True:
                kind, group, seq, step, nbytes, siglen, sitelen = _HDR.unpack(
                    reader.read(_HDR.size))
                check_size(nbytes, self._max_frame, peer.rank)
                extra = reader.read(siglen + sitelen) if siglen + sitelen else b""
                header = Header(kind, group, seq, step, nbytes, extra[:siglen], extra[siglen:])
                self.mailbox.arrive(peer.rank, header, read)
        except ProtocolError as exc:
            # refuse the rest of this peer's stream; closing tells the sender at once
            self._shutdown(peer.sock)
            if not self._closing:
                self.mailbox.peer_lost(peer.rank, PeerLostError(
                    f"rank {self.rank} dropped its connection to rank {peer.rank}: {exc}",
                    peer.rank))
        except (OSError, TandemError) as exc:
            if not self._closing:
                self.mailbox.peer_lost(peer.rank, PeerLostError(
                    f"rank {peer.rank} (host {self._hosts.get(peer.rank) or '?'}) closed its "
                    f"connection to rank {self.rank} ({exc}); did it exit or crash?",
                    peer.rank))

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
        self._check_peer(peer, p is not None, "connection")
        assert p is not None
        slot = self._send_slot(peer, header)
        head = _HDR.pack(header.kind, header.group, header.seq, header.step, header.nbytes,
                         len(header.sig), len(header.site)) + header.sig + header.site
        parts = [memoryview(head)]
        parts += [b if b.ndim == 1 and b.format == "B" else b.cast("B") for b in pieces]
        with p.cv:
            inline = not p.queue and not p.busy and header.nbytes <= _INLINE_MAX
            if inline:
                p.busy = True
            else:
                self._enqueue(p, parts, header, slot, front=False)
        if inline:
            # never block the caller: a stopped peer with full buffers must not stall us past
            # the op's deadline, so what the kernel does not take now goes to the writer
            try:
                _sendall_vec(p.sock, parts, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            except OSError as exc:
                parts = []
                self._send_failed(p, slot, exc)
            with p.cv:
                p.busy = False
                if parts:
                    self._enqueue(p, parts, header, slot, front=True)
                else:
                    p.cv.notify()
            if not parts and not slot.done():
                slot.finish(header)
        return slot

    def _enqueue(self, p: _Peer, parts: list[memoryview], header: Header, slot: Slot,
                 front: bool) -> None:
        """Queue for the writer thread (caller holds ``p.cv``)."""
        if front:
            p.queue.appendleft((parts, header, slot))
        else:
            p.queue.append((parts, header, slot))
        if p.writer is None:
            p.writer = threading.Thread(target=self._write_loop, args=(p,), daemon=True,
                                        name=f"tandem-write-{self.rank}>{p.rank}")
            p.writer.start()
        p.cv.notify()

    def _send_failed(self, p: _Peer, slot: Slot, exc: OSError) -> None:
        error = PeerLostError(f"rank {self.rank} could not send to rank {p.rank}: {exc}; "
                              f"did it exit or crash?", p.rank)
        if not self._closing:
            self.mailbox.peer_lost(p.rank, error)
        slot.finish(None, error)

    def _write_loop(self, p: _Peer) -> None:
        while True:
            with p.cv:
                while not p.queue or p.busy:
                    if self._closing:
                        return
                    p.cv.wait()
                parts, header, slot = p.queue.popleft()
                p.busy = True
            try:
                _sendall_vec(p.sock, parts)
                slot.finish(header)
            except OSError as exc:
                self._send_failed(p, slot, exc)
            with p.cv:
                p.busy = False
                p.cv.notify_all()

    def host_of(self, rank: int) -> str:
        return self._hosts.get(rank, "")

    def close(self) -> None:
        if not self._closing:
            self.say_goodbye(list(self._peers))
        self._closing = True
        for p in self._peers.values():
            with p.cv:
                p.cv.notify_all()
            self._shutdown(p.sock)
            p.sock.close()
