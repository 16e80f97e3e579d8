"""tandem's RPC framework, with the names of ``torch.distributed.rpc``.

    import tandem.rpc as rpc          # instead of: import torch.distributed.rpc as rpc

    rpc.init_rpc("trainer", rank=0, world_size=2)
    y = rpc.rpc_sync("ps", torch.add, args=(x, 1))
    rref = rpc.remote("ps", Table, args=(1000,))
    rows = rref.rpc_sync().lookup(ids)
    rpc.shutdown()

Calls run over tandem's transports (shared memory within a host, TCP across hosts,
authenticated with the job secret); tensors travel as raw bytes beside the pickled
call. See ``api`` (the functions), ``rref`` (RRef), ``options`` (what init_rpc takes)
and ``functions.async_execution``. Distributed autograd is ``tandem.autograd``,
``DistributedOptimizer`` is in ``tandem.optim`` and ``RemoteModule`` in ``tandem.nn``.
"""

from __future__ import annotations

from typing import Any

from tandem.rpc import constants, functions
from tandem.rpc.api import (get_rpc_timeout, get_worker_info, init_rpc, is_available, remote,
                            rpc_async, rpc_sync, shutdown)
from tandem.rpc.options import BackendType, RpcBackendOptions, TensorPipeRpcBackendOptions
from tandem.rpc.rref import RRef
from tandem.rpc.worker import WorkerInfo

__all__ = ["init_rpc", "shutdown", "get_worker_info", "get_rpc_timeout", "rpc_sync",
           "rpc_async", "remote", "is_available", "RRef", "WorkerInfo", "BackendType",
           "RpcBackendOptions", "TensorPipeRpcBackendOptions", "functions", "constants"]


def _get_debug_info() -> dict[str, Any]:
    """Counters of this worker's RPC state (for tests and debugging), as torch has."""
    from tandem.rpc import _state

    agent = _state.require("_get_debug_info")
    sent, handled = agent.counts()
    return {**agent.rrefs.stats(), "pending_calls": len(agent.pending),
            "messages_sent": sent, "messages_handled": handled,
            "server_jobs": agent.pool.busy(),
            "autograd_contexts": len(agent.autograd.live())}
