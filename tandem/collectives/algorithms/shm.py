"""Collectives through shared staging memory: ranks read each other's memory directly.

Same-host groups get an :class:`~tandem.transport.Arena` at their first
call: every member maps every member's staging segment. A tensor streams through
it in rounds of at most ``arena.chunk`` bytes, so no segment is tensor-sized.

All-reduce, one round (``m`` elements, cut into one slice per member)::

    1. copy my input's *other* slices into my staging;        post, wait for all
    2. reduce my slice: my input's slice combined with every
       peer's staging slice, into my staging slice;            post, wait for all
    3. copy every member's reduced slice out of its staging into my tensor

Every byte of input is read once and every byte of output written once; the
staging stays in cache. Small tensors (``SMALL_BYTES`` or less) and pairs of ranks skip the
second wait: each member copies its whole round in and reduces all of it itself; one small
tensor that fits one round takes the shortest path (``_one_round``).

Large contiguous tensors skip the staging where the kernel lets members read and
write each other's memory (``shm_direct``). Broadcast and reduce (one root) are in
``shm_rooted``, all-gather and reduce-scatter in ``shm_gather``, how waits find late,
dead and mismatched members in ``shm_checks``. Combines run in member order on every
rank, so results are bit-identical everywhere (and equal to the naive algorithm's).
"""

from __future__ import annotations

from ctypes import memmove
from typing import Callable

import torch

from tandem.collectives.algorithms.ring import even_bounds
from tandem.collectives.algorithms.shm_checks import prepare, verify
from tandem.collectives.algorithms.shm_direct import direct_all_reduce, direct_applies
from tandem.collectives.algorithms.shm_slots import Piece, SlotRing, clip, rounds, staging
from tandem.collectives.group import Op
from tandem.collectives.reduce_op import Combine, ReduceOp, combiner, finish
from tandem.transport import Arena

__all__ = ["shm_all_reduce", "shm_all_reduce_many", "shm_barrier", "SMALL_BYTES"]

SMALL_BYTES = 64 << 10
# rounds of the whole-round path: the round's slice of the tensor and a peer's staged
# copy then fit in a 1 MiB L2 together (measured, one rank alone: 64 MB in 7.4 ms at
# 512 KB rounds, 8.5 ms at 1 MiB, 10.3 ms at 256 KB)
WHOLE_ROUND_BYTES = 512 << 10


def shm_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp) -> None:
    """All-reduce flat ``buf`` in place through the group's arena."""
    shm_all_reduce_many(op, [buf], redop)


def shm_barrier(op: Op, token: torch.Tensor, redop: ReduceOp) -> None:
    """A barrier through the group's arena: one post, a wait for every member's, and the
    call's check; nothing staged, reserved or combined (the byte's MAX over ``p`` members
    took ``p - 1`` torch calls and a page of staging per half)."""
    arena, check = prepare(op)
    arena.begin_round(check, write=False)  # writes no staging: waits for no reader
    arena.post()
    arena.wait_all(arena.posted, check)
    verify(op, arena)


def shm_all_reduce_many(op: Op, tensors: list[torch.Tensor], redop: ReduceOp) -> None:
    """All-reduce flat ``tensors`` (one dtype) in place, as if laid end to end, without
    flattening them into one buffer first."""
    arena, check = prepare(op)
    if direct_applies(arena, tensors) and direct_all_reduce(op, arena, check, tensors[0], redop):
        return
    if len(tensors) == 1:
        x = tensors[0]
        if x.numel() * x.element_size() <= min(SMALL_BYTES, arena.chunk // 2):
            _one_round(op, arena, check, x, redop)
            return
    dtype, size = tensors[0].dtype, tensors[0].element_size()
    n = sum(t.numel() for t in tensors)
    kernel = combiner(redop, dtype)
    if arena.size == 2 or n * size <= SMALL_BYTES:
        _whole_rounds(op, arena, check, tensors, redop, kernel)
        return
    per = arena.chunk // size
    views = staging(arena, dtype, per)
    first = True
    for m, pieces in rounds(tensors, per):
        staged = views[arena.begin_round(check)]
        _sliced_round(op, arena, check, staged if m == per else [v[:m] for v in staged],
                      pieces, redop, kernel, first)
        first = False


def _whole_rounds(op: Op, arena: Arena, check: Callable[[], None], tensors: list[torch.Tensor],
                  redop: ReduceOp, kernel: Combine) -> None:
    """Every member stages each round whole and reduces all of it itself.

    Rounds go through a :class:`SlotRing` of ``WHOLE_ROUND_BYTES`` slots (at most half
    a half); a member posts round ``k`` after reducing round ``k - 1`` (lag 1). Staging
    a round ahead was measured and dropped: at 64 MB it lost in 8 of 10 runs at one load
    and won 7 of 10 at another (docs' benchmarks page, "Collectives on one host").
    """
    size = tensors[0].element_size()
    per = max(1, min(arena.chunk // 2, WHOLE_ROUND_BYTES) // size)
    ring = SlotRing(arena, check, tensors[0].dtype, per)
    plan = list(rounds(tensors, per))
    for r, (m, pieces) in enumerate(plan):
        staged = ring.reuse(r, 1)
        if m < per:
            staged = [v[:m] for v in staged]
        _stage_whole(arena, staged, pieces, redop)
        arena.post()
        arena.wait_all(ring.base + r + 1, check)
        if r == 0:
            verify(op, arena)
        _reduce_whole(arena, staged, pieces, redop, kernel)
    ring.close(len(plan))


def _one_round(op: Op, arena: Arena, check: Callable[[], None], x: torch.Tensor,
               redop: ReduceOp) -> None:
    """:func:`_whole_rounds` for one tensor that fits one round, without its per-round
    bookkeeping: the same phases and staging memory (round 0 of the half
    :meth:`Arena.begin_round` gives, one post, no settle), with the staging views taken
    from the arena's cache. Measured, 2 ranks, 4 KB, the two paths toggled in one loop
    (load 7-8): 43 -> 28 us per call in this module outside its waits, wall 188 -> 145 us."""
    staged = arena.heads(x.dtype, x.numel())[arena.begin_round(check)]
    p = arena.size
    _stage(x, staged[arena.index], p, _prescaled(redop, p))
    arena.post()
    arena.wait_all(arena.posted, check)
    verify(op, arena)
    _reduce_whole(arena, staged, [(x, 0)], redop, combiner(redop, x.dtype))


def _prescaled(redop: ReduceOp, p: int) -> bool:
    """AVG over a power-of-two number of members stages each input already divided:
    dividing by a power of two is exact, so the sum of the quotients has the same bits
    as the quotient of the sum (subnormals aside), and no pass is spent dividing."""
    return redop.name == "AVG" and redop.fn is None and p & (p - 1) == 0


_SCALES: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # (dtype, p) -> 1 / p


def _scale(dtype: torch.dtype, p: int) -> torch.Tensor:
    """``1 / p`` as a 0-dim tensor of ``dtype``, made once: torch multiplies by it in 1.5 us
    at 4 KB where a Python float took 3.9 us (measured). ``p`` is a power of two, so the
    value is exact in every floating dtype and the products' bits are the same."""
    scale = _SCALES.get((dtype, p))
    if scale is None:
        scale = _SCALES[(dtype, p)] = torch.full((), 1.0 / p, dtype=dtype)
    return scale


def _stage(x: torch.Tensor, into: torch.Tensor, p: int, prescale: bool) -> None:
    """Copy ``x`` into its staging view ``into`` (contiguous, of x's dtype and length),
    divided by ``p`` when ``prescale``."""
    if prescale:
        torch.mul(x, _scale(x.dtype, p), out=into)
    elif x.is_contiguous() and not (x.is_conj() or x.is_neg()):
        # x's memory holds its elements (a conjugate or negative view's does not): a plain
        # byte copy, without torch's dispatch (4 KB: 2.0 us by copy_, 0.5 us this way)
        memmove(into.data_ptr(), x.data_ptr(), x.numel() * x.element_size())
    else:
        into.copy_(x)


def _stage_whole(arena: Arena, staged: list[torch.Tensor], pieces: list[Piece],
                 redop: ReduceOp) -> None:
    p, mine = arena.size, staged[arena.index]
    prescale = _prescaled(redop, p)
    for x, off in pieces:
        _stage(x, mine if len(pieces) == 1 else mine[off:off + x.numel()], p, prescale)


def _reduce_whole(arena: Arena, staged: list[torch.Tensor], pieces: list[Piece],
                  redop: ReduceOp, kernel: Combine) -> None:
    p, me = arena.size, arena.index
    prescale = _prescaled(redop, p)
    averaging = redop.name == "AVG" and redop.fn is None
    for x, off in pieces:
        part = staged if len(pieces) == 1 else [s[off:off + x.numel()] for s in staged]
        # combine in member order into x; x is still in cache from the copy, so it is
        # read in place of my staged copy while its value is unchanged (member 0 or 1)
        own = part[me] if prescale else x
        kernel(own if me == 0 else part[0], own if me == 1 else part[1], x)
        for q in range(2, p):
            kernel(x, part[q], x)
        if averaging and not prescale:
            finish(redop, x, p)


def _sliced_round(op: Op, arena: Arena, check: Callable[[], None], staged: list[torch.Tensor],
                  pieces: list[Piece], redop: ReduceOp, kernel: Combine, first: bool) -> None:
    """Each member reduces one slice of the round; then everyone copies all slices out."""
    p, me = arena.size, arena.index
    m = len(staged[me])
    bounds = even_bounds(m, p)
    a, b = bounds[me]
    mine = staged[me]
    for x, off in clip(pieces, 0, a) + clip(pieces, b, m):
        mine[off:off + x.numel()].copy_(x)
    arena.post()
    arena.wait_all(arena.posted, check)
    if first:
        verify(op, arena)
    for x, off in clip(pieces, a, b):
        k = x.numel()
        out = mine[off:off + k]
        parts = [x if q == me else staged[q][off:off + k] for q in range(p)]
        kernel(parts[0], parts[1], out)
        for part in parts[2:]:
            kernel(out, part, out)
        finish(redop, out, p)
    arena.post()
    # my slice first, then each member's as soon as it is reduced: on a host with fewer
    # cores than ranks, a rank copies what is ready instead of waiting for the last one
    for q in [*range(me, p), *range(me)]:
        if q != me:
            arena.wait_member(q, arena.posted, check)
        qa, qb = bounds[q]
        for x, off in clip(pieces, qa, qb):
            x.copy_(staged[q][off:off + x.numel()])
