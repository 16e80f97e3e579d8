"""The RRef protocol: who holds a reference to which value, and when the owner may free it.

The owner keeps each value while any other worker holds a *fork* of its RRef. Forks are
counted per RRef in :attr:`RRefTable.owned` (fork id -> the worker holding it); the
entry leaves the table when its last fork is deleted. Three ways a fork comes to be:

* ``remote()``: the creator's fork (its id is the RRef's id) is registered when the
  owner reads the REMOTE message, before any later message of the creator (streams are
  FIFO), so the creator may delete it at any time;
* the owner sends its RRef: it registers the new fork itself before sending;
* a user sends its RRef to a third worker: the sender keeps its own RRef alive as a
  *pending child* until the owner has registered the new fork; the receiver asks the
  owner (``fork`` note), and the owner confirms to both (``forked`` to the receiver,
  ``accepted`` to the sender). An unconfirmed RRef is kept alive the same way, so its
  delete can never reach the owner before its registration. That is why passing an
  RRef A -> B -> C while A drops its own never frees the value early.

Deleting: ``RRef.__del__`` only appends to :attr:`RRefTable.deletes` (it may run inside
any lock of any thread); the monitor thread sends them, batched per owner. A worker
that is lost takes its forks, pending children and unconfirmed RRefs with it.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable, Protocol, Sequence

from tandem.errors import RpcTimeoutError
from tandem.rpc._calls import wait_flag
from tandem.transport.message import Flag

__all__ = ["Entry", "RRefTable", "RRefId"]

RRefId = tuple[int, int]  # (worker that made it, a number unique on that worker)
_READY = threading.Lock()  # orders Entry.settle against Entry.when_ready (held briefly)



class _Agent(Protocol):
    """What the table needs of its agent (:class:`~tandem.rpc._agent.Agent`)."""

    rank: int

    def new_id(self) -> int: ...

    def notify(self, dest: int, note: tuple[Any, ...]) -> None: ...

class Entry:
    """The owner's record of one RRef value (pending until ``settle``)."""

    __slots__ = ("id", "flag", "value", "error", "forks", "_waiting", "__weakref__")

    def __init__(self, rref_id: RRefId) -> None:
        self.id = rref_id
        self.flag = Flag()
        self.value: Any = None
        self.error: BaseException | None = None
        self.forks: dict[RRefId, int] = {}  # fork id -> the worker holding it
        self._waiting: list[Callable[[Entry], None]] = []

    def settle(self, value: Any, error: BaseException | None) -> None:
        with _READY:
            self.value, self.error = value, error
            self.flag.set()
            waiting, self._waiting = self._waiting, []
        for cb in waiting:
            cb(self)

    def when_ready(self, cb: Callable[["Entry"], None]) -> None:
        """Call ``cb(entry)`` once the value is set: here if it is, else in ``settle``."""
        with _READY:
            if not self.flag.is_set():
                self._waiting.append(cb)
                return
        cb(self)

    def get(self, deadline: float | None, what: str) -> Any:
        if not wait_flag(self.flag, deadline, what):
            raise RpcTimeoutError(f"{what}: the value of RRef {self.id} was not ready in time")
        if self.error is not None:
            raise self.error
        return self.value


class RRefTable:
    """One worker's RRef bookkeeping, as owner and as user (see the module docstring)."""

    def __init__(self, agent: _Agent) -> None:
        self.agent = agent
        self.me = agent.rank
        self._lock = threading.Lock()
        self.owned: dict[RRefId, Entry] = {}
        self.entries: weakref.WeakValueDictionary[RRefId, Entry] = weakref.WeakValueDictionary()
        self.children: dict[RRefId, tuple[Any, int]] = {}  # fork sent -> (our RRef, receiver)
        self.unconfirmed: dict[RRefId, Any] = {}  # fork received -> the RRef, kept alive
        self.deletes: collections.deque[tuple[int, RRefId, RRefId]] = collections.deque()
        self.wake: Callable[[], None] = lambda: None  # set by the monitor

    # -- owner side ----------------------------------------------------------------------
    def new_entry(self) -> Entry:
        entry = Entry((self.me, self.agent.new_id()))
        self.entries[entry.id] = entry
        return entry

    def _find(self, rref_id: RRefId) -> Entry:  # caller holds the lock
        entry = self.owned.get(rref_id) or self.entries.get(rref_id)
        if entry is None:  # a fork was announced before the REMOTE that makes the value
            entry = Entry(rref_id)
            self.entries[rref_id] = entry
        return entry

    def owner_entry(self, rref_id: RRefId, holder: int) -> Entry:
        """The entry ``rref_id`` of a REMOTE from ``holder``, with the creator's fork (a
        REMOTE to oneself has none: the creator holds the owner's RRef)."""
        with self._lock:
            entry = self._find(rref_id)
            if holder != self.me:
                entry.forks[rref_id] = holder
                self.owned[rref_id] = entry
            return entry

    def local_entry(self, rref_id: RRefId) -> Entry:
        """An entry for a REMOTE this worker is about to send to itself."""
        with self._lock:
            return self._find(rref_id)

    def _add_fork(self, entry: Entry, fork: RRefId, holder: int) -> None:
        with self._lock:
            entry.forks[fork] = holder
            self.owned[entry.id] = entry

    def _drop_fork(self, rref_id: RRefId, fork: RRefId) -> None:  # caller holds the lock
        entry = self.owned.get(rref_id)
        if entry is not None:
            entry.forks.pop(fork, None)
            if not entry.forks:
                del self.owned[rref_id]

    # -- sending RRefs (called while a message is pickled, then committed or undone) ----
    def fork(self, dest: int, rref: Any) -> tuple[Any, ...]:
        """The wire fields for ``rref`` sent to ``dest``: (owner, id, fork id, parent)."""
        if rref._agent is not self.agent:
            raise ValueError("this RRef belongs to an RPC session that was shut down")
        if dest == rref._owner:
            return rref._owner, rref._id, None, self.me
        return rref._owner, rref._id, (self.me, self.agent.new_id()), self.me

    def commit(self, dest: int, sent: Sequence[tuple[Any, Any]]) -> None:
        for rref, fork in sent:
            if fork is None:
                continue
            if rref._entry is not None:
                self._add_fork(rref._entry, fork, dest)
            else:
                self.children[fork] = (rref, dest)

    def undo(self, dest: int, sent: Sequence[tuple[Any, Any]]) -> None:
        for rref, fork in sent:
            if fork is None:
                continue
            if rref._entry is not None:
                with self._lock:
                    self._drop_fork(rref._id, fork)
            else:
                self.children.pop(fork, None)

    # -- receiving RRefs ---------------------------------------------------------------
    def build(self, src: int, owner: int, rref_id: RRefId, fork: RRefId | None,
              parent: int) -> Any:
        from tandem.rpc.rref import RRef  # lazy: the public class builds on this module

        agent: Any = self.agent  # the whole Agent, which an RRef uses as its owner's API
        if owner == self.me:
            with self._lock:
                entry = self._find(tuple(rref_id))  # type: ignore[arg-type]
            return RRef._owned(agent, entry)
        assert fork is not None
        rref = RRef._user(agent, owner, (rref_id[0], rref_id[1]), (fork[0], fork[1]),
                          confirmed=parent == owner)
        if parent != owner:
            self.unconfirmed[(fork[0], fork[1])] = rref
            self.agent.notify(owner, ("fork", rref._id, rref._fork, parent))
        return rref

    def on_note(self, src: int, note: tuple[Any, ...]) -> None:
        kind = note[0]
        if kind == "delete":
            with self._lock:
                for rref_id, fork in note[1]:
                    self._drop_fork(tuple(rref_id), tuple(fork))
        elif kind == "fork":
            _, rref_id, fork, parent = note
            with self._lock:
                entry = self._find(tuple(rref_id))
            self._add_fork(entry, tuple(fork), src)
            self.agent.notify(src, ("forked", fork))
            self.agent.notify(parent, ("accepted", fork))
        elif kind == "forked":
            rref = self.unconfirmed.pop(tuple(note[1]), None)
            if rref is not None:
                rref._confirmed = True
        elif kind == "accepted":
            self.children.pop(tuple(note[1]), None)
        else:
            raise ValueError(f"unknown RRef note {kind!r} from worker {src}")

    # -- deleting ------------------------------------------------------------------------
    def release(self, owner: int, rref_id: RRefId, fork: RRefId) -> None:
        """A user RRef was garbage-collected (called from ``__del__``: never blocks)."""
        self.deletes.append((owner, rref_id, fork))
        self.wake()

    def flush(self) -> int:
        """Send the deletes queued so far, one note per owner; return how many."""
        batches: dict[int, list[tuple[RRefId, RRefId]]] = {}
        n = 0
        while self.deletes:
            owner, rref_id, fork = self.deletes.popleft()
            batches.setdefault(owner, []).append((rref_id, fork))
            n += 1
        for owner, items in batches.items():
            if owner == self.me:
                with self._lock:
                    for rref_id, fork in items:
                        self._drop_fork(rref_id, fork)
            else:
                self.agent.notify(owner, ("delete", items))
        return n

    def peer_lost(self, rank: int) -> None:
        """Forget every fork held by ``rank``, and what waits on it."""
        with self._lock:
            for rref_id, entry in list(self.owned.items()):
                for fork, holder in list(entry.forks.items()):
                    if holder == rank:
                        self._drop_fork(rref_id, fork)
        for fork, (_, dest) in list(self.children.items()):
            if dest == rank:
                self.children.pop(fork, None)
        for fork, rref in list(self.unconfirmed.items()):
            if rref._owner == rank:
                self.unconfirmed.pop(fork, None)

    def stats(self) -> dict[str, int]:
        return {"owner_rrefs": len(self.owned), "pending_children": len(self.children),
                "unconfirmed_forks": len(self.unconfirmed), "queued_deletes": len(self.deletes)}
