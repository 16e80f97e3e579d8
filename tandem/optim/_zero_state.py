"""ZeroRedundancyOptimizer's state dicts: the plain optimizer's format, gathered from shards.

``consolidate_state_dict(to)`` gathers every rank's local ``optimizer_class`` state on
one rank; ``state_dict()`` there returns what ``optimizer_class`` over all parameters
would return (state keyed by the global parameter index, the same ``param_groups``),
so it loads into the plain optimizer, and a plain optimizer's state dict loads into
``load_state_dict``, which keeps the entries of this rank's shard.

Beyond torch: ``state_dict()`` refuses a consolidation that later steps have made
stale (torch returns the old state), and ``load_state_dict`` leaves the caller's
dict as it was (torch blanks the entries of other ranks' parameters in it).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Any

import torch

from tandem.collectives.api import all_reduce
from tandem.collectives.objects import gather_object
from tandem.collectives.reduce_op import ReduceOp
from tandem.errors import ArgumentError, StateError

if TYPE_CHECKING:
    from tandem.optim.zero import ZeroRedundancyOptimizer

__all__ = ["consolidate_state_dict", "state_dict", "load_state_dict", "clip_grad_norm"]


def _local_positions(zero: "ZeroRedundancyOptimizer", rank: int) -> list[int]:
    """Global indices of ``rank``'s parameters, in its local optimizer's order."""
    return [i for i, o in enumerate(zero._owners) if o == rank]


def consolidate_state_dict(self: "ZeroRedundancyOptimizer", to: int = 0) -> None:
    """Gather every rank's shard of the optimizer state on group rank ``to``.

    Call it on every rank; then ``state_dict()`` works on rank ``to``.
    """
    from tandem.optim.zero import copy_hyperparameters

    g = self.process_group
    if not isinstance(to, int) or not 0 <= to < g.group_size:
        raise ArgumentError(f"consolidate_state_dict: to={to!r} must be a group rank in "
                            f"[0, {g.group_size})")
    copy_hyperparameters(self.param_groups, self.optim.param_groups)
    mine = self.optim.state_dict()
    gathered: list[Any] | None = [None] * g.group_size if g.group_rank == to else None
    gather_object(mine, gathered, dst=g.ranks[to], group=g)
    if gathered is None:
        self._all_state_dicts = []
    else:
        gathered[to] = mine
        self._all_state_dicts = gathered
    self._consolidated_at = self._steps


def state_dict(self: "ZeroRedundancyOptimizer") -> dict[str, Any]:
    """The whole optimizer state, as the plain ``optimizer_class`` would give it.

    Only on the rank that ``consolidate_state_dict(to=...)`` gathered it on, and only
    until the next step.
    """
    if not self._all_state_dicts:
        raise StateError(
            f"ZeroRedundancyOptimizer.state_dict: the optimizer state has not been "
            f"consolidated on this rank; call consolidate_state_dict(to={self.rank}) on every "
            f"rank first")
    if self._consolidated_at != self._steps:
        raise StateError(
            f"ZeroRedundancyOptimizer.state_dict: the state was consolidated "
            f"{self._steps - self._consolidated_at} step(s) ago; call consolidate_state_dict() "
            f"on every rank again to save the current state")
    out = torch.optim.Optimizer.state_dict(self)  # param_groups with global indices
    state: dict[int, Any] = {}
    for rank, local in enumerate(self._all_state_dicts):
        for k, index in enumerate(_local_positions(self, rank)):
            if k in local["state"]:
                state[index] = local["state"][k]
    out["state"] = dict(sorted(state.items()))
    return out


def load_state_dict(self: "ZeroRedundancyOptimizer", state_dict: dict[str, Any]) -> None:
    """Load a state dict of the plain optimizer's format; this rank keeps its shard."""
    from tandem.optim.zero import copy_hyperparameters

    groups = state_dict["param_groups"]
    if len(groups) != len(self.param_groups):
        raise ArgumentError(f"load_state_dict: the state dict has {len(groups)} parameter "
                            f"group(s), the optimizer {len(self.param_groups)}")
    for i, (saved, mine) in enumerate(zip(groups, self.param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ArgumentError(f"load_state_dict: parameter group {i} has "
                                f"{len(saved['params'])} parameters in the state dict, "
                                f"{len(mine['params'])} in the optimizer")
    saved_ids = list(itertools.chain.from_iterable(g["params"] for g in groups))
    position = {saved_id: i for i, saved_id in enumerate(saved_ids)}
    local_index = {index: k for k, index in enumerate(_local_positions(self, self.rank))}
    local_state = {}
    for saved_id, value in state_dict["state"].items():
        k = local_index.get(position.get(saved_id, -1))
        if k is not None:
            local_state[k] = value
    local_groups, at, k = [], 0, 0
    for saved in groups:
        n = len(saved["params"])
        count = sum(1 for o in self._owners[at:at + n] if o == self.rank)
        local_groups.append({**{key: v for key, v in saved.items() if key != "params"},
                             "params": list(range(k, k + count))})
        at, k = at + n, k + count
    self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
    copy_hyperparameters(self.optim.param_groups, self.param_groups)
    self._all_state_dicts = []


def clip_grad_norm(self: "ZeroRedundancyOptimizer", max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    params = [p for grp in self.param_groups for p in grp["params"]]
    if not self._grads_sharded:  # every rank holds every gradient
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    norm_type = float(norm_type)
    grads = [p.grad for p, o in zip(params, self._owners)
             if o == self.rank and p.grad is not None]
    norms = [torch.linalg.vector_norm(g, norm_type).double() for g in grads]
    if math.isinf(norm_type):
        local = torch.stack(norms).max() if norms else torch.zeros((), dtype=torch.float64)
        all_reduce(local, op=ReduceOp.MAX, group=self.process_group)
        total = local
    else:
        local = (torch.stack(norms) ** norm_type).sum() if norms else torch.zeros(
            (), dtype=torch.float64)
        all_reduce(local, op=ReduceOp.SUM, group=self.process_group)
        total = local ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total.float()
