"""The agent's watch thread: lost workers, expired ``rpc_async`` calls, queued RRef deletes.

Ten times a second (sooner when woken) it:

* sends the RRef deletes that ``RRef.__del__`` queued (``RRefTable.flush``);
* fails every pending call to a worker whose connection the transport saw close, naming
  the worker, so a dead worker fails its callers within a fraction of a second, not at
  their deadline;
* fails ``rpc_async`` calls past their deadline (``rpc_sync`` callers watch their own).
  The agent keeps the soonest pending deadline (under a lock shared with the scan), so
  the table is scanned only when one has passed.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Protocol

from tandem.errors import PeerLostError
from tandem.rpc._calls import Pending, timeout_error
from tandem.rpc._rrefs import RRefTable
from tandem.transport.base import Transport
from tandem.transport.message import Flag

__all__ = ["Monitor"]

INTERVAL_S = 0.1


class _Agent(Protocol):
    """What the monitor watches of its agent (:class:`~tandem.rpc._agent.Agent`)."""

    rank: int
    transport: Transport
    rrefs: RRefTable
    pending: dict[int, Pending]
    next_deadline: float
    deadline_lock: threading.Lock

    def label(self, rank: int) -> str: ...

    def fail_pending(self, match: Callable[[Pending], bool],
                     error: Callable[[Pending], BaseException]) -> None: ...


class Monitor:
    """Started with its agent, stopped by ``stop`` (joins the thread)."""

    def __init__(self, agent: _Agent) -> None:
        self._agent = agent
        self._flag = Flag()
        self._stopping = False
        self._lost: set[int] = set()
        agent.rrefs.wake = self.wake
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tandem-rpc-monitor-{agent.rank}")
        self._thread.start()

    def wake(self) -> None:
        """Run a round soon (never blocks: safe in ``__del__``)."""
        self._flag.set()

    def stop(self) -> None:
        self._stopping = True
        self._flag.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _run(self) -> None:
        while not self._stopping:
            self._flag.wait(INTERVAL_S)
            self._flag = Flag()
            if self._stopping:
                return
            try:
                self.round()
            except Exception as exc:  # noqa: BLE001 - the watch must go on
                print(f"[tandem rpc monitor {self._agent.rank}] {type(exc).__name__}: {exc}",
                      file=sys.stderr)

    def round(self) -> None:
        agent = self._agent
        agent.rrefs.flush()
        self._check_lost()
        now = time.monotonic()
        if now >= agent.next_deadline:
            self._expire(now)

    def _check_lost(self) -> None:
        agent = self._agent
        dead = agent.transport.lost_peers()
        for rank in (set(dead) | set(agent.transport.left_peers())) - self._lost:
            self._lost.add(rank)
            cause = dead.get(rank)
            why = (f"the worker is gone ({cause})" if cause is not None else
                   "the worker left (it called rpc.shutdown()) before replying")
            label = agent.label(rank)

            def error(call: Pending, rank: int = rank, why: str = why,
                      label: str = label) -> BaseException:
                return PeerLostError(f"{call.what} on worker {label} failed: {why}", rank)

            agent.fail_pending(lambda call, rank=rank: call.dest == rank, error)  # type: ignore[misc]
            agent.rrefs.peer_lost(rank)

    def expire(self, now: float) -> None:
        """Fail every call past its deadline at ``now`` (each round does; so may a caller)."""
        self._expire(now)

    def _expire(self, now: float) -> None:
        agent = self._agent
        expired = []
        with agent.deadline_lock:  # a call started meanwhile lowers the bound after us
            soonest = float("inf")
            for call_id, call in list(agent.pending.items()):
                if call.deadline <= now:
                    expired.append((call_id, call))
                elif call.deadline < soonest:
                    soonest = call.deadline
            agent.next_deadline = soonest
        for call_id, call in expired:
            if agent.pending.pop(call_id, None) is call:
                call.complete(None, timeout_error(call, agent.label(call.dest)))

    def lost(self) -> set[int]:
        return set(self._lost)
