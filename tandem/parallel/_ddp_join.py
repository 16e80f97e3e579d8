"""DistributedDataParallel as a :class:`~tandem.algorithms.join.Joinable`.

Under ``with Join([ddp, ...])`` (or ``with ddp.join():``) each training forward makes
one small all-reduce, :func:`join_round`: one int32 per rank saying whether the rank
still trains, synchronises gradients in this iteration and broadcasts buffers. A
rank that has joined takes part with zeros (:class:`DDPJoinHook.main_hook`), so every
rank learns

* which rank broadcasts the buffers: the highest rank still training (rank 0 may
  have joined, and its buffers would be stale);
* whether a backward follows that the joined ranks must shadow: they run the same
  reductions with zero gradients (``Reducer.shadow_backward``) and receive the
  average of the others in ``.grad``;
* over how many ranks to average: the whole group by default (every sample weighs
  the same), or, with ``divide_by_initial_world_size=False``, the ranks still
  synchronising.

When every rank has joined, ``post_hook`` copies the parameters (and buffers, with
``broadcast_buffers``) of the last rank to join to all others.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from tandem.algorithms.join import JoinHook
from tandem.collectives.api import all_reduce
from tandem.collectives.group import ProcessGroup
from tandem.collectives.reduce_op import ReduceOp
from tandem.parallel._module_sync import BufferBroadcaster, broadcast_tensors
from tandem.parallel._reducer import Reducer

__all__ = ["DDPJoinHook", "join_round", "TRAINING", "SYNC", "BUFFERS"]

TRAINING, SYNC, BUFFERS = 1, 2, 4  # the bits of a rank's flag


class _Joined(Protocol):
    """What the hook reads of its DDP (ddp.py imports this module, so not the class)."""
    process_group: ProcessGroup
    reducer: Reducer


def join_round(g: ProcessGroup, buffers: BufferBroadcaster, divide_by_initial_world_size: bool,
               mine: int) -> tuple[int, int | None]:
    """One iteration's join bookkeeping: (ranks synchronising gradients, divisor).

    ``mine`` is this rank's flag bits (0 on a joined rank). Broadcasts the buffers
    from the highest rank that asked for it. The divisor is what the reducer averages
    over: None for the whole group.
    """
    flags = torch.zeros(g.group_size, dtype=torch.int32)
    flags[g.group_rank] = mine
    all_reduce(flags, group=g)  # each rank writes only its own place: the sum is the list
    values = flags.tolist()
    senders = [r for r, f in enumerate(values) if f & BUFFERS]
    if senders:
        buffers(src=max(senders))
    syncing = sum(1 for f in values if f & SYNC)
    if divide_by_initial_world_size or syncing in (0, g.group_size):
        return syncing, None
    return syncing, syncing


class DDPJoinHook(JoinHook):
    """Shadows DDP's collectives on a joined rank; copies the last joiner's model at the end.

    ``ddp`` hands over what the hook needs of its private state: ``take_round`` runs
    :func:`join_round` with its flags, ``replica`` lists the tensors the last rank to
    join copies to the others (its parameters, and its buffers when it broadcasts them).
    """

    def __init__(self, ddp: _Joined,
                 take_round: Callable[[int], tuple[int, int | None]],
                 replica: Callable[[], list[torch.Tensor]]) -> None:
        self.ddp = ddp
        self.take_round = take_round
        self.replica = replica

    def main_hook(self) -> None:
        syncing, divisor = self.take_round(0)
        if syncing:
            self.ddp.reducer.shadow_backward(divisor)

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        g = ddp.process_group
        source = torch.tensor([g.group_rank if is_last_joiner else -1], dtype=torch.int64)
        all_reduce(source, op=ReduceOp.MAX, group=g)
        tensors = self.replica()
        with torch.no_grad():
            broadcast_tensors(g, tensors, src=int(source.item()))
