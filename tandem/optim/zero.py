"""``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of 1/N of the parameters.

Same constructor and behaviour as ``torch.distributed.optim.ZeroRedundancyOptimizer``::

    import tandem as dist
    from tandem.optim import ZeroRedundancyOptimizer
    from tandem.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    model = DDP(net)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()            # this rank's shard, then every rank gets every update

    opt.consolidate_state_dict(to=0)        # on every rank
    if dist.get_rank() == 0:
        torch.save(opt.state_dict(), "opt.pt")   # loads into torch.optim.Adam as well

The parameters are partitioned as torch does (see ``_layout``); ``opt.optim`` is the
local ``optimizer_class`` over this rank's shard. After the local step the updated
parameters travel with ``all_gather`` on flat pieces (``_exchange``), not one
broadcast per parameter. ``parameters_as_bucket_view=True`` moves the trainable
parameters into one flat buffer so that they travel in place, without packing.

With tandem's DDP there is more (``tandem.optim._zero_ddp``): ``overlap_with_ddp=True`` with
``hook_with_zero_step`` runs the step inside DDP's gradient synchronisation, and
:func:`~tandem.optim.shard_gradients` keeps only this rank's gradients (ZeRO-2).
With ``overlap_with_ddp`` tandem updates the parameters from the first iteration
(torch skips the first two while DDP settles its buckets; tandem's never change).

Parameters must live on the CPU and be dense; dtypes may differ. Every rank must
pass the same parameters (checked at construction and by ``add_param_group``).
How shards of the state are gathered and split for the state dicts is in ``_zero_state``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.optim import Optimizer

from tandem.algorithms.join import GroupJoinable, Join, Joinable, JoinHook
from tandem.collectives.checks import bool_arg
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.world import resolve_group
from tandem.errors import ArgumentError, StateError
from tandem.optim import _zero_state
from tandem.optim._exchange import Exchange
from tandem.optim._layout import FlatParams, greedy_owners, locations
from tandem.parallel._module_sync import verify_same_model

__all__ = ["ZeroRedundancyOptimizer"]


def copy_hyperparameters(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    """Every setting but ``params`` from each group of ``src`` to the same group of ``dst``."""
    for a, b in zip(src, dst):
        for key, value in a.items():
            if key != "params":
                b[key] = value


class ZeroRedundancyOptimizer(Optimizer, GroupJoinable):
    """Wrap ``optimizer_class`` so that each rank steps and stores only its shard."""

    join_kwargs = frozenset[str]()

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer],
                 process_group: ProcessGroup | NonMemberGroup | None = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        bool_arg(parameters_as_bucket_view, "ZeroRedundancyOptimizer", "parameters_as_bucket_view")
        bool_arg(overlap_with_ddp, "ZeroRedundancyOptimizer", "overlap_with_ddp")
        if isinstance(params, torch.Tensor):
            raise ArgumentError("ZeroRedundancyOptimizer: params must be an iterable of "
                                "tensors or of parameter-group dicts, not one tensor")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise ArgumentError(f"ZeroRedundancyOptimizer: optimizer_class must be a "
                                f"torch.optim.Optimizer subclass, got {optimizer_class!r}")
        if overlap_with_ddp and issubclass(optimizer_class, torch.optim.LBFGS):
            raise ArgumentError("ZeroRedundancyOptimizer(overlap_with_ddp=True) steps each DDP "
                                "bucket on its own, which needs an optimizer that updates each "
                                "parameter from its own gradient; LBFGS re-evaluates the whole "
                                "model")
        self.initialized = False
        self.process_group = resolve_group(process_group, "ZeroRedundancyOptimizer")
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        g = self.process_group
        self.world_size = g.group_size
        self.rank = g.group_rank
        self.global_rank = g.ranks[g.group_rank]
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._overlap_with_ddp = bool(overlap_with_ddp)
        self._optimizer_class = optimizer_class
        self._defaults = defaults
        self._consolidation = _zero_state.Consolidation()
        self._steps = 0
        self._grads_sharded = False
        self._clip_now: tuple[float, float] | None = None  # clip_grad_norm_ of this step
        self._clip_last: tuple[float, float] | None = None  # ... of the last step
        self._flat: FlatParams | None = None
        self.layout_version = 0  # bumped whenever the parameters move or change owner
        self._check_params(self.param_groups)
        owners = greedy_owners([grp["params"] for grp in self.param_groups], self.world_size)
        self._owners = [o for group_owners in owners for o in group_owners]
        self.optim: Optimizer = optimizer_class(self._local_groups(), **defaults)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._trainable = self._trainable_mask()
        self._build_exchange()
        self.initialized = True

    # -- who owns what -----------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for grp in self.param_groups for p in grp["params"]]

    def _local_groups(self) -> list[dict[str, Any]]:
        out, at = [], 0
        for grp in self.param_groups:
            n = len(grp["params"])
            mine = [p for p, o in zip(grp["params"], self._owners[at:at + n]) if o == self.rank]
            out.append({**{k: v for k, v in grp.items() if k != "params"}, "params": mine})
            at += n
        return out

    def owner_of(self, param: torch.Tensor) -> int:
        """The group rank that updates ``param``."""
        for p, o in zip(self._params(), self._owners):
            if p is param:
                return o
        raise ArgumentError("ZeroRedundancyOptimizer.owner_of: the tensor is not one of its "
                            "parameters")

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for p in self._params()]

    def _check_params(self, groups: list[dict[str, Any]]) -> None:
        entries = []
        for gi, grp in enumerate(groups):
            for i, p in enumerate(grp["params"]):
                where = f"group {gi} parameter {i}"
                if p.device.type != "cpu" or p.layout != torch.strided:
                    raise ArgumentError(f"ZeroRedundancyOptimizer: {where} is a {p.layout} "
                                        f"tensor on {p.device}; tandem shards dense CPU tensors")
                entries.append(("parameter", where, tuple(p.shape),
                                f"{str(p.dtype).replace('torch.', '')}"
                                f"{'' if p.requires_grad else ' frozen'}"))
        verify_same_model(self.process_group, entries, "ZeroRedundancyOptimizer")

    def _build_exchange(self) -> None:
        """Lay out the trainable parameters and plan how they travel from their owners."""
        params = [p for p, t in zip(self._params(), self._trainable) if t]
        owners = [o for o, t in zip(self._owners, self._trainable) if t]
        if self._flat is not None:
            self._flat.release()
            self._flat = None
        if self.parameters_as_bucket_view and params:
            self._flat = FlatParams(params, owners)
            self._where, self._bases = self._flat.where, [self._flat.buffer]
        else:
            self._where, self._bases = locations(params)
        self._sent = {id(p): (i, o) for i, (p, o) in enumerate(zip(params, owners))}
        self._exchange = self.exchange_for(params)
        self.layout_version += 1

    def exchange_for(self, params: list[torch.Tensor]) -> Exchange:
        """The plan that sends these trainable parameters (a DDP bucket's, say)."""
        picked = [self._sent[id(p)] for p in params if id(p) in self._sent]
        return Exchange([params[k] for k, p in enumerate(params) if id(p) in self._sent],
                        [o for _, o in picked], [self._where[i] for i, _ in picked],
                        self._bases, self.process_group)

    def param_owners(self) -> list[tuple[torch.Tensor, int]]:
        """Every parameter, group by group, with the group rank that updates it."""
        return list(zip(self._params(), self._owners))

    def repartition(self, owners: Sequence[int]) -> None:
        """Give parameter ``i`` (in :meth:`param_owners` order) to group rank ``owners[i]``
        and rebuild the local optimizer over this rank's new shard. Call it on every rank
        with the same owners, before the first step: ``hook_with_zero_step`` gives each DDP
        bucket wholly to one rank this way."""
        count = len(self._owners)
        if len(owners) != count:
            raise ArgumentError(f"ZeroRedundancyOptimizer.repartition: {len(owners)} owner(s) "
                                f"for {count} parameter(s); give one group rank per parameter")
        bad = [o for o in owners if isinstance(o, bool) or not isinstance(o, int)
               or not 0 <= o < self.world_size]
        if bad:
            raise ArgumentError(f"ZeroRedundancyOptimizer.repartition: owner {bad[0]!r} is not "
                                f"a group rank in [0, {self.world_size})")
        if self.has_stepped:
            raise StateError("ZeroRedundancyOptimizer.repartition: the optimizer has state "
                             "(a step ran, or a state dict was loaded), which stays with the "
                             "old owners; repartition before the first step")
        self._owners = list(owners)
        self.optim = self._optimizer_class(self._local_groups(), **self._defaults)
        copy_hyperparameters(self.param_groups, self.optim.param_groups)
        self._build_exchange()

    # -- torch.optim.Optimizer ----------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (on every rank); it is partitioned like the first ones."""
        super().add_param_group(param_group)
        if not self.initialized:
            return  # Optimizer.__init__ adding the constructor's groups
        self._check_params(self.param_groups)
        new = self.param_groups[-1]["params"]
        sizes = [0] * self.world_size
        for p, o in zip(self._params(), self._owners):
            sizes[o] += p.numel()
        self._owners += greedy_owners([new], self.world_size, start=sizes)[0]
        local = self._local_groups()[-1]
        self.optim.add_param_group(local)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._trainable = self._trainable_mask()
        self._build_exchange()

    def step(self, closure: Callable[[], float] | None = None,  # type: ignore[override]
             **kwargs: Any) -> float | None:
        """Step this rank's shard (``closure`` and ``kwargs`` go to the local optimizer),
        then send every rank the updated parameters."""
        if self._overlap_with_ddp:
            warnings.warn("ZeroRedundancyOptimizer(overlap_with_ddp=True): the step runs "
                          "inside DDP's backward (hook_with_zero_step); step() does nothing",
                          stacklevel=2)
            return None
        Join.notify_join_context(self)
        loss = self._local_step(closure, **kwargs)
        self._exchange.run()
        self.end_step()
        return loss

    def end_step(self) -> None:
        """Count a step that ran outside :meth:`step`: ``hook_with_zero_step`` steps inside
        DDP's backward and calls this when the backward ends (a state consolidated before
        it is then stale)."""
        self._steps += 1
        self._clip_last, self._clip_now = self._clip_now, None

    def _local_step(self, closure: Callable[[], float] | None = None,
                    **kwargs: Any) -> float | None:
        trainable = self._trainable_mask()
        if trainable != self._trainable:  # requires_grad changed: new exchange plan
            self._trainable = trainable
            self._build_exchange()
        copy_hyperparameters(self.param_groups, self.optim.param_groups)  # LR schedulers
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            loss = self.optim.step(closure=closure, **kwargs)
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        return loss

    @property
    def has_stepped(self) -> bool:
        """True once the optimizer has state: a step ran, or a state dict was loaded."""
        return self._steps > 0 or bool(self.optim.state)

    @property
    def overlap_with_ddp(self) -> bool:
        """Built with ``overlap_with_ddp=True``: the step runs inside DDP's backward."""
        return self._overlap_with_ddp

    @property
    def gradients_sharded(self) -> bool:
        """True once ``shard_gradients`` made DDP keep only this rank's gradients."""
        return self._grads_sharded

    def use_sharded_gradients(self) -> None:
        """Note that DDP keeps on this rank only the gradients of the parameters it owns
        (``shard_gradients`` calls it): :meth:`clip_grad_norm_` then takes the norm over
        every rank's share."""
        self._grads_sharded = True

    # -- state dicts (torch's format; see _zero_state) ------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on group rank ``to``.

        Call it on every rank; then ``state_dict()`` works on rank ``to``.
        """
        _zero_state.check_destination(to, self.process_group)
        copy_hyperparameters(self.param_groups, self.optim.param_groups)
        self._consolidation.gather(self.optim, self.process_group, to, self._steps)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, as the plain ``optimizer_class`` would give it.

        Only on the rank that ``consolidate_state_dict(to=...)`` gathered it on, and only
        until the next step.
        """
        self._consolidation.require_current(self.rank, self._steps)
        return self._consolidation.merged(Optimizer.state_dict(self), self._owners)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of the plain optimizer's format; this rank keeps its shard."""
        self.optim.load_state_dict(_zero_state.local_state_dict(
            state_dict, self.param_groups, self._owners, self.rank))
        copy_hyperparameters(self.optim.param_groups, self.param_groups)
        self._consolidation.forget()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their norm over all parameters (all ranks) is at
        most ``max_norm``; return that norm. Needed with sharded gradients, where no
        rank holds them all (``torch.nn.utils.clip_grad_norm_`` would see 1/N of them).

        Under ``Join`` a joined rank repeats the clipping of its last step (its shard of
        the gradients counts in the norm).
        """
        if self._overlap_with_ddp:
            raise StateError("ZeroRedundancyOptimizer.clip_grad_norm_: with overlap_with_ddp "
                             "the step runs inside backward, before clipping could change the "
                             "gradients; clip inside a communication hook, or do not overlap")
        self._clip_now = (float(max_norm), float(norm_type))
        params = self._params()
        if not self._grads_sharded:  # every rank holds every gradient
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        grads = [p.grad for p, o in zip(params, self._owners)
                 if o == self.rank and p.grad is not None]
        return _zero_state.clip_sharded(grads, max_norm, norm_type, self.process_group)

    # -- Join -----------------------------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """A joined rank steps its shard with the gradients DDP's shadow gave it, and sends
        its parameters like the others (nothing more with ``overlap_with_ddp``)."""
        return _ZeroJoinHook(self)


class _ZeroJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        zero = self.zero
        if zero._overlap_with_ddp:
            return  # DDP's shadow backward ran the step (tandem.optim._zero_ddp)
        if zero._clip_last is not None:  # the ranks still training clip: take part
            zero.clip_grad_norm_(*zero._clip_last)
        zero._local_step()
        zero._exchange.run()
        zero.end_step()
