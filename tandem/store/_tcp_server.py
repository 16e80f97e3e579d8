"""The TCPStore's server, inside the master rank's process, and the frames it speaks.

:class:`~tandem.store.tcp.TCPStore` starts a :class:`Server` on its master (one per
(host, port) in a process when ``multi_tenant``: :func:`acquire_server`); every request
and reply is one frame made by :func:`encode` and read by :func:`decode`. The protocol
is described in :mod:`tandem.store.tcp`.
"""

from __future__ import annotations

import collections
import enum
import math
import secrets
import socket
import struct
import threading
import time
from typing import Sequence

from tandem import _gate, _wire
from tandem.errors import ProtocolError, StoreError, TandemError

__all__ = ["Server", "Op", "Status", "encode", "decode", "acquire_server", "release_server",
           "PURPOSE", "MAX_VALUE", "MAX_FRAME", "INTERNAL", "F64"]

PURPOSE = b"tandem-store"
MAX_VALUE = 64 << 20
MAX_FRAME = 2 * MAX_VALUE + (1 << 20)  # compare_set carries two values, plus keys and headers
_MAX_WAIT = 7 * 24 * 3600.0  # threading refuses huge timeouts; nobody waits a week
# Keys the store uses for itself; they are not counted by num_keys.
INTERNAL = b"\x00tandem/"

_U32 = struct.Struct("!I")
F64 = struct.Struct("!d")  # the seconds a get or wait may take, as sent


class Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE = 7
    NUM_KEYS = 8
    APPEND = 9
    HELLO = 10  # reply: the server's incarnation (a new one each time a server starts)
    MULTI_GET = 11  # fields: wait seconds, keys; reply: their values (or TIMEOUT, missing)
    MULTI_SET = 12  # fields: key, value, key, value, ...


class Status(enum.IntEnum):
    OK = 0
    TIMEOUT = 1  # fields: the keys still missing
    BAD_ARGUMENT = 2  # fields: the message


def encode(code: int, fields: Sequence[bytes]) -> bytes:
    parts = [bytes([code])]
    for field in fields:
        parts += (_U32.pack(len(field)), field)
    return b"".join(parts)


def decode(frame: bytes) -> tuple[int, list[bytes]]:
    if not frame:
        raise ProtocolError("empty store frame")
    fields, pos = [], 1
    while pos < len(frame):
        if pos + _U32.size > len(frame):
            raise ProtocolError("store frame ends inside a field length")
        (n,) = _U32.unpack_from(frame, pos)
        pos += _U32.size
        if pos + n > len(frame):
            raise ProtocolError(f"store frame field of {n} bytes overruns the frame")
        fields.append(frame[pos : pos + n])
        pos += n
    return frame[0], fields


def _seconds(field: bytes) -> float:
    if len(field) != F64.size:
        raise ProtocolError(f"store wait time of {len(field)} bytes")
    value = float(F64.unpack(field)[0])
    if math.isnan(value):
        raise ProtocolError("store wait time is NaN")
    return min(max(value, 0.0), _MAX_WAIT)


class Server:
    """The store's data and the daemon threads serving it, inside the master process."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._secret = secret
        self._listener = _wire.listen(host, port)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self.users = 1  # TCPStore instances sharing this server (multi_tenant)
        # told apart from an earlier server on the same port (see TCPStore.leave)
        self.incarnation = secrets.token_bytes(8)
        self._data: dict[bytes, bytes] = {}
        self._cond = threading.Condition()  # guards everything below; notified on writes
        # keys a blocked get/wait asks for (how many ask): a write wakes the waiters only
        # if one of them waits for that key, so 64 ranks counting themselves in with add
        # do not wake every rank blocked on another key 64 times (measured: rendezvous of
        # 64 clients 5.9 s against torch's 2.8 s)
        self._wanted: collections.Counter[bytes] = collections.Counter()
        self.wakeups = 0  # times a blocked get/wait woke up (tests count them)
        self._conns: set[socket.socket] = set()
        self._closed = False
        # strangers wait in the gate's handshake; only connections that prove the
        # secret get a thread of their own (_serve)
        self._gate = _gate.Gate(self._listener, secret, PURPOSE, self._serve,
                                name=f"tandem-store:{self.address[1]}")
        self._thread = threading.Thread(
            target=self._gate.run, name=f"tandem-store-server:{self.address[1]}", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            self._cond.notify_all()
        self._gate.close()
        # shutdown() wakes the threads blocked in recv(); they close their sockets
        for sock in (self._listener, *conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def retire(self, linger: float) -> None:
        """Stop accepting, wait up to ``linger`` seconds for the connected clients to
        hang up, then close: peers finish with this server before a new one takes its port."""
        self._gate.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        end = time.monotonic() + linger
        with self._cond:
            while self._conns and not self._closed:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        self.close()

    def _serve(self, conn: socket.socket) -> None:
        """Answer the requests of one authenticated connection until it closes."""
        with self._cond:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            while True:
                request = _wire.recv_frame(conn, MAX_FRAME)
                _wire.send_frame(conn, self._handle(request))
        except (TandemError, OSError):
            pass  # a client that left or a malformed frame: drop this one only
        finally:
            with self._cond:
                self._conns.discard(conn)
                self._cond.notify_all()  # retire() waits for the last one
            conn.close()

    def _handle(self, frame: bytes) -> bytes:
        code, f = decode(frame)
        try:
            op = Op(code)
        except ValueError as exc:
            raise ProtocolError(f"unknown store op {code}") from exc
        arity = {Op.SET: 2, Op.GET: 2, Op.ADD: 2, Op.COMPARE_SET: 3, Op.DELETE: 1, Op.NUM_KEYS: 0,
                 Op.APPEND: 2, Op.HELLO: 0}
        if (op in arity and len(f) != arity[op] or op in (Op.WAIT, Op.MULTI_GET) and not f
                or op is Op.MULTI_SET and len(f) % 2):
            raise ProtocolError(f"store op {op.name} with {len(f)} fields")
        ok = Status.OK
        if op is Op.HELLO:
            return encode(ok, [self.incarnation])
        with self._cond:
            if op is Op.SET:
                self._write(f[0], f[1])
                return encode(ok, ())
            if op is Op.GET or op is Op.WAIT or op is Op.MULTI_GET:
                missing = self._await(f[1:], _seconds(f[0]))
                if missing:
                    return encode(Status.TIMEOUT, missing)
                if op is Op.WAIT:
                    return encode(ok, [])
                values = [self._data[k] for k in f[1:]]
                if sum(len(v) + _U32.size for v in values) >= MAX_FRAME:
                    message = (f"the {len(values)} values asked for in one multi_get exceed "
                               f"the {MAX_FRAME}-byte reply limit; ask for fewer keys at once")
                    return encode(Status.BAD_ARGUMENT, [message.encode()])
                return encode(ok, values)
            if op is Op.MULTI_SET:
                self._data.update(zip(f[::2], f[1::2]))
                if any(k in self._wanted for k in f[::2]):
                    self._cond.notify_all()  # one wake-up for the whole batch
                return encode(ok, ())
            if op is Op.ADD:
                try:
                    value = int(self._data.get(f[0], b"0")) + int(f[1])
                except ValueError:
                    message = f"store key {f[0]!r} does not hold an integer"
                    return encode(Status.BAD_ARGUMENT, [message.encode()])
                self._write(f[0], str(value).encode())
                return encode(ok, [str(value).encode()])
            if op is Op.COMPARE_SET:
                key, expected, desired = f
                current = self._data.get(key)
                if current is None and expected:
                    return encode(ok, [expected])
                if current is not None and current != expected:
                    return encode(ok, [current])
                self._write(key, desired)
                return encode(ok, [desired])
            if op is Op.APPEND:
                grown = self._data.get(f[0], b"") + f[1]
                if len(grown) > MAX_VALUE:  # appends must not grow a value past the cap
                    message = f"appending to store key {f[0]!r} would exceed {MAX_VALUE} bytes"
                    return encode(Status.BAD_ARGUMENT, [message.encode()])
                self._write(f[0], grown)
                return encode(ok, ())
            if op is Op.CHECK:
                return encode(ok, [b"\x01" if all(k in self._data for k in f) else b"\x00"])
            if op is Op.DELETE:
                return encode(ok, [b"\x01" if self._data.pop(f[0], None) is not None else b"\x00"])
            count = sum(1 for k in self._data if not k.startswith(INTERNAL))
            return encode(ok, [str(count).encode()])

    def _write(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        if key in self._wanted:
            self._cond.notify_all()

    def _await(self, keys: list[bytes], seconds: float) -> list[bytes]:
        """Wait (holding ``_cond``) until every key exists; return those still missing."""
        end = time.monotonic() + seconds
        self._wanted.update(keys)
        try:
            while True:
                if self._closed:
                    raise StoreError("store server closed")
                missing = [k for k in keys if k not in self._data]
                remaining = end - time.monotonic()
                if not missing or remaining <= 0:
                    return missing
                self._cond.wait(remaining)
                self.wakeups += 1
        finally:
            self._wanted.subtract(keys)
            for k in keys:
                if self._wanted[k] <= 0:
                    del self._wanted[k]


# multi_tenant masters of one process share one server per (host, port), as in torch.
_TENANTS: dict[tuple[str, int], Server] = {}
_TENANTS_LOCK = threading.Lock()


def acquire_server(host: str, port: int, secret: bytes, multi_tenant: bool) -> Server:
    if not multi_tenant or port == 0:
        return Server(host, port, secret)
    with _TENANTS_LOCK:
        server = _TENANTS.get((host, port))
        if server is None or server.closed:
            server = _TENANTS[(host, port)] = Server(host, port, secret)
        else:
            server.users += 1
        return server


def release_server(server: Server, linger: float = 0.0) -> None:
    """One user fewer; the last one closes it (after ``linger``: see ``Server.retire``)."""
    with _TENANTS_LOCK:
        server.users -= 1
        if server.users > 0:
            return
        for key, value in list(_TENANTS.items()):
            if value is server:
                del _TENANTS[key]
    if linger > 0:
        server.retire(linger)
    else:
        server.close()
