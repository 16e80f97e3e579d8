"""Rooted collectives through a same-host group's staging arena (see ``shm``).

Broadcast: the root stages each round once; every other member copies it straight
out, and the root may run several rounds ahead (``SlotRing``). Reduce: every other
member stages its round; the root combines them with its own tensor, in member order
(the naive algorithm's order, so its bits), straight into its tensor. Each member
posts once per round, the root only after it has read what it needed, so
:meth:`~tandem.transport.Arena.begin_round`'s one wait keeps the two staging halves
safe; the non-roots run at most one round ahead.

A broadcast root ends its call by waiting for every member's post of round 0 and
then checking their announcements: two ranks that each believe they are the root only
stage, and would both return. Reduce non-roots wait once, for the
root to take round 0, and then check the root's announcement: two ranks that each
name the other as the root would otherwise both return (they only stage), and
nothing else in the call would tell them apart.
"""

from __future__ import annotations

import torch

from tandem.collectives.algorithms.shm_checks import prepare, verify
from tandem.collectives.algorithms.shm_slots import SlotRing, rounds, staging
from tandem.collectives.group import Op
from tandem.collectives.reduce_op import ReduceOp, combiner, finish

__all__ = ["shm_broadcast", "shm_reduce"]


def shm_broadcast(op: Op, buf: torch.Tensor, root: int) -> None:
    """The root stages each round once; every other member copies it straight out.

    Rounds go through a :class:`SlotRing` of half-halves. Every member posts once per
    round (the root when its round is staged, the others when they have copied it
    out: lag 0), so the root runs up to four rounds ahead of the slowest reader. The
    root returns once every member has posted round 0 and announced this very call, so
    that two ranks that both think they are the root are caught in this call.
    """
    arena, check = prepare(op)
    me, size = arena.index, buf.element_size()
    per = max(1, arena.chunk // 2 // size)
    # a non-root only reads the root's slots, once the root posted them: waiting for
    # every member at the start as well made each post wake the other readers
    ring = SlotRing(arena, check, buf.dtype, per, write=me == root)
    plan = list(rounds([buf], per))
    for r, (m, pieces) in enumerate(plan):
        x = pieces[0][0] if pieces else buf
        if me == root:
            ring.reuse(r, 0)[root][:m].copy_(x)
        else:
            arena.wait_member(root, ring.base + r + 1, check)
            if r == 0:
                verify(op, arena, [root])
            x.copy_(ring.order[r % ring.slots][root][:m])
        arena.post()
    if me == root:
        arena.wait_all(ring.base + 1, check)
        verify(op, arena)
    ring.close(len(plan))


def shm_reduce(op: Op, buf: torch.Tensor, root: int, redop: ReduceOp) -> None:
    """Reduce flat ``buf`` into the root's ``buf``; the others' ``buf`` is left unchanged."""
    arena, check = prepare(op)
    p, me, size = arena.size, arena.index, buf.element_size()
    per = arena.chunk // size
    views = staging(arena, buf.dtype, per)
    kernel = combiner(redop, buf.dtype)
    for i, (m, pieces) in enumerate(rounds([buf], per)):
        staged = [v[:m] for v in views[arena.begin_round(check)]]
        x = pieces[0][0] if pieces else buf
        if me != root:
            staged[me].copy_(x)
            arena.post()
            if i == 0:  # see the module doc: the root has taken round 0, so it is here
                arena.wait_member(root, arena.posted, check)
                verify(op, arena, [root])
            continue
        arena.wait_all(arena.posted + 1, check)
        if i == 0:
            verify(op, arena)
        if root >= 2:  # x accumulates members 0 and 1 first: stage my own value aside
            staged[me].copy_(x)
        parts = [x if q == me and root < 2 else staged[q] for q in range(p)]
        kernel(parts[0], parts[1], x)
        for part in parts[2:]:
            kernel(x, part, x)
        finish(redop, x, p)
        arena.post()
