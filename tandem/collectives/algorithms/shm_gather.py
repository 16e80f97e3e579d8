"""All-gather and reduce-scatter through the group's staging arena.

All-gather: each member stages its input, everyone copies every member's piece
out. Reduce-scatter: each member stages its pieces for the others and reduces its
own from theirs, in member order (bit-identical to the naive algorithm).
"""

from __future__ import annotations

import torch

from tandem.collectives.algorithms.shm_checks import prepare, verify
from tandem.collectives.algorithms.shm_slots import staging
from tandem.collectives.group import Op
from tandem.collectives.reduce_op import ReduceOp, combiner, finish

__all__ = ["shm_all_gather", "shm_reduce_scatter"]


def shm_all_gather(op: Op, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    """Every member stages its input round by round; everyone copies every piece out.

    ``outs[q]`` (flat) receives member q's input, whose size it gives (sizes may differ
    between members; the caller's signature carries them, so all agree).
    """
    arena, check = prepare(op)
    p, me, size = arena.size, arena.index, mine.element_size()
    per = arena.chunk // size
    views = staging(arena, mine.dtype, per)
    sizes = [t.numel() for t in outs]
    for i, start in enumerate(range(0, max(max(sizes), 1), per)):
        staged = views[arena.begin_round(check)]
        m = max(0, min(per, sizes[me] - start))
        staged[me][:m].copy_(mine[start:start + m])
        arena.post()
        arena.wait_all(arena.posted, check)
        if i == 0:
            verify(op, arena)
        for q in range(p):
            k = max(0, min(per, sizes[q] - start))
            if k:
                outs[q][start:start + k].copy_(mine[start:start + k] if q == me else staged[q][:k])


def shm_reduce_scatter(op: Op, out: torch.Tensor, ins: list[torch.Tensor], redop: ReduceOp) -> None:
    """Member q's result goes to its ``out``: each member stages its inputs for the
    others, and each reduces its own slice straight from the peers' staging.

    ``ins[q]`` (flat) is this member's contribution to member q's output; sizes may
    differ between members (the caller's signature carries them).
    """
    arena, check = prepare(op)
    p, me, size = arena.size, arena.index, out.element_size()
    per = arena.chunk // size // p  # a round stages one piece for every member
    views = staging(arena, out.dtype, per * p)
    kernel = combiner(redop, out.dtype)
    sizes = [t.numel() for t in ins]
    if out.numel() and out.untyped_storage().data_ptr() == ins[me].untyped_storage().data_ptr():
        ins = list(ins)
        ins[me] = ins[me].clone()  # the output overwrites my own input (in-place use)
    for i, start in enumerate(range(0, max(max(sizes), 1), per)):
        staged = views[arena.begin_round(check)]
        for q in range(p):
            k = max(0, min(per, sizes[q] - start))
            if q != me and k:
                staged[me][q * per:q * per + k].copy_(ins[q][start:start + k])
        arena.post()
        arena.wait_all(arena.posted, check)
        if i == 0:
            verify(op, arena)
        k = max(0, min(per, sizes[me] - start))
        if not k:
            continue
        parts = [ins[me][start:start + k] if q == me else staged[q][me * per:me * per + k]
                 for q in range(p)]
        o = out[start:start + k]
        kernel(parts[0], parts[1], o)
        for part in parts[2:]:
            kernel(o, part, o)
        finish(redop, o, p)
