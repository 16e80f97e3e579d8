"""The RPC agent: one per worker, between the public API and a transport.

Messages (``Kind.RPC`` frames, see ``_codec``) have a type in the header's ``step``:

    CALL    run a function, reply with its result        seq = call id
    REMOTE  run a function, keep the result in an RRef   seq = call id = the RRef's id
    REPLY   the result of call ``seq``
    ERROR   the exception of call ``seq``
    NOTE    a one-way bookkeeping message (RRef forks and deletes, autograd contexts)

The hot path has no thread hand-off: the caller encodes and writes the frame itself. On
the callee, whichever thread reads the frame (the transport's reader thread, or an idle
pool thread polling the connection) reads it straight into freshly allocated tensors
and unpickles it (so RRef bookkeeping happens in arrival order); a pool thread that
read it runs it itself, otherwise it goes to the server's pool (``_serve``). The pool
thread writes the reply itself. Over shared memory the caller, while it waits, reads
its reply itself (``Transport.poller``); otherwise the reader thread completes the call
and wakes the caller. NOTEs are handled by whoever reads them: short, they never wait.

Messages to this very worker skip the transport but not the codec, so a call to
oneself behaves like any other (arguments are copies; it runs on the pool).
"""

from __future__ import annotations

import functools
import itertools
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from tandem.autograd._context import Contexts
from tandem.config import at_most
from tandem.errors import ArgumentError, PeerLostError, ProtocolError, StateError, TandemError
from tandem.rpc import _codec
from tandem.rpc._codec import CALL, ERROR, NOTE, REMOTE, REPLY
from tandem.rpc._buffers import LARGE, ReceiveBuffers
from tandem.rpc._calls import Call, Pending, RpcFuture, rebuild_error, timeout_error, wait_flag
from tandem.rpc._pool import adopt_thread_settings, role
from tandem.rpc._rrefs import RRefTable
from tandem.rpc._serve import Server
from tandem.rpc.worker import Directory
from tandem.store.base import Store
from tandem.transport.base import Header, Kind, Poller, Reader, Transport
from tandem.transport.shm import default_spin

if TYPE_CHECKING:
    from tandem.rpc._monitor import Monitor

__all__ = ["Agent"]

# A caller that sent a large message polls for the reply while the callee reads it (one
# copy at about this many bytes per second; measured 16 MB in 1.8-2.6 ms between two
# processes on a 2-core VM), at most _MAX_SPIN longer; only where waiters poll at all
# (every worker on the host has a CPU of its own: ``default_spin``).
_READ_RATE = 4e9
_MAX_SPIN = 0.02
_SHORT_SPIN = 50e-6


class _Sender:
    """Names a message's sender in codec errors; formatted only if one is raised."""

    __slots__ = ("workers", "rank")

    def __init__(self, workers: Directory, rank: int) -> None:
        self.workers, self.rank = workers, rank

    def __str__(self) -> str:
        return f"worker {self.workers.label(self.rank)}"


def _value(counter: "itertools.count[int]") -> int:
    """The next value of ``counter`` without taking it (its repr is ``count(n)``)."""
    return int(repr(counter)[6:-1])


def _spin(transport: Transport, world: int) -> float:
    """How long waiters poll before sleeping: the transport's own policy (long only when
    every worker on this host has a CPU of its own)."""
    me = transport.host_of(transport.rank)
    local = sum(1 for r in range(world) if transport.host_of(r) == me)
    return default_spin(max(1, local))


class Agent:
    """Everything one worker's RPC needs; built by ``init_rpc``, closed by ``shutdown``."""

    def __init__(self, transport: Transport, workers: Directory, store: Store, timeout: float,
                 threads: int) -> None:
        self.rank = transport.rank
        self.transport = transport
        self.workers = workers
        self.store = store  # this RPC session's namespace of the rendezvous store
        self.base_store: Store | None = None  # closed at shutdown when init_rpc made it
        self.monitor: Monitor | None = None
        self.timeout = timeout
        self.spin = _spin(transport, len(workers))
        # peers whose frames a waiting thread may read itself (shared memory)
        self.pollers: dict[int, Poller] = {}
        for r in range(len(workers)):
            poller = transport.poller(r) if r != self.rank else None
            if poller is not None:
                self.pollers[r] = poller
        self.server = Server(self, threads)
        self.pool = self.server.pool
        self.pending: dict[int, Pending] = {}
        self.next_deadline = float("inf")  # no async call expires before this (monitor)
        self.deadline_lock = threading.Lock()  # orders lowering next_deadline with scans
        self._ids = itertools.count(1)
        # messages sent, and messages fully handled (shutdown compares the sums); next() on
        # a count is atomic, so the hot path takes no lock for them
        self._sent = itertools.count()
        self._handled = itertools.count()
        self.closed = False
        self.rrefs: RRefTable = RRefTable(self)
        self.autograd = Contexts(self.rank)
        self.buffers = ReceiveBuffers()  # large received tensors' memory, recycled
        # per peer, made once: each message would otherwise build its own (~0.4 us each)
        self._forks = [functools.partial(self.rrefs.fork, r) for r in range(len(workers))]
        self._senders = [_Sender(workers, r) for r in range(len(workers))]
        transport.handle(Kind.RPC, self._on_message)

    # -- identity --------------------------------------------------------------------
    def new_id(self) -> int:
        return next(self._ids)

    def label(self, rank: int) -> str:
        return self.workers.label(rank)

    def check_open(self, what: str) -> None:
        if self.closed:
            raise StateError(f"{what}: RPC was shut down on this worker")

    def expire_overdue(self) -> None:
        """Fail the pending calls past their deadline now, as the watch thread does."""
        if self.monitor is not None:
            self.monitor.expire(time.monotonic())

    # -- calling ---------------------------------------------------------------------
    def timeout_of(self, timeout: float) -> float:
        if timeout is None or timeout == -1.0:
            return self.timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ArgumentError(f"timeout must be seconds >= 0 (0: none, -1: the default "
                                f"rpc_timeout), got {timeout!r}")
        # infinity too: a deadline past this overflows the waits that use it
        return float(at_most("timeout", timeout, threading.TIMEOUT_MAX,
                             "seconds, the longest wait this platform allows",
                             "give 0 for no deadline"))

    def start(self, dest: int, func: Any, args: Any, kwargs: Any, timeout: float,
              future: bool, kind: str = "rpc_async", remote: bool = False,
              call_id: int = 0) -> tuple[int, Pending]:
        """Send one call (``call_id``: one from :meth:`new_id`, or 0 for a new one); return
        its id and its record (an RpcFuture if ``future``), which the reply completes."""
        if self.closed:
            self.check_open(kind)
        if not callable(func):
            raise ArgumentError(f"{kind}: func must be callable, got {func!r}")
        if args is not None and not isinstance(args, (tuple, list)):
            raise ArgumentError(f"{kind}: args must be a tuple (or list) of arguments, got "
                                f"{type(args).__name__}; wrap a single one: args=(x,)")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ArgumentError(f"{kind}: kwargs must be a dict of keyword arguments, got "
                                f"{type(kwargs).__name__}")
        if type(args) is not tuple:
            args = () if args is None else tuple(args)
        if kwargs is not None:
            kwargs = dict(kwargs) or None  # None on the wire: no empty dict on either side
        call_id = call_id or next(self._ids)
        seconds = self.timeout if timeout == -1.0 else self.timeout_of(timeout)
        ctx = self.autograd.current_id()
        record = functools.partial(self.autograd.record_send, ctx, dest) if ctx else None
        out = _codec.encode_call(func, args, kwargs, kind, self._forks[dest], ctx, record)
        spin = self.spin
        if out.nbytes >= LARGE and self.spin > _SHORT_SPIN:
            # the reply cannot come before the callee has read the call: polling that long
            # lets this thread read the reply itself instead of sleeping through its arrival
            spin += min(out.nbytes / _READ_RATE, _MAX_SPIN)
        call: Pending = (RpcFuture(dest, kind, func, seconds, spin, self.pollers.get(dest))
                         if future else Call(dest, kind, func, seconds, spin))
        self.pending[call_id] = call
        if call.deadline < self.next_deadline:
            with self.deadline_lock:
                self.next_deadline = min(self.next_deadline, call.deadline)
        # checked once the call is pending: a departure noticed later fails it (monitor)
        if self.transport.left(dest) is not None or self.transport.lost(dest) is not None:
            self.pending.pop(call_id, None)
            raise self.departed(dest, call.what)
        try:
            self.send(dest, REMOTE if remote else CALL, call_id, out, wait=future)
        except BaseException:
            self.pending.pop(call_id, None)
            raise
        return call_id, call

    def wait(self, call_id: int, call: Pending) -> Any:
        """Wait for a call started with ``future=False``; its result or its error."""
        assert isinstance(call, Call)
        if not wait_flag(call.flag, call.deadline, call.kind, call.spin,
                         self.pollers.get(call.dest)):
            if self.pending.pop(call_id, None) is call:
                call.complete(None, timeout_error(call, self.label(call.dest)))
            else:
                call.flag.wait(1.0)  # the reply won the race: it is being completed
        return call.result()

    def encode(self, obj: Any, dest: int, what: str, ctx: int = 0) -> _codec.Outgoing:
        record = None
        if ctx:
            record = functools.partial(self.autograd.record_send, ctx, dest)
        return _codec.encode(obj, what, self._forks[dest], ctx, record)

    def send(self, dest: int, msg: int, seq: int, out: _codec.Outgoing,
             wait: bool = False) -> None:
        """Write one message. ``wait``: return once the transport took every byte, so the
        caller may modify the tensors it sent (a large message to a busy peer queues)."""
        if out.rrefs:
            self.rrefs.commit(dest, out.rrefs)
        header = Header(Kind.RPC, out.meta_bytes, seq, msg, out.nbytes)
        next(self._sent)
        if dest == self.rank:
            self._receive(dest, header, _codec.local_reader(out.parts))
            return
        try:
            if self.transport.send_now(dest, header, out.parts):
                return
            slot = self.transport.isendv(dest, header, out.parts)
            if wait and not slot.done() and not role.reader:
                deadline = time.monotonic() + (self.timeout or 3600.0)
                wait_flag(slot.event, deadline, "sending")
            if slot.error is not None:
                raise slot.error
        except TandemError as exc:
            if out.rrefs:
                self.rrefs.undo(dest, out.rrefs)
            raise self.lost(dest, exc) from exc

    def departed(self, rank: int, what: str) -> PeerLostError:
        """The error of a call to ``rank`` once it has left or died (no reply will come)."""
        if self.transport.left(rank) is not None:
            why = "the worker left (it called rpc.shutdown()); nothing runs there any more"
        else:
            why = f"the worker is gone ({self.transport.lost(rank)})"
        return PeerLostError(f"{what} on worker {self.label(rank)} failed: {why}", rank)

    def lost(self, rank: int, cause: BaseException) -> PeerLostError:
        return PeerLostError(f"worker {self.label(rank)} is gone: {cause}", rank)

    def notify(self, dest: int, note: tuple[Any, ...]) -> None:
        """Send a NOTE (best effort: a worker that is gone needs no bookkeeping)."""
        try:
            self.send(dest, NOTE, 0, _codec.encode(note, "a note"))
        except TandemError:
            pass

    # -- receiving -------------------------------------------------------------------
    def _on_message(self, src: int, header: Header, read: Reader) -> None:
        if not role.reader:  # the first message on this transport reader thread
            role.reader = True
            adopt_thread_settings()
        self._receive(src, header, read)

    def _receive(self, src: int, header: Header, read: Reader) -> None:
        msg = header.step
        incoming = _codec.read_message(header, read, self._senders[src], self.buffers.empty)
        try:
            if msg == CALL or msg == REMOTE:
                self.server.on_call(src, header.seq, incoming, msg == REMOTE)
            elif msg == REPLY or msg == ERROR:
                self._on_reply(src, header.seq, incoming, msg == ERROR)
            elif msg == NOTE:
                self._on_note(src, incoming)
            else:
                raise ProtocolError(f"worker {self.label(src)} sent RPC message type {msg}")
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - a reader thread must survive any bug
            print(f"[tandem rpc {self.label(self.rank)}] dropped a message from "
                  f"{self.label(src)}: {type(exc).__name__}: {exc}", file=sys.stderr)

    def decode(self, src: int, incoming: _codec.Incoming) -> Any:
        """Unpickle a message of ``src``, recording its autograd receive point if any."""
        if incoming.error is not None:
            raise incoming.error
        if incoming.ctx_id:
            self.autograd.record_recv(incoming.ctx_id, src, incoming.amsg, incoming.grads)
        if not incoming.rrefs:
            return _codec.decode(incoming)
        return _codec.decode(incoming, functools.partial(self.rrefs.build, src))

    def _on_reply(self, src: int, call_id: int, incoming: _codec.Incoming, failed: bool) -> None:
        call = self.pending.pop(call_id, None)
        error: BaseException | None = None
        value: Any = None
        try:
            value = self.decode(src, incoming)  # even if late: RRefs inside must be freed
            if failed:
                value, error = None, rebuild_error(*value)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            error = exc
        try:
            if call is not None:
                call.complete(value, error)
        finally:
            self.handled_one()

    def _on_note(self, src: int, incoming: _codec.Incoming) -> None:
        try:
            note = _codec.decode(incoming)
            if note[0] == "release":
                self.autograd.released(note[1], src, self.notify)
            else:
                self.rrefs.on_note(src, note)
        finally:
            self.handled_one()

    # -- state -------------------------------------------------------------------------
    def handled_one(self) -> None:
        """Count a message as fully handled (a call: once its reply is sent)."""
        next(self._handled)

    def counts(self) -> tuple[int, int]:
        """(messages sent, messages handled) so far."""
        return _value(self._sent), _value(self._handled)

    def fail_pending(self, match: Callable[[Pending], bool],
                     error: Callable[[Pending], BaseException]) -> None:
        """Complete every pending call that ``match``es with ``error(call)``."""
        for call_id, call in list(self.pending.items()):
            if match(call) and self.pending.pop(call_id, None) is call:
                call.complete(None, error(call))
