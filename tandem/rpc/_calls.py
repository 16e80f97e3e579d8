"""Outstanding calls: their records, how callers wait for them, and how they fail.

A call's record (a :class:`Call` for ``rpc_sync``, the :class:`RpcFuture` itself for
``rpc_async`` and ``remote``) is completed exactly once, by whoever removes it from the
agent's table first: the reply (on a transport reader thread), the deadline (the
caller, or the monitor for futures), or the loss of its worker (the monitor).

Remote exceptions come back as the same class when it can be rebuilt from a message
(``ValueError``, ``KeyError``, tandem's errors...), otherwise as ``RpcError``; either
way the message starts with the worker's name and ends with the remote traceback.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import torch

from tandem._words import secs
from tandem.errors import RpcError, RpcTimeoutError, StateError
from tandem.rpc._pool import poll_as_reader, role
from tandem.transport.base import Poller
from tandem.transport.message import Flag

__all__ = ["Call", "RpcFuture", "Pending", "wait_flag", "remote_error_fields",
           "rebuild_error", "timeout_error", "describe"]


def describe(func: Any) -> str:
    """How errors name a called function: ``module.qualname``."""
    module = getattr(func, "__module__", None) or "?"
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return f"{module}.{name}"


def _refuse_on_reader(what: str) -> None:
    if role.reader:
        raise StateError(
            f"{what} was called on tandem's RPC receive thread (from a Future callback of "
            f"an RPC, or an async_execution function's callback); waiting there would stop "
            f"the replies it waits for; chain with fut.then(...) or use rpc_async")


def wait_flag(flag: Flag, deadline: float | None, what: str, spin: float = 0.0,
              poller: Poller | None = None) -> bool:
    """Wait for ``flag`` until ``deadline`` (monotonic; None: no deadline); True if set.

    Polls for ``spin`` seconds first (a reply often comes sooner than a sleeping thread
    wakes), reading the frames of ``poller`` (the peer that will reply) meanwhile, so the
    reply needs no hand-off from the reader thread; then sleeps; a server-pool thread is
    marked as blocked meanwhile so that nested calls get a thread of their own.
    """
    if flag.is_set():
        return True
    _refuse_on_reader(what)
    if _spin(flag.is_set, spin, poller):
        return True
    pool = role.pool
    if pool is None:
        return _sleep(flag, deadline)
    with pool.blocked():
        return _sleep(flag, deadline)


def _sleep(flag: Flag, deadline: float | None) -> bool:
    while True:
        left = 1.0 if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return flag.is_set()
        if flag.wait(min(left, 1.0)):
            return True


def _spin(done: Callable[[], bool], spin: float, poller: Poller | None) -> bool:
    """Poll ``done()`` for ``spin`` seconds, reading ``poller``'s frames meanwhile."""
    end = time.perf_counter() + spin
    if poller is None:
        while time.perf_counter() < end:
            os.sched_yield()
            if done():
                return True
        return False
    poller.watch(True)
    try:
        while time.perf_counter() < end:
            if not poll_as_reader(poller):
                os.sched_yield()
            if done():
                return True
        return False
    finally:
        poller.watch(False)


def _window(timeout: float) -> tuple[float, float]:
    started = time.monotonic()
    return started, started + timeout if timeout > 0 else float("inf")


class Call:
    """One outstanding ``rpc_sync`` (or ``to_here``) to worker ``dest``; the caller waits
    on ``flag``. ``what`` (for errors) is built only when needed."""

    __slots__ = ("dest", "kind", "func", "timeout", "spin", "started", "deadline", "flag",
                 "value", "error")

    def __init__(self, dest: int, kind: str, func: Any, timeout: float, spin: float = 0.0
                 ) -> None:
        self.dest, self.kind, self.func, self.timeout = dest, kind, func, timeout
        self.spin = spin  # seconds the caller polls for the reply before sleeping
        self.started, self.deadline = _window(timeout)
        self.flag = Flag()
        self.value: Any = None
        self.error: BaseException | None = None

    @property
    def what(self) -> str:
        return f"{self.kind}({describe(self.func)})"

    def complete(self, value: Any, error: BaseException | None) -> None:
        """Record the outcome and wake the caller (called once)."""
        self.value, self.error = value, error
        self.flag.set()

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class RpcFuture(torch.futures.Future):
    """What ``rpc_async`` and ``remote`` return: a ``torch.futures.Future`` that is also
    the call's record (one object per call). ``wait`` polls briefly, and inside a served
    function it does not starve the server pool."""

    def __init__(self, dest: int, kind: str, func: Any, timeout: float, spin: float,
                 poller: Poller | None = None) -> None:
        torch._C.Future.__init__(self, [])
        self.dest, self.kind, self.func, self.timeout, self.spin = dest, kind, func, timeout, spin
        self._poller = poller
        self.started, self.deadline = _window(timeout)
        self.error: BaseException | None = None

    @property
    def what(self) -> str:
        return f"{self.kind}({describe(self.func)})"

    def complete(self, value: Any, error: BaseException | None) -> None:
        self.error = error
        if error is None:
            self.set_result(value)
        else:
            self.set_exception(error)

    def wait(self) -> Any:
        if not self.done():
            _refuse_on_reader("Future.wait()")
            _spin(self.done, self.spin, self._poller)
            pool = role.pool
            if not self.done() and pool is not None:
                with pool.blocked():  # the deadline is the monitor's: it fails the future
                    return super().wait()
        return super().wait()


Pending = Call | RpcFuture


def timeout_error(call: Pending, worker: str) -> RpcTimeoutError:
    waited = time.monotonic() - call.started
    return RpcTimeoutError(f"{call.what} on worker {worker} timed out: no reply after "
                           f"{waited:.3g} s (timeout {secs(call.timeout)} s)")


def remote_error_fields(exc: BaseException, worker: str) -> tuple[str, str, str, str]:
    """What crosses the wire for an exception raised by a served call."""
    cls = type(exc)
    text = "".join(traceback.format_exception(cls, exc, exc.__traceback__))
    return cls.__module__, cls.__qualname__, str(exc), f"On worker {worker}:\n{text}"


def rebuild_error(module: str, qualname: str, message: str, remote: str) -> BaseException:
    """The caller's copy of a remote exception: the same class when it takes a message."""
    cls: Any = None
    try:
        obj: Any = __import__(module, fromlist=["_"])
        for part in qualname.split("."):
            obj = getattr(obj, part)
        cls = obj
    except Exception:  # noqa: BLE001 - class not importable here: fall back to RpcError
        cls = None
    text = remote.rstrip()
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            error = cls(text)
            if error.args == (text,):  # the class kept the message as given
                return error
        except Exception:  # noqa: BLE001 - constructor wants other arguments
            pass
    return RpcError(f"{module}.{qualname}: {message}\n{text}")
