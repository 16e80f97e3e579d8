"""Sockets, framing and authentication shared by the store, the transport and RPC.

Every TCP connection in tandem starts with a mutual HMAC-SHA256 challenge-response
over the job secret, before any payload is parsed. The handshake has fixed sizes,
so nothing a stranger sends is ever interpreted as a length:

    server -> client   MAGIC(8) nonce_s(32)
    client -> server   MAGIC(8) nonce_c(32) HMAC(secret, "C" purpose nonce_s nonce_c)
    server -> client   HMAC(secret, "S" purpose nonce_c nonce_s)

``purpose`` separates the store protocol from the transport protocol, so a reply
recorded on one cannot be replayed on the other. A server that finds the client's
HMAC wrong answers ``REFUSED`` in place of its own, so a client with the wrong secret
is told so, while a connection that merely closes (the server went away) is not
mistaken for one. The server side runs in :mod:`tandem._gate`. After the handshake,
frames are length-prefixed and the length is checked against a cap before anything
is read. Nothing after the handshake is authenticated or encrypted (README, "Security").
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import mmap
import os
import select
import socket
import struct
import time
from typing import Iterator

from tandem._words import secs
from tandem.errors import ArgumentError, AuthenticationError, NetworkError, ProtocolError

__all__ = [
    "bind",
    "MAGIC",
    "REFUSED",
    "HANDSHAKE_TIMEOUT",
    "client_handshake",
    "client_handshake_start",
    "client_handshake_finish",
    "server_proof",
    "connect",
    "listen",
    "recv_exact",
    "recv_into_exact",
    "send_frame",
    "recv_frame",
    "is_loopback",
    "is_wildcard",
    "route_address",
    "advertised_address",
    "tune",
]

MAGIC = b"TANDEM01"
NONCE = 32
MAC = 32
REFUSED = b"TANDEM: REFUSED, WRONG SECRET..."  # sent in place of the server's MAC
HANDSHAKE_TIMEOUT = 10.0
_LEN = struct.Struct("!I")
_LOWAT_POLL_MS = 1000  # a reader waiting on a low-water mark re-polls this often (a safety net)


def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


# OpenSSL's HMAC set up at import, so a worker forked from tandemrun's zygote inherits it
_mac(b"import", b"")


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``; raise ``NetworkError`` on EOF."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got, socket.MSG_WAITALL)
        if n == 0:
            raise NetworkError(f"connection closed after {got} of {total} bytes")
        got += n


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def server_proof(secret: bytes, purpose: bytes, nonce_s: bytes, reply: bytes) -> bytes | None:
    """The server's answer to a client's ``reply`` to the challenge ``nonce_s``: its own
    HMAC if the client proved the secret, else None."""
    if len(reply) != len(MAGIC) + NONCE + MAC or reply[: len(MAGIC)] != MAGIC:
        return None
    nonce_c = reply[len(MAGIC) : len(MAGIC) + NONCE]
    expected = _mac(secret, b"C", purpose, nonce_s, nonce_c)
    if not hmac.compare_digest(expected, reply[len(MAGIC) + NONCE :]):
        return None
    return _mac(secret, b"S", purpose, nonce_c, nonce_s)


def client_handshake(sock: socket.socket, secret: bytes, purpose: bytes,
                     what: str = "the server") -> None:
    """Prove knowledge of the secret to the server and check that it knows it too.

    Raises ``AuthenticationError`` when either side does not know the secret (or the
    server is no tandem server), ``NetworkError`` when the connection breaks or stalls
    during the handshake. ``what`` names the server in the messages.
    """
    client_handshake_finish(sock, client_handshake_start(sock, secret, purpose, what), what)


def client_handshake_start(sock: socket.socket, secret: bytes, purpose: bytes,
                           what: str = "the server") -> bytes:
    """The first half of :func:`client_handshake`: answer the server's challenge.

    Returns what :func:`client_handshake_finish` expects from the server. A rank
    connecting to many peers starts every handshake before finishing any, so the
    peers answer in parallel rather than one after another.
    """
    with _handshake_errors(sock, what):
        hello = recv_exact(sock, len(MAGIC) + NONCE)
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthenticationError(f"{what} does not speak the tandem protocol")
        nonce_s = hello[len(MAGIC) :]
        nonce_c = os.urandom(NONCE)
        sock.sendall(MAGIC + nonce_c + _mac(secret, b"C", purpose, nonce_s, nonce_c))
    return _mac(secret, b"S", purpose, nonce_c, nonce_s)


def client_handshake_finish(sock: socket.socket, expected: bytes,
                            what: str = "the server") -> None:
    """The second half of :func:`client_handshake`: check the server's proof."""
    with _handshake_errors(sock, what):
        proof = recv_exact(sock, MAC)
        if proof == REFUSED:
            raise AuthenticationError(
                f"{what} refused this process's proof: wrong job secret (TANDEM_SECRET or "
                f"TANDEM_SECRET_FILE must be the same for every rank)")
        if not hmac.compare_digest(proof, expected):
            raise AuthenticationError(f"{what} failed authentication: it does not know "
                                      f"the job secret")


@contextlib.contextmanager
def _handshake_errors(sock: socket.socket, what: str) -> Iterator[None]:
    """Bound one handshake step by ``HANDSHAKE_TIMEOUT`` and name what went wrong."""
    old = sock.gettimeout()
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        yield
    except socket.timeout as exc:
        raise NetworkError(
            f"{what} did not finish the handshake within {HANDSHAKE_TIMEOUT:.0f}s") from exc
    except (OSError, NetworkError) as exc:
        if isinstance(exc, AuthenticationError):
            raise
        raise NetworkError(f"{what} went away during the handshake (or dropped this "
                           f"connection): {exc}") from exc
    finally:
        sock.settimeout(old)


def _same_machine(sock: socket.socket) -> bool:
    try:
        mine, peer = sock.getsockname()[0], sock.getpeername()[0]
        return peer == mine or ipaddress.ip_address(peer).is_loopback
    except (OSError, ValueError, IndexError, TypeError):
        return False


def tune(sock: socket.socket) -> None:
    """Latency and throughput settings applied to every data connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # 4 MiB covers 10 Gbit/s x 3 ms between hosts; on one machine 1 MiB, as fast as 4 MiB
    # idle without letting a sender run ahead of a descheduled reader (docs/design.md)
    size = 1 << 20 if _same_machine(sock) else 4 << 20
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, size)
        except OSError:
            pass


def connect(host: str, port: int, timeout: float, what: str) -> socket.socket:
    """Connect to ``host:port``, retrying refused connections until ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise NetworkError(
                f"could not connect to {what} at {host}:{port} within {secs(timeout)}s: {last}"
            ) from last
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 10.0))
            sock.settimeout(None)
            tune(sock)
            return sock
        except OSError as exc:
            last = exc
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)


def bind(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to exactly ``host:port`` (0: the kernel picks); raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


# The kernel's queue of connections not yet accepted, as long as it allows (somaxconn):
# with a short one, a flood of strangers fills it and the kernel drops the ranks' SYNs
# (retried after 1, 3, 7 s...), while a long one keeps everyone in line, first come
# first served, at no cost to us (see tandem._gate).
BACKLOG = 4096


def listen(host: str, port: int = 0, backlog: int = BACKLOG) -> socket.socket:
    """A listening socket bound to exactly ``host`` (never widened)."""
    try:
        sock = bind(host, port)
    except OSError as exc:
        raise NetworkError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(backlog)
    return sock


def check_bind_address(host: str, what: str) -> str:
    """``host``, given as setting ``what``, once a socket can be bound there; every
    interface only when spelled 0.0.0.0 or ``::``: ``0`` means the same to the kernel,
    but peers told to connect to it would reach their own host."""
    try:
        sock = bind(host)
    except (OSError, UnicodeError) as exc:
        raise ArgumentError(
            f"{what}={host!r}: this host cannot listen there ({exc}); give the address (or "
            f"name) of one of its interfaces, 0.0.0.0 for every interface, or unset it "
            f"(loopback for one host, else the interface that routes to MASTER_ADDR)") from exc
    with sock:
        every = ipaddress.ip_address(sock.getsockname()[0]).is_unspecified
    if every and not is_wildcard(host):
        raise ArgumentError(
            f"{what}={host!r} means every interface; write 0.0.0.0 (or ::) if that is "
            f"meant, or give one interface's address")
    return host


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, cap: int) -> bytes:
    """Read one length-prefixed frame; refuse lengths above ``cap`` before reading."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > cap:
        raise ProtocolError(f"frame of {n} bytes exceeds the cap of {cap} bytes")
    return recv_exact(sock, n)


def is_loopback(host: str) -> bool:
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface (``0.0.0.0``, ``::``, empty)."""
    return host in ("", "0.0.0.0", "::")


def route_address(toward: str) -> str:
    """The local address of the interface the kernel would use to reach ``toward``.

    Raises ``OSError`` when ``toward`` does not resolve or nothing routes to it.
    """
    family, _, _, _, where = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)[0]
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:
        probe.connect(where)  # a UDP connect sends nothing; it only picks the route
        return str(probe.getsockname()[0])
    finally:
        probe.close()


# An address of TEST-NET-1 (RFC 5737): never used by anyone, so the route to it is the
# default route. Only a route lookup is made; nothing is ever sent there.
_SOMEWHERE = "192.0.2.1"


def advertised_address(bind: str, toward: str | None) -> str:
    """The address that peers should dial to reach a listener bound to ``bind``.

    A listener bound to one address is reached there. One bound to every interface
    (``0.0.0.0``) is reached through the interface that routes to ``toward`` (the
    master's address: the network the job runs on), else through the interface of
    the default route, else through loopback.
    """
    if not is_wildcard(bind):
        return bind
    if toward and not is_wildcard(toward):
        if is_loopback(toward):
            return "::1" if ":" in toward else "127.0.0.1"
        try:
            return route_address(toward)
        except OSError:
            pass
    try:
        return route_address(_SOMEWHERE)
    except OSError:
        return "127.0.0.1"


class BufferedReader:
    """Reads a socket through a small buffer: headers and small payloads in one call.

    A message's fixed header, its variable part and a small payload usually arrive
    together; reading them with one ``recv`` instead of three saves system calls and
    GIL round trips on the latency path. Large payloads bypass the buffer: what is
    already buffered is copied, the rest is received straight into the destination.

    ``wake_bytes`` (0: off): a payload longer than that is received in steps of that
    many bytes, the thread woken once per step (``SO_RCVLOWAT``) instead of once per
    arriving packet (see :meth:`_read_large`).
    """

    def __init__(self, sock: socket.socket, size: int = 64 << 10, wake_bytes: int = 0) -> None:
        self.sock = sock
        self.wake_bytes = wake_bytes
        # an anonymous mapping's pages are touched only as data lands in them, so a quiet
        # connection holds a page, not 64 KiB (a bytearray is zeroed whole): at 8 hosts x
        # 8 a rank's 56 connections held 3.5 MB of buffers, more than its other memory
        self.buf = mmap.mmap(-1, size)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    def close(self) -> None:
        """Unmap the buffer now (a mapping stays in the process's maps until freed); only
        once nothing reads from it any more."""
        try:
            self.view.release()
            self.buf.close()
        except BufferError:
            pass  # a view of it is still held somewhere: it goes when that view does

    def _fill(self, need: int) -> None:
        if self.end - self.start >= need:
            return
        if need > len(self.buf):
            raise ValueError(f"cannot buffer {need} bytes")
        if self.start:
            held = self.end - self.start
            self.view[:held] = self.view[self.start:self.end]
            self.start, self.end = 0, held
        while self.end < need:
            n = self.sock.recv_into(self.view[self.end:])
            if n == 0:
                raise NetworkError(f"connection closed after {self.end} of {need} bytes")
            self.end += n

    def read(self, n: int) -> bytes:
        """``n`` bytes (``n`` at most the buffer size)."""
        self._fill(n)
        out = bytes(self.view[self.start:self.start + n])
        self.start += n
        return out

    def read_into(self, view: memoryview) -> None:
        held = min(self.end - self.start, len(view))
        if held:
            view[:held] = self.view[self.start:self.start + held]
            self.start += held
        if held < len(view):
            if self.wake_bytes and len(view) - held > self.wake_bytes:
                self._read_large(view[held:])
            else:
                recv_into_exact(self.sock, view[held:])

    def _read_large(self, view: memoryview) -> None:
        """Fill ``view`` waking once per ``wake_bytes`` arrived.

        A blocked ``recv`` wakes for every packet the kernel queues (64 KB on loopback),
        whatever its length or ``MSG_WAITALL``. The low-water mark instead makes the
        socket readable once that many bytes wait. It is never set above what this
        payload still lacks: the kernel compares it with the bytes queued, not with what
        a call still needs, so a mark above the rest of a payload whose sender then
        waits would never be reached. The mark goes back to 1 before any other read.
        """
        sock, total, got, mark = self.sock, len(view), 0, 1
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        try:
            while got < total:
                want = min(total - got, self.wake_bytes)
                if want != mark:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    mark = want
                poller.poll(_LOWAT_POLL_MS)  # readable, closed, or a second passed
                try:
                    n = sock.recv_into(view[got:], total - got, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if n == 0:
                    raise NetworkError(f"connection closed after {got} of {total} bytes")
                got += n
        finally:
            if mark != 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
