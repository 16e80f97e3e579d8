"""Binomial trees rooted anywhere: broadcast and reduce in ``ceil(log2 p)`` rounds.

Ranks are renumbered relative to the root (``rel = (r - root) mod p``). In a
broadcast, ``rel`` receives from ``rel`` minus its lowest set bit and then sends to
``rel + 2^k`` for every ``2^k`` below that bit; a reduce runs the same tree upwards.
"""

from __future__ import annotations

import torch

from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import ReduceOp, combine, finish

__all__ = ["binomial", "tree_broadcast", "tree_reduce"]


def binomial(members: list[int], root: int, me: int) -> tuple[int | None, list[int]]:
    """``me``'s parent and children in a binomial tree over ``members`` rooted at
    ``root`` (both members), children in the order they are sent to: farthest first."""
    p = len(members)
    at = members.index(root)
    rel = (members.index(me) - at) % p
    parent = None
    mask = 1
    while mask < p:
        if rel & mask:
            parent = members[(rel - mask + at) % p]
            break
        mask <<= 1
    mask >>= 1
    children = []
    while mask > 0:
        if rel + mask < p:
            children.append(members[(rel + mask + at) % p])
        mask >>= 1
    return parent, children


def tree_broadcast(op: Op, buf: torch.Tensor, root: int) -> None:
    g = op.group
    parent, children = binomial(list(range(g.group_size)), root, g.group_rank)
    view = as_bytes(buf)
    if parent is not None:
        op.wait(op.recv(parent, 0, view))
    op.wait(*[op.send(c, 0, view) for c in children])


def tree_reduce(op: Op, buf: torch.Tensor, root: int, redop: ReduceOp) -> None:
    """Reduce into ``buf`` on ``root``; other ranks' ``buf`` is left unchanged."""
    g = op.group
    p, r = g.group_size, g.group_rank
    rel = (r - root) % p
    acc = buf
    tmp: torch.Tensor | None = None
    mask = 1
    while mask < p:
        if rel & mask:
            op.wait(op.send(((rel & ~mask) + root) % p, 0, as_bytes(acc)))
            return
        child = rel | mask
        if child < p:
            if tmp is None:
                tmp = torch.empty_like(buf)
                if rel != 0:
                    acc = buf.clone()  # never write into a non-root caller's tensor
            op.wait(op.recv((child + root) % p, 0, as_bytes(tmp)))
            combine(redop, acc, tmp, acc)
        mask <<= 1
    finish(redop, acc, p)
