"""Binomial trees rooted anywhere: broadcast and reduce in ``ceil(log2 p)`` rounds.

Ranks are renumbered relative to the root (``rel = (r - root) mod p``). In a
broadcast, ``rel`` receives from ``rel`` minus its lowest set bit and then sends to
``rel + 2^k`` for every ``2^k`` below that bit; a reduce runs the same tree upwards.
"""

from __future__ import annotations

import torch

from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import ReduceOp, combine, finish

__all__ = ["tree_broadcast", "tree_reduce"]


def tree_broadcast(op: Op, buf: torch.Tensor, root: int) -> None:
    g = op.group
    p, r = g.group_size, g.group_rank
    rel = (r - root) % p
    view = as_bytes(buf)
    mask = 1
    while mask < p:
        if rel & mask:
            op.wait(op.recv((rel - mask + root) % p, 0, view))
            break
        mask <<= 1
    mask >>= 1
    sends = []
    while mask > 0:
        if rel + mask < p:
            sends.append(op.send((rel + mask + root) % p, 0, view))
        mask >>= 1
    op.wait(*sends)


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
