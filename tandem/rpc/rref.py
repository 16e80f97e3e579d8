"""``RRef``: a reference to a value that lives on one worker (its owner).

    rref = tandem.rpc.remote("ps", make_table, args=(1000, 16))   # runs on "ps", returns now
    rows = rref.rpc_sync().lookup(ids)       # a method of the value, run on its owner
    value = rref.to_here()                   # a copy of the value, here
    mine = tandem.rpc.RRef(torch.zeros(3))   # this worker owns it; pass it to others

RRefs travel as arguments and results of any call, between any workers; the owner
keeps the value while any worker holds one (``_rrefs`` describes the protocol) and frees
it when the last is deleted. Pickling an RRef outside RPC is refused.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from tandem.config import flag_argument
from tandem.errors import ArgumentError, StateError
from tandem.rpc import _internal, _state
from tandem.rpc.worker import WorkerInfo

if TYPE_CHECKING:
    from tandem.rpc._agent import Agent
    from tandem.rpc._calls import RpcFuture
    from tandem.rpc._rrefs import Entry, RRefId

__all__ = ["RRef"]

T = TypeVar("T")


class RRef(Generic[T]):
    """A remote reference; ``RRef(value)`` makes one owned by this worker."""

    _tandem_rref = True  # the RPC codec sends instances through the fork protocol
    __slots__ = ("_agent", "_owner", "_id", "_fork", "_entry", "_confirmed", "_creation",
                 "_type_hint", "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        agent = _state.require("RRef()")
        entry = agent.rrefs.new_entry()
        entry.settle(value, None)
        self._setup(agent, agent.rank, entry.id, None, entry, True)
        self._type_hint = type_hint

    def _setup(self, agent: "Agent", owner: int, rref_id: "RRefId", fork: "RRefId | None",
               entry: "Entry | None", confirmed: bool) -> None:
        self._agent = agent
        self._owner = owner
        self._id = rref_id
        self._fork = fork
        self._entry = entry
        self._confirmed = confirmed
        self._creation: RpcFuture | None = None
        self._type_hint = None

    @classmethod
    def _owned(cls, agent: "Agent", entry: "Entry") -> "RRef[Any]":
        rref: RRef[Any] = object.__new__(cls)
        rref._setup(agent, agent.rank, entry.id, None, entry, True)
        return rref

    @classmethod
    def _user(cls, agent: "Agent", owner: int, rref_id: "RRefId", fork: "RRefId",
              confirmed: bool) -> "RRef[Any]":
        rref: RRef[Any] = object.__new__(cls)
        rref._setup(agent, owner, rref_id, fork, None, confirmed)
        return rref

    # -- identity ----------------------------------------------------------------------
    def is_owner(self) -> bool:
        return self._entry is not None

    def owner(self) -> WorkerInfo:
        return self._agent.workers.infos[self._owner]

    def owner_name(self) -> str:
        return self._agent.workers.name(self._owner)

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has registered this reference (always, for the owner)."""
        if self._entry is not None:
            return True
        if self._creation is not None:
            return self._creation.done() and self._creation.error is None
        return bool(self._confirmed)

    def __repr__(self) -> str:
        where = "OwnerRRef" if self._entry is not None else "UserRRef"
        return f"{where}(owner={self.owner_name()}, id={self._id}, fork={self._fork})"

    # -- values ------------------------------------------------------------------------
    def _deadline(self, timeout: float) -> float | None:
        seconds = self._agent.timeout_of(timeout)
        return time.monotonic() + seconds if seconds > 0 else None

    def local_value(self) -> T:
        """The value itself; only on the owner (waits while it is still being computed)."""
        if self._entry is None:
            raise StateError(f"local_value() was called on worker {self._agent.rank}, but RRef "
                             f"{self._id} is owned by worker {self.owner_name()!r}; use "
                             f"to_here() for a copy")
        value: T = self._entry.get(self._deadline(-1.0), "RRef.local_value()")
        return value

    def to_here(self, timeout: float = -1.0) -> T:
        """The value: a copy fetched from the owner, or the value itself on the owner."""
        self._agent.check_open("RRef.to_here")
        creation = self._creation
        if creation is not None and not creation.done() and creation.deadline <= time.monotonic():
            # past its deadline: fail it now, as the agent's watch thread would at its next
            # look, so this use reports the creation's timeout even when that thread has
            # not run since (a busy machine)
            self._agent.expire_overdue()
        if creation is not None and creation.done() and creation.error is not None:
            raise creation.error
        if self._entry is not None:
            value: T = self._entry.get(self._deadline(timeout), "RRef.to_here()")
            return value
        call_id, call = self._agent.start(self._owner, _internal.rref_value, (self,), None,
                                          timeout, future=False, kind="to_here")
        result: T = self._agent.wait(call_id, call)
        return result

    def _get_future(self) -> torch.futures.Future[Any]:
        """The future of this RRef's creation by ``remote()`` (completed for others)."""
        if self._creation is not None:
            return self._creation
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(None)
        return fut

    # -- proxies -----------------------------------------------------------------------
    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``value.method(*args)`` on the owner."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """Like :meth:`rpc_sync`, returning a Future."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """Like :meth:`rpc_sync`, keeping the result on the owner in a new RRef."""
        return _Proxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Backward from this RRef's value (a scalar tensor): in distributed autograd
        context ``dist_autograd_ctx_id``, or locally on the owner when it is -1."""
        # "no" failed inside torch's autograd (on the owner, for a remote one)
        retain_graph = flag_argument("RRef.backward: retain_graph", retain_graph)
        if dist_autograd_ctx_id == -1:
            if self._entry is None:
                raise StateError("RRef.backward() without a context runs local autograd, which "
                                 "only the owner can do; pass dist_autograd_ctx_id")
            value = self.local_value()
            if not isinstance(value, torch.Tensor):
                raise ArgumentError(f"RRef.backward() needs a tensor value, got "
                                    f"{type(value).__name__}")
            value.backward(retain_graph=retain_graph)
            return
        from tandem.rpc.api import rpc_sync  # lazy: the API hands out RRefs, built on this class

        rpc_sync(self._owner, _internal.rref_backward, (self, dist_autograd_ctx_id, retain_graph))

    # -- lifetime ----------------------------------------------------------------------
    def __reduce__(self) -> Any:
        raise StateError("an RRef can only travel as an argument or result of tandem's RPC "
                         "(it is reference-counted with its owner); it cannot be pickled")

    def __del__(self) -> None:
        try:
            fork, agent = self._fork, self._agent
        except AttributeError:  # __init__ failed before the fields were set
            return
        if fork is not None and self._entry is None and not agent.closed:
            agent.rrefs.release(self._owner, self._id, fork)


class _Proxy:
    """``rref.rpc_sync()``: attribute access returns a function calling the owner."""

    __slots__ = ("_rref", "_kind", "_timeout")

    def __init__(self, rref: RRef[Any], kind: str, timeout: float) -> None:
        self._rref = rref
        self._kind = kind
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return functools.partial(_invoke, self._rref, self._kind, self._timeout, name)


def _invoke(rref: RRef[Any], kind: str, timeout: float, name: str, *args: Any,
            **kwargs: Any) -> Any:
    from tandem.rpc import api  # lazy: the API hands out RRefs, built on this class

    call = getattr(api, kind)
    return call(rref._owner, _internal.rref_method, (rref, name, args, kwargs), timeout=timeout)
