"""The torch-compatible RPC functions: ``init_rpc``, ``rpc_sync``, ``rpc_async``, ``remote``...

    import tandem.rpc as rpc                  # instead of: import torch.distributed.rpc as rpc
    rpc.init_rpc("worker0", rank=0, world_size=2)     # env:// (MASTER_ADDR, MASTER_PORT)
    y = rpc.rpc_sync("worker1", torch.add, args=(x, 1))
    fut = rpc.rpc_async("worker1", torch.add, args=(x, 1)); y = fut.wait()
    rref = rpc.remote("worker1", torch.add, args=(x, 1)); y = rref.to_here()
    rpc.shutdown()                             # waits until no worker has work outstanding

``to`` is a worker name, a rank or a ``WorkerInfo``; ``timeout`` is seconds, 0 for none,
-1 (default) for the ``rpc_timeout`` given at ``init_rpc`` (60 s unless set).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch

from tandem.collectives.backend import Backend, BackendOptions
from tandem import _wire
from tandem.collectives.init_method import open_store
from tandem.collectives.world import LEAVE_LINGER, bind_address
from tandem.config import flag_argument, load_secret, load_settings
from tandem.errors import ArgumentError
from tandem.rpc import _shutdown, _state
from tandem.rpc._agent import Agent
from tandem.rpc._calls import RpcFuture
from tandem.rpc._monitor import Monitor
from tandem.rpc.options import (DEFAULT_NUM_WORKER_THREADS, BackendType, RpcBackendOptions,
                                TensorPipeRpcBackendOptions, check_timeout, transport_backend)
from tandem.rpc.rref import RRef
from tandem.rpc.worker import Directory, WorkerInfo, check_name
from tandem.store.prefix import PrefixStore

__all__ = ["init_rpc", "shutdown", "get_worker_info", "rpc_sync", "rpc_async", "remote",
           "is_available"]


def is_available() -> bool:
    return True


def _resolve_options(backend: object, options: object) -> tuple[RpcBackendOptions, int, str]:
    if backend is not None and backend != BackendType.TENSORPIPE:
        raise ArgumentError(f"backend={backend!r}: the RPC backend is "
                            f"tandem.rpc.BackendType.TENSORPIPE (or None)")
    if options is None:
        options = TensorPipeRpcBackendOptions()
    if isinstance(options, TensorPipeRpcBackendOptions):
        return options, options.num_worker_threads, transport_backend(options._transports)
    if isinstance(options, RpcBackendOptions):
        return options, DEFAULT_NUM_WORKER_THREADS, "auto"
    raise ArgumentError(f"rpc_backend_options must be tandem.rpc.TensorPipeRpcBackendOptions "
                        f"(or RpcBackendOptions), got {type(options).__name__}")


def _check_rank_and_size(rank: object, world_size: object) -> None:
    """torch's defaults (rank -1, world_size None: from the environment or the URL) or
    a rank in [0, world_size); rank='0' failed with a TypeError in the rendezvous."""
    for what, value, unset in (("rank", rank, -1), ("world_size", world_size, None)):
        if value is unset or value == -1:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < (what == "world_size"):
            raise ArgumentError(f"init_rpc: {what} must be an int >= "
                                f"{int(what == 'world_size')} (or {unset}: from the "
                                f"environment or init_method), got {value!r}")


def init_rpc(name: str, backend: BackendType | None = None, rank: int = -1,
             world_size: int | None = None,
             rpc_backend_options: RpcBackendOptions | None = None) -> None:
    """Join the RPC job as worker ``name``; returns once every worker has joined."""
    check_name(name)
    _check_rank_and_size(rank, world_size)
    options, threads, transport_name = _resolve_options(backend, rpc_backend_options)
    _state.check_free()
    settings = load_settings()
    wait = max(settings.connect_timeout, options.rpc_timeout)
    store, rank, world_size, master = open_store(
        options.init_method, rank, -1 if world_size is None else world_size, wait,
        min(settings.connect_timeout, wait), os.environ)
    try:
        generation = (store.add("tandem-rpc/inits", 1) - 1) // world_size
        scoped = PrefixStore(f"tandem-rpc/{generation}", store)
        scoped.set(f"name/{rank}", name)
        workers = Directory([scoped.get(f"name/{r}").decode() for r in range(world_size)], rank)
        host = bind_address(settings, master)
        transport = Backend.factory(transport_name)(BackendOptions(
            store=PrefixStore("transport", scoped), rank=rank, world_size=world_size,
            host=host, advertise=_wire.advertised_address(host, master),
            hostname=settings.host_id or socket.gethostname(),
            secret=load_secret(), settings=settings))
    except BaseException:
        store.close()
        raise
    agent = Agent(transport, workers, scoped, options.rpc_timeout, threads)
    agent.base_store = store
    agent.monitor = Monitor(agent)
    try:
        _state.install(agent)  # served calls may use the API as soon as we are ready
        # nobody may send before every worker listens for RPC messages
        scoped.set(f"ready/{rank}", "1")
        scoped.wait([f"ready/{r}" for r in range(world_size)], wait)
    except BaseException:
        _shutdown.close(agent, "init_rpc failed")
        raise


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the RPC job. ``graceful``: first wait until every worker has called shutdown
    and no worker has work outstanding (``timeout`` seconds for the whole of it, 0: wait
    for the others as long as they live and answer a call within the rpc_timeout, then
    the rpc_timeout for outstanding work). A worker that is stopped or hung is named in
    the ``RpcTimeoutError``; one that died, in a ``PeerLostError``."""
    # checked before anything is closed: a bad argument must leave RPC running
    graceful = flag_argument("shutdown: graceful", graceful)
    seconds = check_timeout(timeout, "shutdown's timeout")
    agent = _state.require("shutdown")
    linger = 0.0
    try:
        if graceful:
            _shutdown.drain(agent, seconds)
            linger = LEAVE_LINGER  # the others are leaving too: their last store reply
    finally:
        _shutdown.close(agent, "shutdown() was called", linger)


def get_rpc_timeout() -> float:
    """The default deadline of this worker's calls, in seconds: ``rpc_timeout`` of the
    options given to ``init_rpc`` (0: no deadline)."""
    return _state.require("get_rpc_timeout").timeout


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """``WorkerInfo`` of ``worker_name`` (this worker's when None)."""
    agent = _state.require("get_worker_info")
    if worker_name is None:
        return agent.workers.infos[agent.rank]
    return agent.workers.infos[agent.workers.rank_of(worker_name)]


def rpc_sync(to: str | int | WorkerInfo, func: Callable[..., Any], args: Any = None,
             kwargs: Any = None, timeout: float = -1.0) -> Any:
    """Run ``func(*args, **kwargs)`` on worker ``to`` and return its result (or raise its
    exception, with the remote traceback)."""
    agent = _state.require("rpc_sync")
    call_id, call = agent.start(agent.workers.rank_of(to), func, args, kwargs, timeout,
                                future=False, kind="rpc_sync")
    return agent.wait(call_id, call)


def rpc_async(to: str | int | WorkerInfo, func: Callable[..., Any], args: Any = None,
              kwargs: Any = None, timeout: float = -1.0) -> torch.futures.Future[Any]:
    """Like :func:`rpc_sync`, returning a ``torch.futures.Future`` at once (the arguments
    may be modified as soon as it returns)."""
    agent = _state.require("rpc_async")
    _, call = agent.start(agent.workers.rank_of(to), func, args, kwargs, timeout,
                          future=True, kind="rpc_async")
    assert isinstance(call, RpcFuture)
    return call


def remote(to: str | int | WorkerInfo, func: Callable[..., Any], args: Any = None,
           kwargs: Any = None, timeout: float = -1.0) -> RRef[Any]:
    """Run ``func`` on worker ``to`` and keep the result there; return an RRef to it at once.

    Errors of ``func`` (or a creation past ``timeout``) are raised by the RRef's next use,
    e.g. ``to_here()``.
    """
    agent = _state.require("remote")
    dest = agent.workers.rank_of(to)
    rref_id = (agent.rank, agent.new_id())
    if dest == agent.rank:
        rref = RRef._owned(agent, agent.rrefs.local_entry(rref_id))
    else:
        rref = RRef._user(agent, dest, rref_id, rref_id, confirmed=False)
    _, creation = agent.start(dest, func, args, kwargs, timeout, future=True, kind="remote",
                              remote=True, call_id=rref_id[1])
    assert isinstance(creation, RpcFuture)
    rref._creation = creation
    return rref
