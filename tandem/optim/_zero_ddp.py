"""ZeroRedundancyOptimizer inside tandem's DDP: the step in the backward, and ZeRO-2.

``hook_with_zero_step`` (torch's ``ddp_comm_hooks.ddp_zero_hook`` name) with a
ZeroRedundancyOptimizer built with ``overlap_with_ddp=True``::

    opt = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, overlap_with_ddp=True,
                                  lr=1e-3)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, opt))
    for x, y in loader:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()     # reduces, steps this rank's shard, exchanges

When ``loss.backward()`` ends, each DDP bucket in turn is waited for, the owned
parameters of that bucket are stepped, and their exchange (``all_gather``) is queued,
so it runs while the next bucket is stepped. Buckets are reduced by DDP's own
average (on the shared-memory path, in place) when the hook is ``allreduce_hook``;
another hook (``fp16_compress_hook``) reduces the buckets instead. The local
optimizer steps once per bucket, with the other parameters' gradients hidden, so it
must update each parameter from its own gradient alone (SGD, Adam, AdamW, ...; torch
asks for a functional optimizer for the same reason).

``shard_gradients(ddp, opt)`` (tandem only, ZeRO stage 2) makes DDP reduce-scatter
each bucket so that a rank keeps only the gradients of the parameters it owns
(``tandem.parallel._shard``); it combines with both ways of stepping.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

from tandem.errors import ArgumentError, StateError
from tandem.optim._exchange import Exchange
from tandem.optim._layout import bucket_owners
from tandem.optim.zero import ZeroRedundancyOptimizer, copy_hyperparameters
from tandem.parallel._observer import ObservingHook
from tandem.parallel.ddp import DistributedDataParallel

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved", "shard_gradients"]

Hook = Callable[[Any, Any], torch.futures.Future[Any]]


def _check_pair(ddp: Any, zero: Any, what: str) -> None:
    if not isinstance(ddp, DistributedDataParallel):
        raise ArgumentError(f"{what}: ddp must be tandem's DistributedDataParallel, got "
                            f"{type(ddp).__name__}")
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise ArgumentError(f"{what}: zero must be a ZeroRedundancyOptimizer, got "
                            f"{type(zero).__name__}")
    if ddp.process_group is not zero.process_group:
        raise ArgumentError(f"{what}: DDP and the optimizer must use the same process group")
    if ddp.backward_started:
        raise StateError(f"{what}: attach before the first backward")


def _owners_of(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
               what: str) -> list[int]:
    owner = {id(p): o for p, o in zero.param_owners()}
    missing = [n for n, p in zip(ddp.reducer.names, ddp.reducer.params) if id(p) not in owner]
    if missing:
        raise ArgumentError(f"{what}: DDP trains parameter(s) {missing[:5]} that the "
                            f"optimizer does not hold; build it from ddp.parameters()")
    return [owner[id(p)] for p in ddp.reducer.params]


def shard_gradients(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer) -> None:
    """Make ``ddp`` keep on each rank only the gradients ``zero`` steps there (ZeRO-2).

    Call on every rank, before the first backward. Afterwards ``.grad`` is None for the
    parameters other ranks own; clip with ``zero.clip_grad_norm_``.
    """
    _check_pair(ddp, zero, "shard_gradients")
    if ddp.reducer.hook is not None:
        raise ArgumentError("shard_gradients: this DDP reduces with a communication hook; "
                            "sharding reduce-scatters the buckets itself and cannot use it")
    ddp.reducer.shard(_owners_of(ddp, zero, "shard_gradients"))
    zero.use_sharded_gradients()


class ZeroStepHook(ObservingHook):
    """What ``hook_with_zero_step`` returns: register it with ``ddp.register_comm_hook``."""

    def __init__(self, hook: Hook | None, ddp: DistributedDataParallel,
                 zero: ZeroRedundancyOptimizer, shard_buckets: bool) -> None:
        self.hook = hook
        self.zero = zero
        self.shard_buckets = shard_buckets
        self._ddp = weakref.ref(ddp)
        self._plans: dict[int, Exchange] = {}
        self._version = -1
        self._owner: dict[int, int] = {}
        self._pending: list[tuple[Exchange, Any]] = []

    def attach(self, ddp: Any) -> None:
        if ddp is not self._ddp() or not isinstance(ddp, DistributedDataParallel):
            raise ArgumentError("hook_with_zero_step: register the hook on the DDP it was "
                                "made for")
        zero = self.zero
        _check_pair(ddp, zero, "hook_with_zero_step")
        owners = _owners_of(ddp, zero, "hook_with_zero_step")
        trained = {id(p) for p in ddp.reducer.params}
        extra = [i for i, (p, _) in enumerate(zero.param_owners())
                 if p.requires_grad and id(p) not in trained]
        if extra:
            raise ArgumentError(f"hook_with_zero_step: the optimizer holds {len(extra)} "
                                f"trainable parameter(s) DDP does not train; with "
                                f"overlap_with_ddp both must hold the same parameters")
        if not self.shard_buckets:  # torch's default: each bucket wholly to one rank
            if zero.has_stepped:
                raise StateError("hook_with_zero_step: attach before the first step")
            by_bucket = bucket_owners([b.members for b in ddp.reducer.buckets],
                                      len(owners), zero.world_size)
            index = {id(p): o for p, o in zip(ddp.reducer.params, by_bucket)}
            zero.repartition([index.get(id(p), 0) for p, _ in zero.param_owners()])
            if zero.gradients_sharded:
                ddp.reducer.shard(_owners_of(ddp, zero, "hook_with_zero_step"))

    # -- GradObserver: called by DDP's reducer in the thread that ends backward ----------
    def _plan(self, index: int, params: Sequence[torch.Tensor]) -> Exchange:
        zero = self.zero
        if self._version != zero.layout_version:
            self._plans.clear()
            self._owner = {id(p): o for p, o in zero.param_owners()}
            self._version = zero.layout_version
        plan = self._plans.get(index)
        if plan is None:
            plan = self._plans[index] = zero.exchange_for(list(params))
        return plan

    def bucket_reduced(self, index: int, params: Sequence[torch.nn.Parameter]) -> None:
        zero = self.zero
        plan = self._plan(index, params)
        if not self._pending:  # the first bucket of this backward
            copy_hyperparameters(zero.param_groups, zero.optim.param_groups)
        mine = {id(p) for p in params if self._owner.get(id(p)) == zero.rank}
        # the local optimizer steps every parameter that has a gradient: hide the others'
        # (those of later buckets may still be being reduced)
        hidden = [(p, p.grad) for grp in zero.optim.param_groups for p in grp["params"]
                  if id(p) not in mine and p.grad is not None]
        for p, _ in hidden:
            p.grad = None
        try:
            if mine:
                zero.optim.step()
        except Exception as exc:
            # the peers are about to wait for this rank's parameters: fail them now
            zero.process_group.abort(StateError(
                f"ZeroRedundancyOptimizer step on rank {zero.global_rank} failed inside DDP's "
                f"backward: {type(exc).__name__}: {exc}"))
            raise
        finally:
            for p, g in hidden:
                p.grad = g
        self._pending.append((plan, plan.start()))

    def backward_done(self) -> None:
        zero = self.zero
        pending, self._pending = self._pending, []
        for plan, started in pending:
            plan.finish(started)
        copy_hyperparameters(zero.optim.param_groups, zero.param_groups)
        zero.end_step()


def hook_with_zero_step(hook: Hook, ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer,
                        shard_buckets: bool = False) -> ZeroStepHook:
    """A DDP communication hook that runs ``zero``'s step inside ``ddp``'s backward.

    ``hook`` reduces each bucket (``allreduce_hook`` keeps DDP's own in-place average);
    ``shard_buckets=False`` (torch's default) gives each DDP bucket wholly to one rank
    (bucket ``i`` to rank ``i % N``), ``True`` keeps the optimizer's balanced partition,
    which spreads every bucket over the ranks. Register the result with
    ``ddp.register_comm_hook(None, ...)`` before the first backward.
    """
    if not isinstance(zero, ZeroRedundancyOptimizer) or not zero.overlap_with_ddp:
        raise ArgumentError("hook_with_zero_step: the ZeroRedundancyOptimizer must be built "
                            "with overlap_with_ddp=True")
    if not callable(hook):
        raise ArgumentError("hook_with_zero_step: hook must be a communication hook")
    _check_pair(ddp, zero, "hook_with_zero_step")
    return ZeroStepHook(hook, ddp, zero, bool(shard_buckets))


def hook_with_zero_step_interleaved(hook: Hook, ddp: DistributedDataParallel,
                                    zero: ZeroRedundancyOptimizer,
                                    shard_buckets: bool = False) -> ZeroStepHook:
    """torch's variant that steps each bucket from its reduction's callback. tandem steps
    every bucket as it is reduced in the thread that ends backward, for both variants:
    its futures complete on one thread shared by the whole group, where an optimizer
    step would hold up every other completion. Results are the same."""
    return hook_with_zero_step(hook, ddp, zero, shard_buckets)
