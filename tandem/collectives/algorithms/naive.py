"""Naive algorithms, kept as the test oracle: gather everything on rank 0, compute, send back.

They are obviously correct and obviously slow (rank 0 moves ``p`` times the data).
Tests compare every optimised algorithm with these on the same inputs.
"""

from __future__ import annotations

import torch

from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import ReduceOp, combine, finish

__all__ = ["naive_all_reduce"]


def naive_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp) -> None:
    g = op.group
    p, r = g.group_size, g.group_rank
    view = as_bytes(buf)
    if r == 0:
        parts = [torch.empty_like(buf) for _ in range(p - 1)]
        op.wait(*[op.recv(i + 1, 0, as_bytes(t)) for i, t in enumerate(parts)])
        for t in parts:  # rank order: lower ranks' data is always the first argument
            combine(redop, buf, t, buf)
        finish(redop, buf, p)
        op.wait(*[op.send(i, 1, view) for i in range(1, p)])
    else:
        sent = op.send(0, 0, view)
        op.wait(sent)
        op.wait(op.recv(0, 1, view))
