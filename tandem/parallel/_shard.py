"""Gradient sharding (ZeRO stage 2): each rank keeps only the gradients it optimises.

With a :class:`~tandem.optim.ZeroRedundancyOptimizer` every rank updates only the
parameters it owns, so it needs only their averaged gradients. DDP then
*reduce-scatters* each bucket instead of all-reducing it: each rank contributes, for
every rank, the gradients that rank owns in the bucket, and receives the average of
its own part. The gradients are dropped as soon as the reduction has read them, so
between steps a rank holds about 1/N of the gradients, and the reduction moves
(N-1)/N of the bucket once instead of twice.

No bucket buffer: a reduce-scatter takes one tensor per rank, so a bucket goes in
*calls*: call k takes the k-th item of every rank's share, where an item is one
large gradient as it is, or all the share's small ones (below :data:`PACK_BYTES`)
packed together; usually one or two calls per bucket, and no large gradient is ever
copied. An owned parameter's ``.grad`` is a view of this backward's reduced shard (one
tensor per dtype, laid out bucket by bucket, item by item).

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

__all__ = ["GradShards", "PACK_BYTES"]

PACK_BYTES = 64 << 10  # smaller gradients travel packed: a call costs more than their copy


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
        self._calls: dict[int, list[list[list[int]]]] = {}
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

    def _small(self, i: int) -> bool:
        p = self.params[i]
        return p.numel() * p.element_size() < PACK_BYTES

    def order(self, members: list[int]) -> list[int]:
        """A bucket's members grouped by owner, each rank's small ones first (stable)."""
        return sorted(members, key=lambda i: (self.owners[i], not self._small(i)))

    def calls(self, b: Bucket) -> list[list[list[int]]]:
        """``calls[k][r]``: the parameters whose gradients go to rank ``r`` in call ``k``."""
        out = self._calls.get(b.index)
        if out is None:
            items: list[list[list[int]]] = []
            for r in range(self.group.group_size):
                share = [i for i in b.members if self.owners[i] == r]
                small = [i for i in share if self._small(i)]
                items.append(([small] if small else []) + [[i] for i in share if i not in small])
            depth = max(len(x) for x in items)
            out = [[x[k] if k < len(x) else [] for x in items] for k in range(depth)]
            self._calls[b.index] = out
        return out

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
        self._calls.clear()
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
        calls = self.calls(b)
        work = None
        for k, call in enumerate(calls):
            shares = [self._flat(members, b.dtype) for members in call]
            n = shares[self.me].numel()
            # calls run in issue order: the last one completing means the bucket is done
            work = reduce_scatter(out[:n], shares, op=ReduceOp.AVG, group=self.group,
                                  async_op=not (inline and k == len(calls) - 1))
            out = out[n:]
        for i in b.members:
            self.params[i].grad = None  # alive in the calls until the reduction has read it
        if work is not None:
            return work.get_future()
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done

    def _flat(self, members: list[int], dtype: torch.dtype) -> torch.Tensor:
        grads = [self.params[i].grad for i in members]
        flat = [g.reshape(-1) for g in grads if g is not None]
        if len(flat) == 1:
            return flat[0]
        return torch.cat(flat) if flat else torch.empty(0, dtype=dtype)

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
