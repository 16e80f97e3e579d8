"""Recursive doubling all-reduce: latency-optimal for small tensors.

In round ``k`` each rank swaps its whole buffer with the rank whose number differs
in bit ``k`` and combines, so ``log2(p)`` rounds finish the job (one round for two
ranks). With a rank count that is not a power of two, the ranks above the largest
power of two first fold their data into a partner and get the result back at the
end. Partners combine in the same argument order, so results are bit-identical.

When the group spans hosts (:func:`~tandem.collectives.algorithms.ring.link_chunk`),
each round's swap travels in pieces of up to eight, each within tcp's inline limit, so
they leave from the caller without waking the writer thread.
"""

from __future__ import annotations

import torch

from tandem.collectives.algorithms.ring import link_chunk, ring_pieces
from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import ReduceOp, combine, combiner, finish

__all__ = ["doubling_all_reduce"]

_RESULT = 1 << 20  # step number of the result returned to a folded rank
_STRIDE = 8  # step numbers per round: at most this many pieces (ring_pieces' cap)


def doubling_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp) -> None:
    g = op.group
    p, r = g.group_size, g.group_rank
    if p == 1:
        finish(redop, buf, 1)
        return
    pow2 = 1 << (p.bit_length() - 1)
    extra = p - pow2
    view = as_bytes(buf)
    if r >= pow2:  # folded rank: hand data to the partner, wait for the answer
        op.wait(op.send(r - pow2, 0, view))
        op.wait(op.recv(r - pow2, _RESULT, view))
        return
    tmp = g.scratch(buf.numel(), buf.dtype)
    tmp_view = as_bytes(tmp)
    if r < extra:
        op.wait(op.recv(r + pow2, 0, tmp_view))
        combine(redop, buf, tmp, buf)
    chunk = link_chunk(g)
    size = buf.element_size()
    pieces = ([(0, buf.numel())] if chunk is None or buf.numel() == 0 else
              ring_pieces(g.settings, [(0, buf.numel())], size, chunk)[0])
    merge = combiner(redop, buf.dtype)
    distance, step = 1, 1
    while distance < pow2:
        partner = r ^ distance
        got = [op.recv(partner, step * _STRIDE + c, tmp_view[a * size:b * size])
               for c, (a, b) in enumerate(pieces)]
        sent = [op.send(partner, step * _STRIDE + c, view[a * size:b * size])
                for c, (a, b) in enumerate(pieces)]
        # one wait for the whole round: if a peer fails, every posted piece is cancelled
        # with it (a receive left posted could land in working memory a later call uses);
        # sends must finish before buf changes
        op.wait(*got, *sent)
        for a, b in pieces:
            if partner < r:
                merge(tmp[a:b], buf[a:b], buf[a:b])
            else:
                merge(buf[a:b], tmp[a:b], buf[a:b])
        distance <<= 1
        step += 1
    finish(redop, buf, p)
    if r < extra:
        op.wait(op.send(r + pow2, _RESULT, view))
