"""Gradient sharding (ZeRO stage 2): each rank keeps only the gradients it optimises.

With a :class:`~tandem.optim.ZeroRedundancyOptimizer` every rank updates only the
parameters it owns, so it needs only their averaged gradients. DDP then
*reduce-scatters* each bucket instead of all-reducing it: each rank contributes, for
every rank, the gradients that rank owns in the bucket, and receives the average of
its own part. The gradients are dropped as soon as the reduction has read them, so
between steps a rank holds about 1/N of the gradients, and the reduction moves
(N-1)/N of the bucket once instead of twice.

No bucket buffer: a rank's share of a bucket is usually one parameter, whose
``.grad`` goes to the reduce-scatter as it is; only shares of several parameters are
packed into one tensor (a reduce-scatter takes one tensor per rank). An owned
parameter's ``.grad`` is a view of this backward's reduced shard.

Gradient accumulation keeps DDP's meaning. A view handed out by the last
synchronised backward that was never cleared (no ``zero_grad()`` between steps) is
taken aside when the next backward reaches the parameter, and added back to the next
reduced value, so the owner ends with ``previous + average(new)`` as plain DDP gives.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from tandem.collectives.api import reduce_scatter
from tandem.collectives.group import ProcessGroup
from tandem.collectives.reduce_op import ReduceOp
from tandem.parallel._buckets import Bucket

__all__ = ["GradShards"]


class GradShards:
    """Which group rank owns each parameter of a reducer, and the per-bucket reduce-scatter."""

    def __init__(self, params: Sequence[torch.nn.Parameter], owners: Sequence[int],
                 group: ProcessGroup) -> None:
        self.params = list(params)
        self.owners = list(owners)
        self.group = group
        self.me = group.group_rank
        self._bounds: dict[int, list[tuple[int, int]]] = {}
        self._offsets: dict[int, int] = {}  # bucket -> its place in this rank's shard
        self._firsts: dict[int, int] = {}  # first bucket of a dtype -> the dtype's numel
        self._shard: dict[torch.dtype, torch.Tensor] = {}  # this backward's reduced shard
        self._outputs: dict[int, torch.Tensor] = {}
        self._given: dict[int, weakref.ref[torch.Tensor]] = {}
        self._stash: dict[int, torch.Tensor] = {}
        ref = weakref.ref(self)

        def make_hook(i: int) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                shards = ref()
                if shards is not None:
                    shards._before_accumulate(i)
            return hook

        handles = [p.register_hook(make_hook(i)) for i, p in enumerate(self.params)]
        self._finalizer = weakref.finalize(self, _remove, handles)

    def order(self, members: list[int]) -> list[int]:
        """A bucket's members grouped by owner (stable: backward order within a rank)."""
        return sorted(members, key=lambda i: self.owners[i])

    def bounds(self, b: Bucket) -> list[tuple[int, int]]:
        """Element range of each group rank's part of bucket ``b``."""
        out = self._bounds.get(b.index)
        if out is None:
            sizes = [0] * self.group.group_size
            for i in b.members:
                sizes[self.owners[i]] += self.params[i].numel()
            out, start = [], 0
            for n in sizes:
                out.append((start, start + n))
                start += n
            self._bounds[b.index] = out
        return out

    def lay_out(self, buckets: Sequence[Bucket]) -> None:
        """Place each bucket's part of this rank's shard in one tensor per dtype."""
        self._bounds.clear()
        self._offsets.clear()
        totals: dict[torch.dtype, tuple[int, int]] = {}
        for b in buckets:
            lo, hi = self.bounds(b)[self.me]
            first, total = totals.get(b.dtype, (b.index, 0))
            self._offsets[b.index] = total
            totals[b.dtype] = (first, total + hi - lo)
        self._firsts = {first: total for first, total in totals.values()}

    def issue(self, b: Bucket, inline: bool) -> torch.futures.Future[Any]:
        """Reduce-scatter the gradients of ``b`` (average), in this thread when ``inline``,
        else queued; every member must have a ``.grad``, which is released."""
        lo, hi = self.bounds(b)[self.me]
        if b.index in self._firsts:  # one allocation per backward and dtype, not per bucket
            self._shard[b.dtype] = torch.empty(self._firsts[b.index], dtype=b.dtype)
        at = self._offsets[b.index]
        out = self._shard[b.dtype][at:at + hi - lo]
        self._outputs[b.index] = out
        shares = []
        for r in range(self.group.group_size):
            grads = [self.params[i].grad for i in b.members if self.owners[i] == r]
            flat = [g.reshape(-1) for g in grads if g is not None]
            shares.append(flat[0] if len(flat) == 1 else torch.cat(flat) if flat
                          else torch.empty(0, dtype=b.dtype))
        for i in b.members:
            self.params[i].grad = None  # alive in ``shares`` until the reduction has read it
        work = reduce_scatter(out, shares, op=ReduceOp.AVG, group=self.group,
                              async_op=not inline)
        if work is not None:
            return work.get_future()
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result([out])
        return done

    def write_back(self, b: Bucket, unused: set[int], factor: float | None) -> None:
        """Point each owned parameter's ``.grad`` at its slice of the reduced shard."""
        out = self._outputs.pop(b.index)
        if factor is not None:
            out.mul_(factor)
        offset = 0
        with torch.no_grad():
            for i in b.members:
                if self.owners[i] != self.me:
                    continue
                p = self.params[i]
                n = p.numel()
                stash = self._stash.pop(i, None)
                if i in unused:  # no rank produced a gradient: keep what there was
                    if stash is not None:
                        p.grad = stash
                else:
                    view = out[offset:offset + n].view(p.shape)
                    if stash is not None:
                        view.add_(stash)
                    p.grad = view
                    self._given[i] = weakref.ref(view)
                offset += n

    def done(self) -> None:
        """The backward is over: the shard lives on in the owned parameters' ``.grad``."""
        self._shard.clear()

    def forget(self) -> None:
        """Drop accumulation state (a joined rank's shadow backward starts from zero)."""
        self._given.clear()
        self._stash.clear()

    def _before_accumulate(self, i: int) -> None:
        ref = self._given.pop(i, None)
        p = self.params[i]
        if ref is not None and p.grad is not None and ref() is p.grad:
            # the last synchronised result was never cleared: keep it aside, so that
            # the ranks' contributions hold only new gradients (see the module docstring)
            self._stash[i] = p.grad
            p.grad = None

    def close(self) -> None:
        self._finalizer()


def _remove(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
