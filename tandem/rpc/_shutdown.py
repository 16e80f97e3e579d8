"""Leaving an RPC job: the graceful drain, and closing one worker's agent.

Graceful shutdown (torch's semantics: return once no worker has work outstanding):

1. *Arrive*: every worker says so in the store and waits for all the others. With
   ``timeout=0`` this waits as long as the others live and answer (a parameter server
   typically calls shutdown at once and waits for its trainers): each worker not yet
   arrived is asked, one call at a time, to answer within the rpc_timeout (``ANSWER_S``
   if that is 0); one that does not (stopped, hung) is named, as is one that dies.
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
from tandem.rpc._calls import RpcFuture
from tandem.store.tcp import TCPStore
from tandem.transport.base import Kind

if TYPE_CHECKING:
    from tandem.rpc._agent import Agent

__all__ = ["drain", "close", "answer", "ANSWER_S"]

_POLL_S = 0.5
# How long a worker not yet in shutdown may take to answer when the rpc_timeout is 0
ANSWER_S = 60.0


def answer() -> None:
    """Run on a worker that has not called shutdown yet: it still serves calls."""


def _check_answers(agent: "Agent", keys: list[str], asked: dict[int, RpcFuture],
                   what: str) -> None:
    """Ask each worker that has not written its key whether it still answers; raise
    naming the first whose last question went unanswered within the deadline."""
    limit = agent.timeout or ANSWER_S
    for r, key in enumerate(keys):
        question = asked.get(r)
        if r == agent.rank or question is not None and not question.done():
            continue
        if question is not None and isinstance(question.error, RpcTimeoutError):
            raise RpcTimeoutError(
                f"shutdown: worker {agent.label(r)} did not answer within {limit:g} s (the "
                f"rpc_timeout) while the others waited for it to {what}; is it stopped "
                f"(SIGSTOP) or hung?")
        if agent.store.check([key]):
            asked.pop(r, None)
            continue
        _, call = agent.start(r, answer, (), None, limit, future=True,
                              kind="shutdown's liveness check")
        assert isinstance(call, RpcFuture)
        asked[r] = call


def _lost(agent: "Agent") -> set[int]:
    return set() if agent.monitor is None else agent.monitor.lost()


def _gather(agent: "Agent", key: str, deadline: float | None, what: str) -> list[bytes]:
    """Every worker's value of ``key``/rank; fail fast if a worker is lost."""
    n = len(agent.workers)
    keys = [f"{key}/{r}" for r in range(n)]
    asked: dict[int, RpcFuture] = {}  # without a deadline: who was asked to answer
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
            if deadline is None:
                _check_answers(agent, keys, asked, what)


def drain(agent: "Agent", timeout: float) -> None:
    """Steps 1 and 2 of the module docstring; ``timeout`` > 0 bounds both together."""
    start = time.monotonic()
    deadline = start + timeout if timeout > 0 else None
    agent.store.set(f"shutdown/arrived/{agent.rank}", "1")
    _gather(agent, "shutdown/arrived", deadline, "call shutdown()")
    if deadline is None:  # every worker arrived: outstanding work has the rpc_timeout
        deadline = time.monotonic() + (agent.timeout or ANSWER_S)
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


def close(agent: "Agent", why: str, linger: float = 0.0) -> None:
    """Stop this worker's RPC: pending calls fail, threads end, connections close. The
    store's host first waits up to ``linger`` s for the others to hang up on the store."""
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
            agent.base_store.leave(linger)  # a re-init meets the next server, not this one
        elif agent.base_store is not None:
            agent.base_store.close()
        _state.clear(agent)
