"""Distributed autograd contexts: what each worker records while RPCs run inside one.

A context (id: the creating worker's rank in the top 16 bits, a counter below) exists
on every worker an RPC of it reached. It records, per message that carried tensors
requiring grad:

* on the sender, a *send point*: the tensors as they were sent (with their history),
  under the message's autograd id; gradients for them come back later (``_engine``);
* on the receiver, the received tensors, which arrive as fresh leaves that require
  grad; their gradients go back to the sender's send point.

It also accumulates the gradients of every other leaf its backward passes reach
(``get_gradients``), and remembers which workers it exchanged messages with, so that
releasing it (the ``with`` block's end) reaches every worker that took part.

The RPC codec calls :meth:`Contexts.record_send` and :meth:`Contexts.record_recv`; the
current context of a thread is thread-local, as in torch.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Callable

import torch

from tandem.errors import ArgumentError, StateError

__all__ = ["Context", "Contexts"]

_RELEASED_KEPT = 4096  # recently released ids: a late message must not revive its context


class _Current(threading.local):
    id: int = 0


_current = _Current()


class Context:
    """One distributed autograd context on one worker."""

    def __init__(self, context_id: int) -> None:
        self.id = context_id
        self.lock = threading.Lock()
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.sends: dict[int, list[torch.Tensor]] = {}
        # id(received tensor) -> (tensor, sender, autograd message id, index in the message)
        self.recvs: dict[int, tuple[torch.Tensor, int, int, int]] = {}
        self.recv_sizes: dict[tuple[int, int], int] = {}
        self.peers: set[int] = set()

    def accumulate(self, leaf: torch.Tensor, grad: torch.Tensor) -> None:
        if grad._base is not None:  # e.g. a view into a DDP bucket: keep our own copy
            grad = grad.clone()
        with self.lock:
            old = self.grads.get(leaf)
            self.grads[leaf] = grad if old is None else old + grad

    def recv_of(self, leaf: torch.Tensor) -> tuple[int, int, int] | None:
        """(sender, message id, index) if ``leaf`` arrived in a message of this context."""
        found = self.recvs.get(id(leaf))
        if found is None or found[0] is not leaf:
            return None
        return found[1], found[2], found[3]


class Contexts:
    """Every live context of one worker, by id."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._live: dict[int, Context] = {}
        self._released: collections.deque[int] = collections.deque(maxlen=_RELEASED_KEPT)
        self._ids = itertools.count(1)
        self._msgs = itertools.count(1)

    # -- the current context of this thread ---------------------------------------------
    @staticmethod
    def current_id() -> int:
        return _current.id

    def enter(self, context_id: int) -> int:
        """Make ``context_id`` this thread's context (0: none); returns what to restore."""
        previous = _current.id
        if context_id:
            self.get(context_id, create=True)
        _current.id = context_id
        return previous

    @staticmethod
    def leave(previous: int) -> None:
        _current.id = previous

    # -- lifetime --------------------------------------------------------------------
    def create(self) -> Context:
        if _current.id:
            raise StateError(f"this thread is already inside distributed autograd context "
                             f"{_current.id}; contexts do not nest")
        ctx = Context((self.rank << 48) | next(self._ids))
        with self._lock:
            self._live[ctx.id] = ctx
        return ctx

    def get(self, context_id: int, create: bool = False) -> Context | None:
        with self._lock:
            ctx = self._live.get(context_id)
            if ctx is None and create and context_id not in self._released:
                ctx = self._live[context_id] = Context(context_id)
            return ctx

    def require(self, context_id: int, what: str) -> Context:
        if not isinstance(context_id, int) or isinstance(context_id, bool):
            raise ArgumentError(f"{what}: context_id must be an int, got {context_id!r}")
        ctx = self.get(context_id)
        if ctx is None:
            raise ArgumentError(f"{what}: there is no distributed autograd context "
                                f"{context_id} on worker {self.rank} (never created here, or "
                                f"already released)")
        return ctx

    def release(self, context_id: int, notify: Callable[[int, tuple[int | str, ...]], None],
                skip: int = -1) -> None:
        """Drop the context here and tell every worker it exchanged messages with."""
        with self._lock:
            ctx = self._live.pop(context_id, None)
            self._released.append(context_id)
        if ctx is None:
            return
        for peer in sorted(ctx.peers - {self.rank, skip}):
            notify(peer, ("release", context_id))

    def released(self, context_id: int, src: int,
                 notify: Callable[[int, tuple[int | str, ...]], None]) -> None:
        """A ``release`` note from ``src``: pass it on to our own peers."""
        self.release(context_id, notify, skip=src)

    def live(self) -> list[int]:
        with self._lock:
            return sorted(self._live)

    # -- recording (called by the RPC codec) ----------------------------------------------
    def record_send(self, context_id: int, dest: int, tensors: list[torch.Tensor]) -> int:
        ctx = self.get(context_id, create=True)
        if ctx is None:
            return 0
        msg = next(self._msgs) if tensors else 0
        with ctx.lock:
            ctx.peers.add(dest)
            if tensors:
                ctx.sends[msg] = tensors
        return msg

    def record_recv(self, context_id: int, src: int, msg: int,
                    tensors: list[torch.Tensor]) -> None:
        ctx = self.get(context_id, create=True)
        if ctx is None:
            return
        with ctx.lock:
            ctx.peers.add(src)
            if msg and tensors:
                ctx.recv_sizes[(src, msg)] = len(tensors)
                for i, t in enumerate(tensors):
                    ctx.recvs[id(t)] = (t, src, msg, i)
