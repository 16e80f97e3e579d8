"""Rank bodies of the shared-memory broadcast tests (importable by spawned children)."""

from __future__ import annotations

from typing import Any

import torch

import tandem as dist
from tandem.collectives.world import default_group
from tandem.transport._arena import Arena


def value(call: int, root: int, n: int) -> torch.Tensor:
    """What ``root`` broadcasts in call ``call``: distinct per call, root and element."""
    return torch.arange(n, dtype=torch.float32) * 3 + call * 1000 + root


# (numel, root): one element, 4 KB, a few rounds of the slot ring, each root in turn
CALLS = [(1, 0), (1024, 5), (1024, 15), (300_000, 3), (1024, 0), (3_000_001, 9), (1, 15),
         (1024, 1), (1024, 2)]


def against_oracle(rank: int, world_size: int) -> dict[str, Any]:
    """Each call of CALLS back to back (a reader of one call may enter the next while
    others still read), then an all-reduce in the same arena; every tensor compared
    with what the naive algorithm gives: the root's bytes everywhere."""
    torch.set_num_threads(1)
    wrong = []
    for call, (n, root) in enumerate(CALLS):
        t = value(call, root, n) if rank == root else torch.full((n,), -1.0)
        dist.broadcast(t, src=root)
        if not torch.equal(t, value(call, root, n)):
            wrong.append(call)
    s = torch.full((1000,), float(rank))
    dist.all_reduce(s)
    return {"shares": default_group().shares_memory, "wrong": wrong,
            "sum": bool(torch.all(s == sum(range(world_size))))}


def whom_readers_wait(rank: int, world_size: int) -> dict[str, Any]:
    """Which members each rank asked the arena to wait for, during broadcasts from rank 0.

    Every request is recorded, whether or not it had to block, so the answer does not
    depend on timing.
    """
    torch.set_num_threads(1)
    asked: list[str] = []
    wait_all, wait_member = Arena.wait_all, Arena.wait_member

    def all_(self: Arena, target: int, check: Any) -> None:
        asked.append("all")
        wait_all(self, target, check)

    def one(self: Arena, q: int, target: int, check: Any) -> None:
        asked.append(str(q))
        wait_member(self, q, target, check)

    dist.barrier()
    Arena.wait_all, Arena.wait_member = all_, one  # type: ignore[method-assign]
    try:
        for n in (1024, 1024, 3_000_001, 1024):
            t = torch.ones(n) if rank == 0 else torch.zeros(n)
            dist.broadcast(t, src=0)
    finally:
        Arena.wait_all, Arena.wait_member = wait_all, wait_member  # type: ignore[method-assign]
    return {"shares": default_group().shares_memory, "asked": sorted(set(asked))}
