"""Leaving an RPC job: the graceful drain, and closing one worker's agent.

Graceful shutdown (torch's semantics: return once no worker has work outstanding):

1. *Arrive*: every worker says so in the store and waits for all the others. With
   ``timeout=0`` this waits as long as the others live (a parameter server typically
   calls shutdown at once and waits for its trainers); a worker that dies meanwhile is
   named at once.
2. *Drain*: rounds through the store, each worker reporting how many messages it has
   sent and fully handled (a call counts as handled once its reply is sent). When two
   consecutive rounds report the same counts on every worker and the sums agree, there
   was a moment when nothing was in flight and nothing was running anywhere: that is
   quiescence (counters never decrease, so equal counts mean nothing happened between
   the rounds). Round ``k`` starts after every report of round ``k - 1``, so the two
   reports of one worker enclose that moment.
3. *Part*: every worker closes its agent; the worker hosting the store waits until the
   others have read their last round before closing it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tandem.errors import PeerLostError, RpcTimeoutError, StoreTimeoutError
from tandem.rpc import _state
from tandem.store.tcp import TCPStore
from tandem.transport.base import Kind

if TYPE_CHECKING:
    from tandem.rpc._agent import Agent

__all__ = ["drain", "close"]

_POLL_S = 0.5


def _lost(agent: "Agent") -> set[int]:
    return set() if agent.monitor is None else agent.monitor.lost()


def _gather(agent: "Agent", key: str, deadline: float | None, what: str) -> list[bytes]:
    """Every worker's value of ``key``/rank; fail fast if a worker is lost."""
    n = len(agent.workers)
    keys = [f"{key}/{r}" for r in range(n)]
    while True:
        left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
        if left <= 0:
            missing = [r for r in range(n) if not agent.store.check([keys[r]])]
            names = ", ".join(agent.label(r) for r in missing)
            raise RpcTimeoutError(f"shutdown: worker(s) {names} did not {what} in time")
        try:
            agent.store.wait(keys, left)
            return [agent.store.get(k) for k in keys]
        except StoreTimeoutError:
            gone = sorted(r for r in _lost(agent) if not agent.store.check([keys[r]]))
            if gone:
                raise PeerLostError(f"shutdown: worker {agent.label(gone[0])} is gone before "
                                    f"it could {what}", gone[0]) from None


def drain(agent: "Agent", timeout: float) -> None:
    """Steps 1 and 2 of the module docstring; ``timeout`` > 0 bounds both together."""
    start = time.monotonic()
    deadline = start + timeout if timeout > 0 else None
    agent.store.set(f"shutdown/arrived/{agent.rank}", "1")
    _gather(agent, "shutdown/arrived", deadline, "call shutdown()")
    if deadline is None and agent.timeout > 0:
        deadline = time.monotonic() + agent.timeout
    previous: list[bytes] | None = None
    pause = 0.001
    for round_no in range(1 << 30):
        if agent.rrefs.flush():
            pass  # queued RRef deletes are messages too; counted from here on
        sent, handled = agent.counts()
        busy = agent.pool.busy() + len(agent.rrefs.deletes)
        agent.store.set(f"shutdown/round/{round_no}/{agent.rank}", f"{sent},{handled},{busy}")
        reports = _gather(agent, f"shutdown/round/{round_no}", deadline,
                          "finish its outstanding work")
        counts = [tuple(int(x) for x in r.decode().split(",")) for r in reports]
        if (reports == previous and sum(c[0] for c in counts) == sum(c[1] for c in counts)
                and not any(c[2] for c in counts)):
            break
        previous = reports
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    agent.store.set(f"shutdown/done/{agent.rank}", "1")
    if agent.rank == 0:  # hosts the store (env:// and tcp://): the others still read it
        try:
            _gather(agent, "shutdown/done", time.monotonic() + 10.0, "leave")
        except (RpcTimeoutError, PeerLostError):
            pass  # they have their answer: only their last read is at stake


def close(agent: "Agent", why: str) -> None:
    """Stop this worker's RPC: pending calls fail, threads end, connections close."""
    from tandem.errors import StateError

    agent.closed = True
    if agent.monitor is not None:
        agent.monitor.stop()
    agent.fail_pending(lambda call: True,
                       lambda call: StateError(f"{call.what} was abandoned: {why}"))
    agent.pool.close(5.0)
    agent.transport.handle(Kind.RPC, None)
    try:
        agent.transport.close()
    finally:
        agent.buffers.close()
        if isinstance(agent.base_store, TCPStore):
            agent.base_store.leave()  # a re-init meets the next server, not this one
        elif agent.base_store is not None:
            agent.base_store.close()
        _state.clear(agent)
