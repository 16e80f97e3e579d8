"""Helpers of the RPC tests, importable by the spawned workers.

Workers are processes started by ``tandem.testing`` without a process group; each calls
:func:`start`, which joins the RPC job through a FileStore in the test's temporary
directory (no ports to collide). Functions called remotely live here at module level:
they travel by reference.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

import tandem.rpc as rpc
from tandem.testing import Outcome, launch, spawn

LOG: list[str] = []  # what served functions did, for the worker to report after shutdown


def start(rank: int, world: int, store: str, **options: Any) -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", **options)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=opts)


def run(world: int, body: Callable[..., Any], tmp: Path, *args: Any, timeout: float = 90.0,
        **options: Any) -> list[Any]:
    """Run ``body(rank, world, *args)`` in ``world`` RPC workers; raise if any failed."""
    return spawn(world, _worker, args=(body, str(tmp / "store"), options, args), init=False,
                 timeout=timeout)


def run_outcomes(world: int, body: Callable[..., Any], tmp: Path, *args: Any,
                 timeout: float = 90.0, **options: Any) -> list[Outcome]:
    """Like :func:`run`, returning each worker's outcome (for fault tests)."""
    return launch(world, _worker, args=(body, str(tmp / "store"), options, args), init=False,
                  timeout=timeout)


def _worker(rank: int, world: int, body: Callable[..., Any], store: str,
            options: dict[str, Any], args: tuple[Any, ...]) -> Any:
    start(rank, world, store, **options)
    return body(rank, world, *args)


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Run ``fn`` and describe how it ended: value, or error type, message and timing."""
    t0 = time.monotonic()
    try:
        return {"ok": True, "value": fn(*args, **kwargs), "elapsed": time.monotonic() - t0,
                "at": time.time()}
    except BaseException as exc:  # noqa: BLE001 - described for the test
        return {"ok": False, "type": type(exc).__name__,
                "types": [c.__name__ for c in type(exc).__mro__], "msg": str(exc),
                "rank": getattr(exc, "rank", None), "elapsed": time.monotonic() - t0,
                "at": time.time()}


# -- functions called remotely ---------------------------------------------------------
def echo(x: Any) -> Any:
    return x


def add(a: Any, b: Any) -> Any:
    return a + b


def whoami() -> str:
    return rpc.get_worker_info().name


def boom(text: str) -> None:
    raise ValueError(text)


def sleep_then(seconds: float, value: Any = None) -> Any:
    time.sleep(seconds)
    LOG.append(f"slept {seconds}")
    return value


def ping_pong(depth: int, me: str, other: str) -> list[str]:
    """Call ``other``, which calls back, ``depth`` times; returns the path taken."""
    if depth == 0:
        return [me]
    return [me] + rpc.rpc_sync(other, ping_pong, args=(depth - 1, other, me))


def pid() -> int:
    return os.getpid()


class Batcher:
    """Answers ``size`` callers at once: an ``async_execution`` method holds no thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()  # calls arrive on several server threads at once
        self.waiting: list[tuple[torch.futures.Future[Any], int]] = []

    @rpc.functions.async_execution
    def submit(self, value: int) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self.lock:
            self.waiting.append((fut, value))
            done: list[tuple[torch.futures.Future[Any], int]] = []
            if len(self.waiting) == self.size:
                done, self.waiting = self.waiting, []
        total = sum(v for _, v in done)
        for f, _ in done:
            f.set_result(total)
        return fut


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value

    def get(self) -> int:
        return self.value


@rpc.functions.async_execution
def add_later(x: torch.Tensor) -> torch.futures.Future[Any]:
    """Completes through another RPC: the server thread is free meanwhile."""
    return rpc.rpc_async(rpc.get_worker_info().name, add, args=(x, 1))


class Barrier:
    """``rref.rpc_sync().arrive()`` returns once ``parties`` callers arrived (no thread held)."""

    def __init__(self, parties: int) -> None:
        self.parties = parties
        self.lock = threading.Lock()  # arrivals come in on several server threads at once
        self.waiting: list[torch.futures.Future[Any]] = []

    @rpc.functions.async_execution
    def arrive(self) -> torch.futures.Future[Any]:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        with self.lock:
            self.waiting.append(fut)
            done: list[torch.futures.Future[Any]] = []
            if len(self.waiting) == self.parties:
                done, self.waiting = self.waiting, []
        for f in done:
            f.set_result(None)
        return fut


def wait_until(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()
