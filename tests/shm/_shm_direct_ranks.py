"""Rank bodies of the direct all-reduce tests (importable by spawned children)."""

from __future__ import annotations

from typing import Any

import torch

import tandem as dist
from _shm_arena_ranks import CASES, custom_op_is_right, oracle, value
from tandem.collectives.algorithms import shm_direct
from tandem.collectives.world import default_group
from tandem.errors import CollectiveMismatchError
from tandem.transport import _cma

# odd sizes around the chunk and the slice bounds (chunks forced down to 4 KiB)
SIZES = (1, 3, 1000, 5 * 1024 + 7, 40_001)


def every_dtype_and_op(rank: int, p: int) -> dict[str, Any]:
    """Every case through the direct path; returns the wrong ones and the phases posted."""
    shm_direct.MIN_BYTES, shm_direct.MIN_MEMBERS, shm_direct.CHUNK_BYTES = 1, 2, 4096
    dist.all_reduce(torch.ones(8))  # the first call also agrees on the path
    arena = default_group().arena
    assert arena is not None
    wrong, posts = [], set()
    for dtype, ops in CASES:
        for op_name in ops:
            for n in SIZES:
                t = value(rank, n, dtype)
                before = arena.posted
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
                posts.add(arena.posted - before)
                if not torch.equal(t, oracle(list(range(p)), n, dtype, op_name)):
                    wrong.append(f"{dtype}/{op_name}/{n}")
    if not custom_op_is_right(rank, p, 30_001):  # above the direct path's threshold
        wrong.append("custom")
    base = value(rank, 20_000, torch.float32)  # a strided view: reduced through a copy
    dist.all_reduce(base[::2])
    if not torch.equal(base[::2], oracle(list(range(p)), 20_000, torch.float32, "SUM")[::2]):
        wrong.append("strided")
    return {"wrong": wrong, "posts": sorted(posts), "direct": arena.direct}


def large_default(rank: int, p: int) -> dict[str, Any]:
    """A 12 MB float32 sum with the shipped settings: phases posted and the result."""
    n = (12 << 20) // 4
    t = value(rank, n, torch.float32)
    dist.all_reduce(t)
    arena = default_group().arena
    assert arena is not None
    right = torch.equal(t, oracle(list(range(p)), n, torch.float32, "SUM"))
    t = value(rank, n, torch.float32)
    before = arena.posted
    dist.all_reduce(t)
    return {"right": right and torch.equal(t, oracle(list(range(p)), n, torch.float32, "SUM")),
            "posts": arena.posted - before, "direct": arena.direct}


def one_rank_may_not(rank: int, p: int) -> dict[str, Any]:
    """The last rank's kernel refuses cross-memory access: everyone keeps the staging."""
    shm_direct.MIN_MEMBERS = 2
    if rank == p - 1:
        _cma.may_write = lambda pid, address, expected: False  # type: ignore[assignment]
    n = (2 << 20) // 4 + 3
    results = []
    for _ in range(2):
        t = value(rank, n, torch.float64)
        dist.all_reduce(t)
        results.append(torch.equal(t, oracle(list(range(p)), n, torch.float64, "SUM")))
    arena = default_group().arena
    assert arena is not None
    return {"right": all(results), "direct": arena.direct}


def mismatched_sizes(rank: int, p: int) -> dict[str, Any]:
    """Rank 0 reduces 2 MB, the others 3 MB: every rank must raise, nothing combined."""
    shm_direct.MIN_MEMBERS = 2
    t = torch.full(((2 << 20) // 4 if rank == 0 else (3 << 20) // 4,), float(rank + 1))
    try:
        dist.all_reduce(t)
    except CollectiveMismatchError as exc:
        return {"error": str(exc), "untouched": bool((t == rank + 1).all())}
    return {"error": None, "untouched": bool((t == rank + 1).all())}
