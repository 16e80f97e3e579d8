"""TCPStore: the key-value store that ranks on one or many hosts rendezvous through.

The master rank runs the server in a daemon thread of its own process; every rank,
the master included, talks to it over TCP::

    master = TCPStore("127.0.0.1", 0, world_size=2, is_master=True)  # port 0: pick one
    worker = TCPStore("127.0.0.1", master.port, world_size=2)        # in another process
    worker.set("addr", b"10.0.0.2:5000");  master.get("addr")

Each connection first passes the HMAC handshake of :mod:`tandem._wire` with the job
secret (:func:`tandem.config.load_secret` unless ``secret=`` is given); nothing is parsed
before it. One gate thread (:mod:`tandem._gate`) runs the handshakes of all strangers;
a connection gets a thread of its own once it proves the secret. A request and its reply are then one length-prefixed frame each::

    request  op(1)     field*        field = length(4, big-endian) bytes
    reply    status(1) field*

Values are capped at ``MAX_VALUE`` bytes; a larger frame makes the server drop that
connection. ``get``/``wait`` send the seconds they have left; the server parks them on a
condition variable that every write notifies and answers TIMEOUT when the time is up.
``multi_get`` (waiting for all its keys) and ``multi_set`` are one request each, so a
rank reads every peer's entry at start-up in one round trip.
The server and its frames are in :mod:`tandem.store._tcp_server`; this module is the
client side and the public class.
"""

from __future__ import annotations

import collections
import datetime
import socket
import threading
import time
import warnings
import weakref
from typing import Sequence

from tandem._words import secs
from tandem import _wire
from tandem.config import MAX_WORLD_SIZE, at_most, load_secret, timeout_seconds
from tandem.errors import (
    ArgumentError,
    AuthenticationError,
    NetworkError,
    StateError,
    StoreError,
    StoreTimeoutError,
)
from tandem.store._tcp_server import (F64, MAX_FRAME, MAX_VALUE, PURPOSE, Op, Server,
                                     Status, acquire_server, decode, encode, release_server)
from tandem.store.base import Store

__all__ = ["TCPStore", "MAX_VALUE"]

MAX_IDLE = 4  # idle client connections kept per TCPStore for reuse
# Seconds a client allows beyond a get/wait deadline for the reply (the server answers
# TIMEOUT itself at the deadline), and for opening an extra connection to a live server.
REPLY_GRACE = 5.0
# Incarnations of store servers this process left for good (TCPStore.leave): a new
# TCPStore at the same address waits for the next server instead of joining the old one.
_LEFT: collections.deque[bytes] = collections.deque(maxlen=64)
_WORKERS = "\x00tandem/workers"
_JOINED = "\x00tandem/all_workers_joined"


class _Restarting(Exception):
    """The server reached is closing or was left by this process; try again soon."""


def _why_not(host: str, error: BaseException | None) -> str:
    """What the last connection attempt met, in words a user can act on."""
    if isinstance(error, socket.gaierror):
        return (f"the host name {host!r} does not resolve ({error}); check MASTER_ADDR or "
                f"the init_method URL")
    if isinstance(error, ConnectionRefusedError):
        return (f"nothing listens there ({error}); is rank 0 (the store's host) running, "
                f"and MASTER_PORT right?")
    return f"last attempt: {error}; is the address reachable from this host?"


class _Client:
    """The connections of one TCPStore: one per concurrent caller, reused when idle.

    A blocked ``get`` keeps its connection, so another thread of the same store can
    still ``set`` the key it waits for (one shared connection would deadlock them).
    """

    def __init__(self, host: str, port: int, secret: bytes, timeout: float,
                 connect_timeout: float) -> None:
        self.where = f"{host}:{port}"
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._host, self._port, self._secret = host, port, secret
        self._lock = threading.Lock()  # guards the fields below
        self._idle: list[socket.socket] = []
        self._all: set[socket.socket] = set()
        self._closed = False
        self._lost: str | None = None  # why the server is gone, once it is
        self.incarnation = b""  # the server's, from its HELLO
        self._idle.append(self._open(first=True))

    def _open(self, first: bool = False) -> socket.socket:
        # The first connect waits for the server to come up (and for its name to resolve:
        # a host that starts late may not be in DNS yet), and through a restart: a server
        # this process left, or one closing (a reset handshake), is the previous
        # incarnation on this port, about to make room for the next. Later connects only
        # run while the server is known to be up, so a refusal soon means that it is gone.
        limit = self.connect_timeout if first else min(self.timeout, REPLY_GRACE)
        deadline = time.monotonic() + limit
        delay = 0.01
        hung_up: _Restarting | None = None  # a server that went away mid-handshake
        while True:
            try:
                sock, incarnation = self._connect(first, deadline, limit)
            except _Restarting as exc:
                hung_up = exc if exc.__cause__ is not None else None
                if time.monotonic() + delay >= deadline:
                    if hung_up is not None:
                        raise StoreError(f"{hung_up}, and no server answered there again "
                                         f"within {secs(limit)}s") from hung_up.__cause__
                    raise StoreTimeoutError(
                        f"could not connect to the store at {self.where} within "
                        f"{secs(limit)}s: {exc}") from exc.__cause__
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
                continue
            except StoreTimeoutError as exc:
                if hung_up is None:
                    raise
                # the server went away and none came back: say so, not "nothing listens"
                raise StoreError(f"{hung_up}, and no server answered there again within "
                                 f"{secs(limit)}s") from exc
            if first:
                self.incarnation = incarnation
            elif incarnation != self.incarnation:
                sock.close()
                raise StoreError(f"the store server at {self.where} restarted: its data is "
                                 f"gone")
            with self._lock:
                if self._closed:
                    sock.close()
                    raise StateError("TCPStore is closed")
                self._all.add(sock)
            return sock

    def _connect(self, first: bool, deadline: float,
                 limit: float) -> tuple[socket.socket, bytes]:
        """One connection, authenticated, with the server's incarnation."""
        try:
            sock = _wire.connect(self._host, self._port, max(0.0, deadline - time.monotonic()),
                                 "store")
        except NetworkError as exc:
            if not first:
                raise StoreError(f"the store server at {self.where} stopped accepting") from exc
            raise StoreTimeoutError(
                f"could not connect to the store at {self.where} within {secs(limit)}s: "
                f"{_why_not(self._host, exc.__cause__)}") from exc
        try:
            _wire.client_handshake(sock, self._secret, PURPOSE, f"the store at {self.where}")
            sock.settimeout(max(0.1, min(REPLY_GRACE, deadline - time.monotonic())))
            _wire.send_frame(sock, encode(Op.HELLO, ()))
            _, reply = decode(_wire.recv_frame(sock, MAX_FRAME))
            incarnation = _single(reply)
        except AuthenticationError:
            sock.close()
            raise
        except (NetworkError, OSError) as exc:  # a reset is no wrong secret: it is closing
            sock.close()
            if not first:
                raise StoreError(str(exc)) from exc
            raise _Restarting(str(exc)) from exc
        except BaseException:
            sock.close()
            raise
        if first and incarnation in _LEFT:
            sock.close()
            raise _Restarting("the server there is still the one this process left (by "
                              "destroy_process_group or rpc.shutdown); its host has not "
                              "started the next one")
        return sock, incarnation

    def _take(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise StateError("TCPStore is closed")
            if self._lost is not None:
                raise StoreError(self._lost)
            if self._idle:
                return self._idle.pop()
        return self._open()

    def _release(self, sock: socket.socket, reuse: bool) -> None:
        with self._lock:
            if reuse and not self._closed and self._lost is None and len(self._idle) < MAX_IDLE:
                self._idle.append(sock)
                return
            self._all.discard(sock)
        sock.close()

    def call(self, op: Op, fields: Sequence[bytes], wait: float = 0.0) -> tuple[Status, list[bytes]]:
        """Send one request and return the reply; ``wait`` is how long the server may block."""
        request = encode(op, fields)
        if len(request) > MAX_FRAME:
            raise ArgumentError(f"store request of {len(request)} bytes exceeds {MAX_FRAME}")
        sock = self._take()
        limit = wait + REPLY_GRACE if op in (Op.GET, Op.WAIT, Op.MULTI_GET) else self.timeout
        try:
            sock.settimeout(limit)
            _wire.send_frame(sock, request)
            code, reply = decode(_wire.recv_frame(sock, MAX_FRAME))
            status = Status(code)
        except socket.timeout as exc:
            self._release(sock, reuse=False)  # a late reply would answer the next request
            raise StoreTimeoutError(
                f"store server at {self.where} did not answer {op.name} within {secs(limit)}s"
            ) from exc
        except (OSError, NetworkError, ValueError) as exc:
            self._release(sock, reuse=False)
            if self._closed:
                raise StateError("TCPStore was closed during the call") from exc
            # The server only hangs up when it stops, so every other call fails fast too.
            with self._lock:
                self._lost = self._lost or f"lost the store server at {self.where}: {exc}"
            self.close_idle()
            raise StoreError(self._lost) from exc
        self._release(sock, reuse=True)
        if status is Status.BAD_ARGUMENT:
            raise ArgumentError(b"".join(reply).decode(errors="replace"))
        return status, reply

    def close_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._all.difference_update(idle)
        for sock in idle:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._all, self._idle = list(self._all), set(), []
        for sock in socks:  # shutdown wakes other threads blocked on these sockets
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def _shutdown(client: _Client, server: Server | None, linger: float = 0.0) -> None:
    client.close()
    if server is not None:
        release_server(server, linger)


def _connect_host(host: str) -> str:
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


class TCPStore(Store):
    """A store served over TCP by the master rank; see the module docstring.

    Mirrors ``torch.distributed.TCPStore``. With ``wait_for_workers`` and a
    ``world_size``, every instance counts itself in and the master's constructor
    returns once ``world_size`` instances (itself included) have joined, or raises
    ``StoreTimeoutError`` after ``timeout``. ``close()`` (or ``with``) releases the
    connections and, on the master, stops the server. ``connect_timeout`` (tandem's
    addition; default ``timeout``) bounds reaching the server, name resolution included;
    when it passes, the error names the address and what the last attempt met.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: float | datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        *,
        secret: bytes | str | None = None,
        connect_timeout: float | datetime.timedelta | None = None,
    ) -> None:
        super().__init__(timeout)
        connect = timeout_seconds(connect_timeout, self._timeout, "TCPStore: connect_timeout")
        if not isinstance(host_name, str):
            raise ArgumentError(f"TCPStore: host_name must be a str (a host name or address), "
                                f"got {host_name!r}")
        for name, flag in (("is_master", is_master), ("wait_for_workers", wait_for_workers),
                           ("multi_tenant", multi_tenant)):
            # is_master="no" made this process the master
            if isinstance(flag, str) or flag not in (True, False):
                raise ArgumentError(f"TCPStore: {name} must be True or False, got {flag!r}")
        if isinstance(port, bool) or isinstance(world_size, bool):
            raise ArgumentError(f"TCPStore: port and world_size are ints, got {port!r} and "
                                f"{world_size!r}")
        if not isinstance(port, int) or not 0 <= port <= 65535 or (port == 0 and not is_master):
            raise ArgumentError(f"TCPStore: port must be an int, 1..65535 (or 0 on the master: "
                                f"any free port), got {port!r}")
        if world_size == -1:
            world_size = None
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise ArgumentError(f"world_size must be a positive int or None, got {world_size!r}")
        if world_size is not None:
            at_most("TCPStore: world_size", world_size, MAX_WORLD_SIZE,
                    "MAX_WORLD_SIZE, far beyond any job tandem serves",
                    "give the number of processes that will use the store")
        if secret is not None and not isinstance(secret, (bytes, bytearray, str)):
            # bytes(5) is five zero bytes, and bytes(10**9) a gigabyte of them
            raise ArgumentError(f"TCPStore: secret must be bytes or str, got "
                                f"{type(secret).__name__}")
        key = load_secret() if secret is None else secret
        key = key.encode() if isinstance(key, str) else bytes(key)
        if not key:
            raise ArgumentError("the store secret must not be empty")
        self.host = host_name
        if is_master and _wire.is_wildcard(host_name):
            warnings.warn(
                f"the TCPStore listens on every interface of this host ({host_name!r}): "
                f"anyone who can reach it may connect and try to authenticate, and its "
                f"traffic is not encrypted; give this host's address (MASTER_ADDR, "
                f"--master-addr) to listen on that interface only", stacklevel=2)
        self._server = acquire_server(host_name, port, key, multi_tenant) if is_master else None
        self.port: int = self._server.address[1] if self._server else port
        try:
            self._client = _Client(_connect_host(host_name), self.port, key, self._timeout,
                                   connect)
        except BaseException:
            if self._server is not None:
                release_server(self._server)
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self._client, self._server)
        if wait_for_workers and world_size is not None:
            try:
                self._join(world_size)
            except BaseException:
                self.close()
                raise

    def _join(self, world_size: int) -> None:
        if self._add(_WORKERS, 1) == world_size:
            self._set(_JOINED, b"1")
        if self._server is None:
            return  # as in torch, only the master waits for everyone
        try:
            self._wait([_JOINED], time.monotonic() + self._timeout, self._timeout)
        except StoreTimeoutError as exc:
            joined = int(self._get(_WORKERS, time.monotonic(), 0.0))
            raise StoreTimeoutError(
                f"only {joined} of {world_size} workers joined the store at "
                f"{self.host}:{self.port} within {secs(self._timeout)}s"
            ) from exc

    def close(self) -> None:
        self._finalizer()

    def leave(self, linger: float = 0.0) -> None:
        """Close for good, as a job's rank does when it tears down (destroy_process_group).

        A later ``TCPStore`` of this process at the same address does not join this
        server again: it waits, within its connect deadline, for the next one to start
        there. On the master, the server first stops accepting and waits up to
        ``linger`` seconds for the other clients to hang up, so a peer still finishing
        with it is not cut off by a restart on the same port.
        """
        if self._finalizer.detach() is None:
            return  # already closed
        _LEFT.append(self._client.incarnation)
        _shutdown(self._client, self._server, linger)

    def _check_size(self, *values: bytes) -> None:
        for value in values:
            if len(value) > MAX_VALUE:
                raise ArgumentError(f"store value of {len(value)} bytes exceeds {MAX_VALUE} bytes")

    def _set(self, key: str, value: bytes) -> None:
        self._check_size(value)
        self._client.call(Op.SET, [key.encode(), value])

    def _get(self, key: str, deadline: float, seconds: float) -> bytes:
        remaining = max(0.0, deadline - time.monotonic())
        status, reply = self._client.call(Op.GET, [F64.pack(remaining), key.encode()], remaining)
        if status is Status.TIMEOUT:
            raise self._timed_out([key], seconds)
        return _single(reply)

    def _add(self, key: str, amount: int) -> int:
        _, reply = self._client.call(Op.ADD, [key.encode(), str(amount).encode()])
        return int(_single(reply))

    def _append_value(self, key: str, value: bytes) -> None:
        self._check_size(value)
        self._client.call(Op.APPEND, [key.encode(), value])

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._check_size(expected, desired)
        _, reply = self._client.call(Op.COMPARE_SET, [key.encode(), expected, desired])
        return _single(reply)

    def _wait(self, keys: list[str], deadline: float, seconds: float) -> None:
        if not keys:
            return
        remaining = max(0.0, deadline - time.monotonic())
        fields = [F64.pack(remaining), *(k.encode() for k in keys)]
        status, missing = self._client.call(Op.WAIT, fields, remaining)
        if status is Status.TIMEOUT:
            raise self._timed_out([k.decode(errors="replace") for k in missing], seconds)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._check_size(*values)
        if keys:
            self._client.call(Op.MULTI_SET, [x for k, v in zip(keys, values)
                                             for x in (k.encode(), v)])

    def _multi_get(self, keys: list[str], deadline: float, seconds: float) -> list[bytes]:
        if not keys:
            return []
        remaining = max(0.0, deadline - time.monotonic())
        fields = [F64.pack(remaining), *(k.encode() for k in keys)]
        status, reply = self._client.call(Op.MULTI_GET, fields, remaining)
        if status is Status.TIMEOUT:
            raise self._timed_out([k.decode(errors="replace") for k in reply], seconds)
        if len(reply) != len(keys):
            raise StoreError(f"malformed store reply: {len(reply)} values for {len(keys)} keys")
        return reply

    def _check(self, keys: list[str]) -> bool:
        _, reply = self._client.call(Op.CHECK, [k.encode() for k in keys])
        return _single(reply) == b"\x01"

    def _delete(self, key: str) -> bool:
        _, reply = self._client.call(Op.DELETE, [key.encode()])
        return _single(reply) == b"\x01"

    def _num_keys(self) -> int:
        _, reply = self._client.call(Op.NUM_KEYS, [])
        return int(_single(reply))


def _single(reply: list[bytes]) -> bytes:
    if len(reply) != 1:
        raise StoreError(f"malformed store reply with {len(reply)} fields")
    return reply[0]
