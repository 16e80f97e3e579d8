"""The current worker's agent: the one piece of module state torch's RPC API requires.

``rpc_sync(to, f)`` names no agent, so the functions of ``tandem.rpc``,
``tandem.autograd``, ``tandem.optim.DistributedOptimizer`` and ``tandem.nn.RemoteModule``
find it here. ``init_rpc`` installs it and ``shutdown`` clears it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from tandem.errors import StateError

if TYPE_CHECKING:
    from tandem.rpc._agent import Agent

__all__ = ["require", "current", "check_free", "install", "clear"]

_agent: "Agent | None" = None


def require(what: str) -> "Agent":
    """The running agent, or StateError naming ``what`` was called too early or too late."""
    if _agent is None:
        raise StateError(f"{what}: RPC is not running on this process; call "
                         f"tandem.rpc.init_rpc() first (after shutdown(), call it again)")
    return _agent


def current() -> "Agent | None":
    return _agent


def check_free() -> None:
    if _agent is not None:
        raise StateError("init_rpc was already called on this process; call "
                         "tandem.rpc.shutdown() before initialising again")


def install(agent: "Agent") -> None:
    global _agent
    check_free()
    _agent = agent


def _forget_in_child() -> None:
    """A fork()ed child (a DataLoader worker, say) has none of the agent's threads or
    connections: RPC there says it is not running instead of waiting forever."""
    global _agent
    if _agent is not None:
        _agent.closed = True  # its RRefs must not queue deletes nobody sends
        _agent = None


os.register_at_fork(after_in_child=_forget_in_child)


def clear(agent: "Agent") -> None:
    global _agent
    if _agent is agent:
        _agent = None
