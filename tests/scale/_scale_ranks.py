"""Rank bodies for the scale tests: 16 and 32 ranks on one host or on simulated hosts.

A rank of a multi-host layout is a harness child (``tandem.testing.launch``, torch
preloaded, so dozens start in seconds) that first moves itself into its host's network
namespace with ``setns`` and takes that host's identity, then joins the group: it sees
the host's own address and loopback, and other hosts only through the lab's bridge.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

import tandem as dist
from tandem.bench._resources import snapshot

_CLONE_NEWNET = 0x40000000


def enter_host(names: Sequence[str], addrs: Sequence[str], rank: int, per_host: int) -> None:
    """Move this process into its host's namespace; set the host's identity for tandem."""
    if not names:
        return
    host = rank // per_host
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{names[host]}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {names[host]}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ.update({"TANDEM_HOST_ID": f"labhost{host}", "TANDEM_BIND_ADDR": addrs[host]})


def join(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
         per_host: int, timeout: float = 60.0) -> None:
    enter_host(names, addrs, rank, per_host)
    dist.init_process_group("auto", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timeout)


def _value(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s input: distinct per rank and element, exact in float32 sums."""
    return torch.arange(numel, dtype=torch.float32) % 97 + 1000 * rank


def battery(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
            per_host: int, sizes: Sequence[int]) -> dict[str, Any]:
    """Every collective against the naive oracle (each rank's input recomputed here);
    then this rank's resources and TCP connections."""
    base = snapshot()
    join(rank, world, store, names, addrs, per_host)
    wrong = []
    for numel in sizes:
        inputs = [_value(r, numel) for r in range(world)]
        total = torch.stack(inputs).sum(0)
        t = inputs[rank].clone()
        dist.all_reduce(t)
        if not torch.equal(t, total):
            wrong.append(f"all_reduce {numel}")
        outs = [torch.empty(numel) for _ in range(world)]
        dist.all_gather(outs, inputs[rank])
        if not all(torch.equal(o, i) for o, i in zip(outs, inputs)):
            wrong.append(f"all_gather {numel}")
        root = world - 1 - (numel % world)  # a root that is not rank 0
        t = inputs[rank].clone()
        dist.broadcast(t, src=root)
        if not torch.equal(t, inputs[root]):
            wrong.append(f"broadcast {numel} from {root}")
        rows = max(1, numel // world)
        full = [_value(r, rows * world) for r in range(world)]
        out = torch.empty(rows)
        dist.reduce_scatter_tensor(out, full[rank])
        want = torch.stack(full).sum(0)[rank * rows:(rank + 1) * rows]
        if not torch.equal(out, want):
            wrong.append(f"reduce_scatter {rows * world}")
        dist.barrier()
    end = snapshot()
    grown = end.minus(base)
    dist.barrier()  # nobody leaves (closing connections) before every rank counted
    dist.destroy_process_group()
    return {"wrong": wrong, **grown}


def killed(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
           per_host: int, victim: int, stamp: str) -> dict[str, Any]:
    """``victim`` SIGKILLs itself while everyone loops on all_reduce; the others report
    the error they got and when."""
    join(rank, world, store, names, addrs, per_host)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    if rank == victim:
        def die() -> None:
            Path(stamp).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(0.5, die).start()
    try:
        for _ in range(1_000_000):
            dist.all_reduce(t)
    except Exception as exc:  # noqa: BLE001 - described for the test
        return {"type": type(exc).__name__, "msg": str(exc), "at": time.time()}
    return {"type": "none", "msg": "", "at": time.time()}


def stalled(rank: int, world: int, store: str, names: Sequence[str], addrs: Sequence[str],
            per_host: int, victim: int) -> Any:
    """``victim`` stops itself (SIGSTOP) before an all_reduce; the others return the stall
    reports they logged while waiting for it."""
    import logging

    reports: list[tuple[float, str]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "has waited" in record.getMessage():
                reports.append((time.monotonic(), record.getMessage()))

    logging.getLogger("tandem").addHandler(Capture())
    join(rank, world, store, names, addrs, per_host, timeout=float(os.environ["SCALE_OP_S"]))
    dist.all_reduce(torch.ones(4))
    if rank == victim:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception:  # noqa: BLE001 - the call times out; the reports are the result
        pass
    return [(t - start, m) for t, m in reports]
