"""Rank bodies of the shm tests (module level, so spawned children can import them).

:func:`battery` runs every main collective and p2p pattern once and returns a
digest of each result, so one spawn serves many tests and tcp/shm/auto runs can be
compared bit for bit. Inputs are small integers in float32: every sum is exact in
any order, so the expected digests are computed in the test process
(:func:`expected`).
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import torch

import tandem as dist
from tandem.collectives.world import default_group, world

BIG = (3 << 20) + 5  # floats: 12 MB, larger than any ring, odd so segments are uneven
SMALL = 1000
ALGORITHMS = ("ring", "doubling", "naive")


@functools.lru_cache(maxsize=4)
def _ramp(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 7


def inp(seed: int, n: int) -> torch.Tensor:
    return (_ramp(n) + seed) % 23  # a new tensor: the cached ramp is never written


def digest(t: torch.Tensor | list[torch.Tensor]) -> str:
    parts = t if isinstance(t, list) else [t]
    h = hashlib.sha256()
    for p in parts:
        h.update(p.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _ops(rank: int, p: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    group = default_group()
    out["shares_memory"] = group.shares_memory
    for algo in ALGORITHMS + (("shm",) if group.shares_memory else ()):
        group.algorithm_override["all_reduce"] = algo
        for n in (1, SMALL, BIG):
            t = inp(rank, n)
            dist.all_reduce(t)
            out[f"all_reduce/{algo}/{n}"] = digest(t)
        t = inp(rank, SMALL)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[f"all_reduce_max/{algo}"] = digest(t)
    group.algorithm_override.pop("all_reduce")
    for n in (SMALL, BIG):
        t = inp(100, n) if rank == p - 1 else torch.zeros(n)
        dist.broadcast(t, src=p - 1)
        out[f"broadcast/{n}"] = digest(t)
        outs = [torch.empty(n) for _ in range(p)]
        dist.all_gather(outs, inp(rank + 200, n))
        out[f"all_gather/{n}"] = digest(outs)
        res = torch.empty(n)
        dist.reduce_scatter(res, [inp(rank * p + j, n) for j in range(p)])
        out[f"reduce_scatter/{n}"] = digest(res)
        outs = [torch.empty(n) for _ in range(p)]
        dist.all_to_all(outs, [inp(rank * 100 + j, n) for j in range(p)])
        out[f"all_to_all/{n}"] = digest(outs)
        got = torch.empty(n)
        nxt, prv = (rank + 1) % p, (rank - 1) % p
        if rank % 2 == 0:
            dist.send(inp(rank + 50, n), dst=nxt)
            dist.recv(got, src=prv)
        else:
            dist.recv(got, src=prv)
            dist.send(inp(rank + 50, n), dst=nxt)
        out[f"send_recv/{n}"] = digest(got)
        works = [dist.isend(inp(rank + 60, n), dst=nxt), dist.irecv(got, src=prv)]
        for w in works:
            w.wait()
        out[f"isend_irecv/{n}"] = digest(got)
    dist.barrier()
    return out


@functools.lru_cache(maxsize=8)
def expected(p: int, shares_memory: bool = False) -> dict[str, str]:
    """What every rank of ``p`` must compute, from the inputs alone; once per group size,
    for every rank's check (each sums several 12 MB inputs)."""
    out: dict[str, str] = {}
    for n in (1, SMALL, BIG):
        summed = digest(torch.stack([inp(r, n) for r in range(p)]).sum(0))
        for algo in ALGORITHMS + (("shm",) if shares_memory else ()):
            out[f"all_reduce/{algo}/{n}"] = summed
    most = digest(torch.stack([inp(r, SMALL) for r in range(p)]).amax(0))
    for algo in ALGORITHMS + (("shm",) if shares_memory else ()):
        out[f"all_reduce_max/{algo}"] = most
    for n in (SMALL, BIG):
        out[f"broadcast/{n}"] = digest(inp(100, n))
        out[f"all_gather/{n}"] = digest([inp(r + 200, n) for r in range(p)])
    return out


def expected_for(rank: int, p: int, shares_memory: bool = False) -> dict[str, str]:
    out = dict(expected(p, shares_memory))  # a copy: the cached one stays as it is
    prv = (rank - 1) % p
    for n in (SMALL, BIG):
        out[f"reduce_scatter/{n}"] = digest(torch.stack([inp(s * p + rank, n) for s in range(p)]).sum(0))
        out[f"all_to_all/{n}"] = digest([inp(j * 100 + rank, n) for j in range(p)])
        out[f"send_recv/{n}"] = digest(inp(prv + 50, n))
        out[f"isend_irecv/{n}"] = digest(inp(prv + 60, n))
    return out


def battery(rank: int, p: int, backend: str, store_path: str,
            host_ids: list[str] | None = None) -> dict[str, Any]:
    """Join with ``backend`` (as host ``host_ids[rank]`` if given) and run :func:`_ops`."""
    if host_ids is not None:
        os.environ["TANDEM_HOST_ID"] = host_ids[rank]
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                            world_size=p, timeout=120)
    try:
        transport = world().transport
        out = _ops(rank, p)
        out["transport"] = type(transport).__name__
        tcp = getattr(transport, "tcp", None)  # the mixed transport's cross-host half
        out["tcp_links"] = sorted(tcp.links) if tcp is not None else None
        out["backend"] = dist.get_backend()
        return out
    finally:
        dist.destroy_process_group()
