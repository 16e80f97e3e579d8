"""Who owns which parameter, and where the parameters live.

:func:`greedy_owners` is the partition of torch's ZeroRedundancyOptimizer: parameter
groups in order, each group's parameters largest first, each to the rank with the
fewest elements so far. Every rank then holds 1/N of the optimizer state, give or
take one parameter, and adding a group later never moves the earlier ones.
:func:`bucket_owners` gives each DDP bucket wholly to one rank, bucket ``i`` to rank
``i % N`` (``hook_with_zero_step(..., shard_buckets=False)``).

:class:`FlatParams` is ``parameters_as_bucket_view=True``: the trainable parameters
move into one byte buffer, laid out owner by owner, so that a rank's parameters lie
end to end and travel in place in a few large pieces (see ``_exchange``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tandem.optim._exchange import Location

__all__ = ["greedy_owners", "bucket_owners", "FlatParams", "locations"]

ALIGN = 64  # byte offset of every parameter in the flat buffer: any dtype's view lines up


def greedy_owners(groups: Sequence[Sequence[torch.Tensor]], world: int,
                  start: Sequence[int] | None = None) -> list[list[int]]:
    """Owner (group rank) of every parameter, group by group; ``start`` is each rank's
    element count so far (to partition groups added later)."""
    sizes = list(start) if start is not None else [0] * world
    out: list[list[int]] = []
    for params in groups:
        owners = [0] * len(params)
        for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):  # stable
            rank = sizes.index(min(sizes))
            owners[i] = rank
            sizes[rank] += params[i].numel()
        out.append(owners)
    return out


def bucket_owners(buckets: Sequence[Sequence[int]], count: int, world: int) -> list[int]:
    """Owner of each of ``count`` parameters when bucket ``b`` (parameter indices) goes
    wholly to rank ``b % world``; parameters in no bucket go to rank 0."""
    owners = [0] * count
    for b, members in enumerate(buckets):
        for i in members:
            owners[i] = b % world
    return owners


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def locations(params: Sequence[torch.Tensor]) -> tuple[list[Location], list[torch.Tensor]]:
    """Each parameter as its own base (contiguous ones; the others are packed)."""
    where: list[Location] = []
    bases: list[torch.Tensor] = []
    for p in params:
        if p.is_contiguous():
            where.append(Location(len(bases), 0, _nbytes(p)))
            bases.append(p)
        else:
            where.append(Location(None, 0, _nbytes(p)))
    return where, bases


class FlatParams:
    """The trainable parameters moved into one flat buffer, owner by owner."""

    def __init__(self, params: Sequence[torch.Tensor], owners: Sequence[int]) -> None:
        order = sorted(range(len(params)), key=lambda i: owners[i])  # stable: index order
        offsets = [0] * len(params)
        total = 0
        for i in order:
            offsets[i] = total
            total += (_nbytes(params[i]) + ALIGN - 1) // ALIGN * ALIGN
        self.buffer = torch.empty(max(total, 1), dtype=torch.uint8)
        self.params = list(params)
        self.where = [Location(0, offsets[i], _nbytes(p)) for i, p in enumerate(params)]
        with torch.no_grad():
            for p, loc in zip(params, self.where):
                view = self.buffer[loc.offset:loc.offset + loc.nbytes].view(p.dtype).view(p.shape)
                view.copy_(p.detach())
                p.data = view

    def release(self) -> None:
        """Give every parameter its own memory again (before a new layout)."""
        with torch.no_grad():
            for p in self.params:
                p.data = p.data.clone()
