"""The gate of a listener: every stranger is authenticated on one thread, with a deadline.

Whoever can reach a port can connect to it. The gate runs the server side of the
handshake of :mod:`tandem._wire` for all pending connections of one listener on a
single thread, without blocking on any of them, and hands each connection that
proves the job secret to ``admit`` on a thread of its own::

    gate = Gate(listener, secret, b"tandem-store", admit, name="tandem-store-gate")
    threading.Thread(target=gate.run, daemon=True).start()    # until gate.close()
    gate.run(deadline=..., waiting=lambda: peers_missing)      # or on this thread

A flood of idle or slow strangers costs one socket each and nothing more: each has
``PENDING_DEADLINE`` seconds to authenticate, and at most ``MAX_PENDING`` wait at once.
When that many wait, a new connection pushes out the oldest one -- but never one
younger than ``EVICT_AGE``, which a peer that knows the secret has long finished by --
so ranks still get in while strangers keep connecting.
"""

from __future__ import annotations

import collections
import errno
import hmac
import os
import selectors
import socket
import threading
import time
from typing import Callable

from tandem import _wire

__all__ = ["Gate", "MAX_PENDING", "PENDING_DEADLINE", "EVICT_AGE"]

MAX_PENDING = 256
PENDING_DEADLINE = 5.0
EVICT_AGE = 0.5
_TICK = 0.2  # how often the loop looks at ``waiting``, the deadline and a closed listener
_REPLY = len(_wire.MAGIC) + _wire.NONCE + _wire.MAC


class _Pending:
    """One connection in the handshake: what is still to send, what was received."""

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.born = now
        self.nonce = os.urandom(_wire.NONCE)
        self.out = _wire.MAGIC + self.nonce
        self.got = bytearray()
        self.proven = False  # the reply checked out; hand over once ``out`` is sent


class Gate:
    """Authenticates the connections of ``listener``; see the module docstring."""

    def __init__(self, listener: socket.socket, secret: bytes, purpose: bytes,
                 admit: Callable[[socket.socket], None], *, name: str,
                 inline: bool = False) -> None:
        """``inline``: ``admit`` runs on the gate's own thread, for an ``admit`` that only
        reads a hello the peer sends right after the handshake (a thread start waits for
        the new thread to run: 10-30 ms each with 32 ranks on 2 CPUs)."""
        self._inline = inline
        self._listener = listener
        self._secret, self._purpose = secret, purpose
        self._admit = admit
        self._name = name
        self._pending: collections.OrderedDict[socket.socket, _Pending] = (
            collections.OrderedDict())  # oldest first
        self._wake_r, self._wake_w = socket.socketpair()
        self._closed = threading.Event()
        self._resume = 0.0  # out of descriptors with none to free: accept again after this

    def close(self) -> None:
        """Stop ``run`` (within a moment) and drop every connection still pending."""
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the loop already ended and closed it

    def run(self, deadline: float | None = None,
            waiting: Callable[[], bool] = lambda: True) -> None:
        """Admit connections until ``close()``, ``deadline``, ``waiting()`` turns false or
        the listener is closed; then drop the connections still pending."""
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        accepting = False
        try:
            try:
                self._listener.setblocking(False)
            except OSError:
                return  # its owner closed the listener before this thread first ran
            while not self._closed.is_set() and waiting() and self._listener.fileno() >= 0:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    return
                self._expire(sel, now)
                wanted = self._room(now)
                if wanted != accepting:
                    if wanted:
                        sel.register(self._listener, selectors.EVENT_READ)
                    else:
                        sel.unregister(self._listener)
                    accepting = wanted
                for key, events in sel.select(self._timeout(now, deadline)):
                    if key.fileobj is self._listener:
                        self._accept(sel)
                    elif key.fileobj is not self._wake_r:
                        self._step(sel, key.data, events)
        finally:
            for sock in list(self._pending):
                self._drop(sel, sock)
            sel.close()
            self._wake_r.close()
            self._wake_w.close()

    # -- the loop's pieces -----------------------------------------------------------------
    def _room(self, now: float) -> bool:
        """Whether to accept now: a free slot, or an oldest pending one old enough to evict."""
        if now < self._resume:
            return False
        if len(self._pending) < MAX_PENDING:
            return True
        oldest = next(iter(self._pending.values()))
        return now - oldest.born >= EVICT_AGE

    def _timeout(self, now: float, deadline: float | None) -> float:
        until = now + _TICK
        if self._pending:
            oldest = next(iter(self._pending.values()))
            until = min(until, oldest.born + PENDING_DEADLINE)
            if len(self._pending) >= MAX_PENDING:  # full: accept again once it may be evicted
                until = min(until, oldest.born + EVICT_AGE)
        if deadline is not None:
            until = min(until, deadline)
        return max(0.0, until - now)

    def _expire(self, sel: selectors.BaseSelector, now: float) -> None:
        while self._pending:
            sock, oldest = next(iter(self._pending.items()))
            if now - oldest.born < PENDING_DEADLINE:
                return
            self._drop(sel, sock)

    def _accept(self, sel: selectors.BaseSelector) -> None:
        for _ in range(64):  # a burst at a time, so handshakes in flight make progress
            now = time.monotonic()
            if not self._room(now):
                return
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    if self._pending:
                        self._drop(sel, next(iter(self._pending)))  # free a descriptor
                        continue
                    self._resume = now + _TICK  # nothing of ours to free: do not spin
                return  # or the listener was closed
            if len(self._pending) >= MAX_PENDING:
                self._drop(sel, next(iter(self._pending)))  # the oldest makes room
            sock.setblocking(False)
            entry = _Pending(sock, now)
            self._pending[sock] = entry
            sel.register(sock, selectors.EVENT_READ, entry)
            self._flush(sel, entry)

    def _step(self, sel: selectors.BaseSelector, entry: _Pending, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            self._flush(sel, entry)
            return
        try:
            data = entry.sock.recv(_REPLY - len(entry.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, entry.sock)  # the stranger left
            return
        entry.got += data
        if len(entry.got) < _REPLY:
            return
        proof = _wire.server_proof(self._secret, self._purpose, entry.nonce, bytes(entry.got))
        if proof is None:
            self._refuse(sel, entry)
            return
        entry.out, entry.proven = proof, True
        self._flush(sel, entry)

    def _flush(self, sel: selectors.BaseSelector, entry: _Pending) -> None:
        """Send what ``entry`` still owes; hand it over once proven and all sent."""
        try:
            sent = entry.sock.send(entry.out) if entry.out else 0
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._drop(sel, entry.sock)
            return
        entry.out = entry.out[sent:]
        if entry.out:
            sel.modify(entry.sock, selectors.EVENT_WRITE, entry)
            return
        if entry.proven:
            self._hand_over(sel, entry.sock)
        else:
            sel.modify(entry.sock, selectors.EVENT_READ, entry)

    def _refuse(self, sel: selectors.BaseSelector, entry: _Pending) -> None:
        if entry.got.startswith(_wire.MAGIC):  # a tandem peer with another secret: say so
            try:
                entry.sock.send(_wire.REFUSED)
            except OSError:
                pass
        self._drop(sel, entry.sock)

    def _hand_over(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        sel.unregister(sock)
        del self._pending[sock]
        sock.setblocking(True)
        if self._inline:
            try:
                self._admit(sock)
            except Exception:  # noqa: BLE001 - one bad peer must not stop the gate
                sock.close()
            return
        threading.Thread(target=self._admit_or_close, args=(sock,), daemon=True,
                         name=f"{self._name}-peer").start()

    def _admit_or_close(self, sock: socket.socket) -> None:
        try:
            self._admit(sock)
        except BaseException:
            sock.close()
            raise

    def _drop(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        try:
            sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def pending(self) -> int:
        """How many connections are in the handshake now (for tests and diagnostics)."""
        return len(self._pending)
