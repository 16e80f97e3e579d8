"""Direct algorithms: every message goes straight to its destination.

Used where each rank's data is meant for one other rank (gather, scatter,
all-to-all). All receives are posted first, so payloads land directly in the
output tensors; then all sends go out and everything is waited for together.
"""

from __future__ import annotations

import torch

from tandem.collectives.group import Op, as_bytes
from tandem.transport import Slot

__all__ = ["direct_gather", "direct_scatter", "pairwise_all_to_all"]


def direct_gather(op: Op, send: torch.Tensor, outs: list[torch.Tensor] | None, root: int) -> None:
    g = op.group
    if g.group_rank == root:
        assert outs is not None
        recvs = [op.recv(i, 0, as_bytes(t)) for i, t in enumerate(outs) if i != root]
        outs[root].copy_(send)
        op.wait(*recvs)
    else:
        op.wait(op.send(root, 0, as_bytes(send)))


def direct_scatter(op: Op, recv: torch.Tensor, ins: list[torch.Tensor] | None, root: int) -> None:
    g = op.group
    if g.group_rank == root:
        assert ins is not None
        sends = [op.send(i, 0, as_bytes(t)) for i, t in enumerate(ins) if i != root]
        recv.copy_(ins[root])
        op.wait(*sends)
    else:
        op.wait(op.recv(root, 0, as_bytes(recv)))


def pairwise_all_to_all(op: Op, outs: list[torch.Tensor], ins: list[torch.Tensor],
                        sent: dict[int, Slot] | None = None) -> None:
    """``outs[j]`` on rank ``i`` receives ``ins[i]`` of rank ``j``; ``sent``: the sends
    already made, by peer."""
    g = op.group
    p, r = g.group_size, g.group_rank
    sent = sent or {}
    recvs = [op.recv((r - k) % p, 0, as_bytes(outs[(r - k) % p])) for k in range(1, p)]
    sends = [sent[j] if j in sent else op.send(j, 0, as_bytes(ins[j]))
             for j in ((r + k) % p for k in range(1, p))]
    outs[r].copy_(ins[r])
    op.wait(*recvs, *sends)
