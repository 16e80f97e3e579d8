"""Rank bodies of the one-round all-reduce tests (importable by spawned children)."""

from __future__ import annotations

import time
from typing import Any

import torch

import tandem as dist
from _shm_arena_ranks import oracle, value
from tandem.collectives.algorithms import shm
from tandem.collectives.world import default_group, world


def _entering(key: str, rank: int) -> None:
    """Tell the member that will come late to the call ``key`` names that this one is
    about to enter it."""
    world().scoped.set(f"{key}/{rank}", b"")


def _last_in(key: str, rank: int, p: int) -> None:
    """Return once every other member said it is entering the call ``key`` names: this
    one then enters it last, while they wait in it (an event, not a guessed sleep)."""
    world().scoped.wait([f"{key}/{q}" for q in range(p) if q != rank])

# (dtype, reduce ops): AVG both prescaled (2 members) and divided after (3 members)
CASES: list[tuple[torch.dtype, tuple[str, ...]]] = [
    (torch.float32, ("SUM", "AVG", "PRODUCT", "MIN", "MAX")),
    (torch.float64, ("SUM", "AVG")),
    (torch.bfloat16, ("SUM", "AVG")),
    (torch.float16, ("AVG",)),
    (torch.int64, ("BXOR", "MIN")),
    (torch.bool, ("PRODUCT",)),
    (torch.complex64, ("AVG",)),
]
MANY_ROUNDS = (3 << 20) // 4  # float32 elements: several 512 KiB rounds over both halves


def _count_one_rounds(name: str = "_one_round") -> list[int]:
    """Count the runs of ``shm``'s function ``name`` (the one-round path) in this process:
    the list's one element."""
    taken = [0]
    inner = getattr(shm, name)

    def counting(*args: Any) -> None:
        taken[0] += 1
        inner(*args)

    setattr(shm, name, counting)
    return taken


def one_round_limits(rank: int, p: int) -> dict[str, Any]:
    """Single tensors at, just under and just over the one-round path's limit, none or one
    element, and a strided one, for each case; every call's inputs differ from the
    previous ones (so a read of stale staging shows), one member lags now and then (so
    members are in different calls and halves), and a call through many rounds and both
    halves comes between cases. Returns what went wrong and how often the path ran."""
    taken = _count_one_rounds()
    wrong: list[str] = []
    expected = 0
    call = 0

    def check(name: str, n: int, dtype: torch.dtype, op_name: str, stride: int = 1) -> None:
        nonlocal call, expected
        ranks = [q + p * call for q in range(p)]  # this call's inputs, per member
        base = value(ranks[rank], n * stride, dtype)
        t = base[::stride]
        key = f"one-round-{call}"
        if call % 5 == rank % 5:
            _last_in(key, rank, p)
        else:
            _entering(key, rank)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
        want = oracle(ranks, n * stride, dtype, op_name)[::stride]
        if not torch.equal(t, want):
            wrong.append(f"{name}/{dtype}/{op_name}/{n}")
        if n * t.element_size() <= shm.SMALL_BYTES:
            expected += 1
        call += 1

    for dtype, ops in CASES:
        limit = shm.SMALL_BYTES // torch.empty((), dtype=dtype).element_size()
        for op_name in ops:
            for n in (0, 1, limit - 1, limit, limit + 1):
                check("flat", n, dtype, op_name)
            check("strided", limit, dtype, op_name, stride=2)
        check("many-rounds", MANY_ROUNDS, torch.float32, "SUM")
    absmax = dist.ReduceOp.custom(lambda a, b: torch.maximum(a.abs(), b.abs()), "ABSMAX")
    n = shm.SMALL_BYTES // 4
    t = value(rank, n, torch.float32) - 1.5
    dist.all_reduce(t, op=absmax)
    expected += 1
    want = torch.stack([(value(q, n, torch.float32) - 1.5).abs() for q in range(p)]).amax(0)
    if not torch.equal(t, want):
        wrong.append("custom")
    return {"wrong": wrong, "taken": taken[0], "expected": expected}


def strided_input(rank: int, p: int) -> dict[str, Any]:
    """The one-round path handed a strided tensor directly (the public functions hand it
    only flat contiguous buffers): it stages the elements, not the bytes under them.
    Returns whether each op's result was right, and whether the path ran."""
    taken = _count_one_rounds()
    g = default_group()
    right = {}
    n = 257
    # (strided, then conjugate and negative views: contiguous, but their memory holds
    # other values than their elements, so a byte copy of it would be wrong)
    for name, dtype, op_name, view in (
            ("SUM", torch.float32, "SUM", None), ("AVG", torch.float32, "AVG", None),
            ("conj", torch.complex64, "SUM", torch.Tensor.conj),
            ("neg", torch.float64, "SUM", torch.Tensor._neg_view)):
        x = value(rank, 2 * n, dtype)[::2] if view is None else view(value(rank, n, dtype))
        op = g.new_op("all_reduce", f"strided one-round test {name}", "test")
        redop = getattr(dist.ReduceOp, op_name)
        g.run(op, lambda o: shm.shm_all_reduce_many(o, [x], redop), False)
        want = (oracle(list(range(p)), 2 * n, dtype, op_name)[::2] if view is None
                else view(oracle(list(range(p)), n, dtype, op_name)))  # exact: signs only
        right[name] = torch.equal(x, want)
    return {"right": right, "taken": taken[0]}


def barriers_between_calls(rank: int, p: int) -> dict[str, Any]:
    """Barriers through the arena between one-round all-reduces, one member late to each
    barrier in turn: what each barrier reserved and combined, whether it returned before
    the late member entered it, and whether the all-reduces around it stayed right (a
    barrier that left the halves' turns out of step shows as a wrong sum)."""
    g = default_group()
    combined = _count_one_rounds("_reduce_whole")
    entered: list[float] = []  # when this rank entered each barrier it was late to
    left: list[float] = []  # when this rank left each barrier
    barrier = dist.barrier  # its module imported (as tandemrun's zygote does) before counting
    made = [0]  # tensors torch.zeros made meanwhile (a forked rank's first costs most)
    zeros = torch.zeros

    def counting_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        made[0] += 1
        return zeros(*args, **kwargs)

    torch.zeros = counting_zeros  # type: ignore[assignment]
    try:
        for i in range(3):  # the first call on a fresh arena: nothing reserved by them
            if i % p == rank:
                _last_in(f"barrier-{i}", rank, p)
                entered.append(time.time())
            else:
                _entering(f"barrier-{i}", rank)
            barrier()
            left.append(time.time())
    finally:
        torch.zeros = zeros  # type: ignore[assignment]
    assert g.arena is not None
    reserved_by_barriers, combines_by_barriers = g.arena.reserved, combined[0]
    viewed = g.arena._data is not None  # staging views made (per member: O(members) work)
    tensors = made[0] + (g._scratch is not None)
    wrong = []
    for call in range(6):
        ranks = [q + p * call for q in range(p)]
        t = value(ranks[rank], 1000, torch.float32)
        if call % p == rank:
            _last_in(f"between-{call}", rank, p)
        else:
            _entering(f"between-{call}", rank)
        dist.all_reduce(t)
        if call % 2:
            dist.barrier()
        if not torch.equal(t, oracle(ranks, 1000, torch.float32, "SUM")):
            wrong.append(call)
    return {"reserved": reserved_by_barriers, "combined": combines_by_barriers, "viewed": viewed,
            "tensors": tensors,
            "entered": entered, "left": left, "wrong": wrong}
