"""Rank bodies of the shared-memory arena tests (importable by spawned children)."""

from __future__ import annotations

import time
from typing import Any

import torch

import tandem as dist
from tandem.collectives.reduce_op import combine, finish
from tandem.collectives.world import default_group
from tandem.errors import ArgumentError, CollectiveTimeoutError

# (dtype, reduce ops) covering floats, halves, ints, bool and complex
CASES: list[tuple[torch.dtype, tuple[str, ...]]] = [
    (torch.float32, ("SUM", "AVG", "PRODUCT", "MIN", "MAX")),
    (torch.float64, ("SUM", "AVG")),
    (torch.bfloat16, ("SUM", "MAX")),
    (torch.float16, ("SUM",)),
    (torch.int64, ("SUM", "BAND", "BOR", "BXOR", "MIN")),
    (torch.int8, ("SUM", "MAX")),
    (torch.bool, ("SUM", "PRODUCT")),
    (torch.complex64, ("SUM", "AVG")),
]
# element counts: one, odd, a few rounds of a 4 KiB staging, and not a multiple of anything
SIZES = (1, 3, 1000, 5 * 1024 + 7, 40_001)


def value(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank-specific inputs; floats carry fractions so the combine order shows."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.7
    if dtype.is_complex:
        return torch.randn(n, generator=g).to(dtype) + 1j * torch.randn(n, generator=g).to(dtype)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g) * 2 + 0.5).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def oracle(ranks: list[int], n: int, dtype: torch.dtype, op_name: str) -> torch.Tensor:
    """The reduction in member order, computed locally: the bits every rank must get."""
    op = getattr(dist.ReduceOp, op_name)
    out = value(ranks[0], n, dtype).clone()
    for r in ranks[1:]:
        combine(op, out, value(r, n, dtype), out)
    finish(op, out, len(ranks))
    return out


def custom_op_is_right(rank: int, p: int, n: int) -> bool:
    """A user-defined op (largest magnitude) over ``n`` floats equals the naive result."""
    absmax = dist.ReduceOp.custom(lambda a, b: torch.maximum(a.abs(), b.abs()), "ABSMAX")
    t = value(rank, n, torch.float32) - 1.5
    dist.all_reduce(t, op=absmax)
    want = torch.stack([(value(r, n, torch.float32) - 1.5).abs() for r in range(p)]).amax(0)
    return torch.equal(t, want)


def every_dtype_and_op(rank: int, p: int) -> dict[str, Any]:
    """all_reduce through the arena for every case; returns the names that went wrong."""
    group = default_group()
    wrong = []
    for dtype, ops in CASES:
        for op_name in ops:
            for n in SIZES:
                t = value(rank, n, dtype)
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
                if not torch.equal(t, oracle(list(range(p)), n, dtype, op_name)):
                    wrong.append(f"{dtype}/{op_name}/{n}")
    # a strided view and a user-defined op
    base = value(rank, 2000, torch.float32)
    dist.all_reduce(base[::2])
    want = oracle(list(range(p)), 2000, torch.float32, "SUM")[::2]
    if not torch.equal(base[::2], want) or not torch.equal(base[1::2], value(rank, 2000, torch.float32)[1::2]):
        wrong.append("strided")
    if not custom_op_is_right(rank, p, 3000):
        wrong.append("custom")
    return {"wrong": wrong, "chunk": group.arena.chunk if group.arena else None,
            "algorithm": dist.get_backend()}


def subgroups_concurrently(rank: int, p: int) -> dict[str, Any]:
    """Two overlapping groups, async all_reduces in flight on both at once."""
    evens = dist.new_group([0, 2])
    firsts = dist.new_group([0, 1, 2])
    works, tensors = [], []
    for i in range(4):
        if rank in (0, 2):
            t = value(rank, 20_000 + i, torch.float32)
            works.append(dist.all_reduce(t, group=evens, async_op=True))
            tensors.append(("evens", [0, 2], 20_000 + i, t))
        if rank in (0, 1, 2):
            t = value(rank, 30_000 + i, torch.float32)
            works.append(dist.all_reduce(t, group=firsts, async_op=True))
            tensors.append(("firsts", [0, 1, 2], 30_000 + i, t))
    for w in works:
        w.wait()
    wrong = [f"{name}/{n}" for name, members, n, t in tensors
             if not torch.equal(t, oracle(members, n, torch.float32, "SUM"))]
    shares = [g.shares_memory for g in (evens, firsts) if hasattr(g, "shares_memory")]
    dist.barrier()
    return {"wrong": wrong, "shares": shares}


def late_peer(rank: int, p: int, joined_before: bool) -> dict[str, Any]:
    """Rank 1 never joins an all_reduce: rank 0 times out naming it.

    ``joined_before``: the group already ran a call (its arena exists), so rank 0 waits
    on rank 1's phase counter; otherwise it waits for rank 1's staging segment.
    """
    g = dist.new_group([0, 1], timeout=1.5)
    if joined_before:
        dist.all_reduce(torch.ones(10), group=g)
    t = torch.ones(100_000)
    start = time.monotonic()
    if rank == 0:
        try:
            dist.all_reduce(t, group=g)
        except CollectiveTimeoutError as exc:
            return {"error": str(exc), "missing": list(exc.missing),
                    "elapsed": time.monotonic() - start}
        return {"error": None}
    time.sleep(4.0)
    return {"error": None}


def coalesced(rank: int, p: int, exact: bool) -> dict[str, Any]:
    """all_reduce_coalesced on tensors that straddle rounds, one of them strided.

    ``exact``: bit for bit (shared memory combines in member order); otherwise allclose
    (a ring sums in another order).
    """
    sizes = [5, 1, 3000, 777, 12_345, 2]
    wrong = []
    same = torch.equal if exact else torch.allclose
    for op_name in ("SUM", "AVG", "MAX"):
        ts = [value(rank, n, torch.float32).clone() for n in sizes]
        wide = value(rank, 900, torch.float32).clone().view(300, 3)
        work = dist.all_reduce_coalesced(ts + [wide[:, 1]], op=getattr(dist.ReduceOp, op_name),
                                         async_op=True)
        assert work is not None
        work.wait()
        for n, t in zip(sizes, ts):
            if not same(t, oracle(list(range(p)), n, torch.float32, op_name)):
                wrong.append(f"{op_name}/{n}")
        if not same(wide[:, 1], oracle(list(range(p)), 900, torch.float32, op_name).view(300, 3)[:, 1]):
            wrong.append(f"{op_name}/strided")
        if not torch.equal(wide[:, 0], value(rank, 900, torch.float32).view(300, 3)[:, 0]):
            wrong.append(f"{op_name}/strided-neighbours-touched")
    return {"wrong": wrong}


def without_arena(rank: int, p: int) -> dict[str, Any]:
    """TANDEM_SHM_ARENA=0: all_reduce goes through the rings; forcing "shm" is refused."""
    group = default_group()
    t = value(rank, 5000, torch.float32)
    dist.all_reduce(t)
    ok = torch.allclose(t, oracle(list(range(p)), 5000, torch.float32, "SUM"))
    group.algorithm_override["all_reduce"] = "shm"
    try:
        dist.all_reduce(t)
        refused = ""
    except ArgumentError as exc:
        refused = str(exc)
    group.algorithm_override.pop("all_reduce")
    return {"shares": group.shares_memory, "arena": group.arena is not None, "ok": ok,
            "refused": refused}


def broadcast_and_gather(rank: int, p: int) -> dict[str, Any]:
    """broadcast from every root and all_gather (even and uneven) through the arena."""
    wrong = []
    for dtype in (torch.float32, torch.int64, torch.bool):
        for n in SIZES:
            for root in range(p):
                t = value(rank, n, dtype).clone()
                dist.broadcast(t, src=root)
                if not torch.equal(t, value(root, n, dtype)):
                    wrong.append(f"broadcast/{dtype}/{n}/root{root}")
            outs = [torch.empty(n, dtype=dtype) for _ in range(p)]
            dist.all_gather(outs, value(rank, n, dtype))
            if not all(torch.equal(o, value(q, n, dtype)) for q, o in enumerate(outs)):
                wrong.append(f"all_gather/{dtype}/{n}")
            flat = torch.empty(n * p, dtype=dtype)
            dist.all_gather_into_tensor(flat, value(rank, n, dtype))
            if not torch.equal(flat, torch.cat([value(q, n, dtype) for q in range(p)])):
                wrong.append(f"all_gather_into_tensor/{dtype}/{n}")
    sizes = [1 + 3000 * q for q in range(p)]  # uneven, as all_gather_object uses it
    outs = [torch.empty(k) for k in sizes]
    dist.all_gather(outs, value(rank, sizes[rank], torch.float32))
    if not all(torch.equal(o, value(q, sizes[q], torch.float32)) for q, o in enumerate(outs)):
        wrong.append("all_gather/uneven")
    objs: list[Any] = [None] * p
    dist.all_gather_object(objs, {"rank": rank, "blob": "x" * (100 * rank)})
    if objs != [{"rank": q, "blob": "x" * (100 * q)} for q in range(p)]:
        wrong.append("all_gather_object")
    return {"wrong": wrong}


def reduce_scatters(rank: int, p: int) -> dict[str, Any]:
    """reduce_scatter and reduce_scatter_tensor through the arena, against the oracle."""
    wrong = []
    for dtype, ops in CASES[:5]:
        for op_name in ops[:2]:
            op = getattr(dist.ReduceOp, op_name)
            for n in (1, 1000, 5 * 1024 + 7):
                # input for member q from rank r: value(r * p + q, n)
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(out, [value(rank * p + q, n, dtype) for q in range(p)], op=op)
                parts = [value(r * p + rank, n, dtype) for r in range(p)]
                want = parts[0].clone()
                for x in parts[1:]:
                    combine(op, want, x, want)
                finish(op, want, p)
                if not torch.equal(out, want):
                    wrong.append(f"reduce_scatter/{dtype}/{op_name}/{n}")
                whole = torch.cat([value(rank * p + q, n, dtype) for q in range(p)])
                mine = whole.chunk(p)[rank]  # the output is part of the input, as FSDP does
                dist.reduce_scatter_tensor(mine, whole, op=op)
                if not torch.equal(mine, want):
                    wrong.append(f"reduce_scatter_tensor/{dtype}/{op_name}/{n}")
    sizes = [1 + 2000 * q for q in range(p)]  # member q's output has sizes[q] elements
    out = torch.empty(sizes[rank])
    dist.reduce_scatter(out, [value(rank * p + q, sizes[q], torch.float32) for q in range(p)])
    want = value(rank, sizes[rank], torch.float32) * 0
    for r in range(p):
        want += value(r * p + rank, sizes[rank], torch.float32)
    if not torch.allclose(out, want):
        wrong.append("reduce_scatter/uneven")
    return {"wrong": wrong}


def reduces(rank: int, p: int) -> dict[str, Any]:
    """reduce to every root through the arena: the root gets the member-order reduction
    bit for bit, every other rank's tensor is left as it was."""
    wrong = []
    for dtype, ops in CASES:
        for op_name in ops[:3]:
            for n in (1, 3, 5 * 1024 + 7):
                for root in range(p):
                    t = value(rank, n, dtype)
                    dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op_name))
                    want = (oracle(list(range(p)), n, dtype, op_name) if rank == root
                            else value(rank, n, dtype))
                    if not torch.equal(t, want):
                        wrong.append(f"{dtype}/{op_name}/{n}/root{root}")
    base = value(rank, 2000, torch.float32)  # a strided view
    dist.reduce(base[1::2], dst=p - 1)
    if rank == p - 1 and not torch.equal(base[1::2], oracle(list(range(p)), 2000, torch.float32,
                                                            "SUM")[1::2]):
        wrong.append("strided")
    return {"wrong": wrong, "arena": default_group().arena is not None}
