"""Serving calls: run each on the server pool and reply, or keep its value in an RRef.

The thread that read the call has unpickled it (``Agent.decode``) and hands it to
:meth:`Server.on_call`: an idle pool thread that read it itself runs it (no hand-off;
see ``ServerPool._linger``), otherwise a pool thread runs the function inside the caller's distributed
autograd context, if any, and writes the reply itself. An ``async_execution`` function
returns a Future at once and frees its thread; the reply goes out from whichever thread
completes that Future. A REMOTE keeps its value in the owner's RRef entry (registered
by the reader, in arrival order, with the creator's fork) and replies with an ack, or
with the error, which the entry also keeps for later uses of the RRef.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import torch

from tandem.autograd._context import Contexts
from tandem.errors import StateError, TandemError
from tandem.rpc import _codec
from tandem.rpc._calls import describe, remote_error_fields
from tandem.rpc._codec import ERROR, REPLY
from tandem.rpc._pool import Job, ServerPool, poll_as_reader, role
from tandem.rpc._rrefs import RRefTable
from tandem.rpc.functions import ASYNC_ATTR
from tandem.transport.base import Poller

__all__ = ["Server"]

MAX_EXTRA_THREADS = 128  # threads beyond num_worker_threads, for calls blocked in nested RPCs
MAX_QUEUED = 1 << 16  # calls waiting for a server thread before the reader stops reading



class _Agent(Protocol):
    """What serving needs of its agent (:class:`~tandem.rpc._agent.Agent`)."""

    rank: int
    spin: float
    pollers: dict[int, Poller]
    rrefs: RRefTable
    autograd: Contexts

    def label(self, rank: int) -> str: ...

    def decode(self, src: int, incoming: _codec.Incoming) -> Any: ...

    def encode(self, obj: Any, dest: int, what: str, ctx: int = 0) -> _codec.Outgoing: ...

    def send(self, dest: int, msg: int, seq: int, out: _codec.Outgoing,
             wait: bool = False) -> None: ...

    def handled_one(self) -> None: ...

class Server:
    """The serving half of one worker's agent."""

    def __init__(self, agent: _Agent, threads: int) -> None:
        self.agent = agent
        self.pool = ServerPool(threads, f"tandem-rpc-{agent.rank}", threads + MAX_EXTRA_THREADS,
                               MAX_QUEUED, agent.spin)
        if agent.pollers:
            self.pool.intake = self

    # -- idle pool threads read calls themselves (leader/follower) ----------------------
    def watch(self, on: bool) -> None:
        for poller in self.agent.pollers.values():
            poller.watch(on)

    def take(self) -> tuple[bool, Job | None]:
        """On a lingering pool thread: read one frame from any peer; whether one was
        read, and the call in it if it was one, for this thread to run."""
        taken: list[Job] = []
        role.take = taken
        try:
            for poller in self.agent.pollers.values():
                if poll_as_reader(poller):
                    return True, taken[0] if taken else None
            return False, None
        finally:
            role.take = None

    def on_call(self, src: int, call_id: int, incoming: _codec.Incoming, remote: bool) -> None:
        """On the reader thread: register a REMOTE's entry, unpickle, queue for the pool."""
        entry = self.agent.rrefs.owner_entry((src, call_id), src) if remote else None
        try:
            func, args, kwargs = self.agent.decode(src, incoming)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.finish(src, call_id, 0, entry, None, exc)
            return
        job = functools.partial(self._execute, src, call_id, func, args, kwargs,
                                incoming.ctx_id, entry)
        taken = role.take
        if taken is not None and not taken:
            taken.append(job)  # read by an idle pool thread: it runs the call itself
        else:
            self.pool.submit(job)

    def _execute(self, src: int, call_id: int, func: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any] | None, ctx: int, entry: Any) -> None:
        token = self.agent.autograd.enter(ctx)
        try:
            out = func(*args, **kwargs) if kwargs else func(*args)
            if getattr(func, ASYNC_ATTR, False):
                if not isinstance(out, torch._C.Future):
                    raise StateError(f"{describe(func)} is marked async_execution but returned "
                                     f"{type(out).__name__}, not a torch.futures.Future")
                out.add_done_callback(functools.partial(self._settled, src, call_id, ctx, entry))
                return
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.finish(src, call_id, ctx, entry, None, exc)
            return
        finally:
            self.agent.autograd.leave(token)
        self.finish(src, call_id, ctx, entry, out, None)

    def _settled(self, src: int, call_id: int, ctx: int, entry: Any,
                 fut: torch.futures.Future[Any]) -> None:
        try:
            value = fut.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            self.finish(src, call_id, ctx, entry, None, exc)
            return
        self.finish(src, call_id, ctx, entry, value, None)

    def finish(self, src: int, call_id: int, ctx: int, entry: Any, value: Any,
               error: BaseException | None) -> None:
        """Reply to call ``call_id`` of ``src`` (a REMOTE's value stays in its RRef)."""
        if entry is not None:
            entry.settle(value, error)
            value = None
        try:
            msg = REPLY
            if error is None:
                try:
                    out = self.agent.encode(value, src, "the result", ctx)
                except BaseException as exc:  # noqa: BLE001 - the caller gets it instead
                    error = exc
            if error is not None:
                here = self.agent.label(self.agent.rank)
                out = _codec.encode(remote_error_fields(error, here), "an error")
                msg = ERROR
            self.agent.send(src, msg, call_id, out)
        except TandemError:
            pass  # the caller is gone: nobody to tell
        finally:
            self.agent.handled_one()
