"""ZeroRedundancyOptimizer's state dicts: the plain optimizer's format, gathered from shards.

``consolidate_state_dict(to)`` gathers every rank's local ``optimizer_class`` state on
one rank (a :class:`Consolidation`, which the optimizer owns); ``state_dict()`` there
returns what ``optimizer_class`` over all parameters would return (state keyed by the
global parameter index, the same ``param_groups``), so it loads into the plain
optimizer, and a plain optimizer's state dict loads into ``load_state_dict``, which
keeps the entries of this rank's shard (:func:`local_state_dict`).

Beyond torch: ``state_dict()`` refuses a consolidation that later steps have made
stale (torch returns the old state), and ``load_state_dict`` leaves the caller's
dict as it was (torch blanks the entries of other ranks' parameters in it).
:func:`clip_sharded` is ``clip_grad_norm_`` over gradients that no rank holds whole.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

import torch

from tandem.collectives.api import all_reduce
from tandem.collectives.group import ProcessGroup
from tandem.collectives.objects import gather_object
from tandem.collectives.reduce_op import ReduceOp
from tandem.errors import ArgumentError, StateError

__all__ = ["Consolidation", "check_destination", "local_state_dict", "clip_sharded"]


def local_positions(owners: Sequence[int], rank: int) -> list[int]:
    """Global indices of ``rank``'s parameters, in its local optimizer's order."""
    return [i for i, o in enumerate(owners) if o == rank]


def check_destination(to: object, group: ProcessGroup) -> None:
    if not isinstance(to, int) or not 0 <= to < group.group_size:
        raise ArgumentError(f"consolidate_state_dict: to={to!r} must be a group rank in "
                            f"[0, {group.group_size})")


class Consolidation:
    """The shards of optimizer state the last ``consolidate_state_dict`` gathered on this
    rank (none on the other ranks), and the step count they were taken at."""

    def __init__(self) -> None:
        self.shards: list[dict[str, Any]] = []
        self.at_step = -1

    def gather(self, local: torch.optim.Optimizer, group: ProcessGroup, to: int,
               step: int) -> None:
        """Gather every rank's ``local.state_dict()`` on group rank ``to`` (on every rank)."""
        mine = local.state_dict()
        gathered: list[Any] | None = [None] * group.group_size if group.group_rank == to else None
        gather_object(mine, gathered, dst=group.ranks[to], group=group)
        if gathered is None:
            self.shards = []
        else:
            gathered[to] = mine
            self.shards = gathered
        self.at_step = step

    def forget(self) -> None:
        self.shards = []

    def require_current(self, rank: int, step: int) -> None:
        """Refuse a state dict on a rank that gathered nothing, or gathered before the
        optimizer's ``step``-th step."""
        if not self.shards:
            raise StateError(
                f"ZeroRedundancyOptimizer.state_dict: the optimizer state has not been "
                f"consolidated on this rank; call consolidate_state_dict(to={rank}) on every "
                f"rank first")
        if self.at_step != step:
            raise StateError(
                f"ZeroRedundancyOptimizer.state_dict: the state was consolidated "
                f"{step - self.at_step} step(s) ago; call consolidate_state_dict() "
                f"on every rank again to save the current state")

    def merged(self, outer: dict[str, Any], owners: Sequence[int]) -> dict[str, Any]:
        """``outer`` (the wrapper's own ``param_groups``, global indices) with the state of
        every shard, keyed by global index."""
        state: dict[int, Any] = {}
        for r, local in enumerate(self.shards):
            for k, index in enumerate(local_positions(owners, r)):
                if k in local["state"]:
                    state[index] = local["state"][k]
        outer["state"] = dict(sorted(state.items()))
        return outer


def local_state_dict(state_dict: dict[str, Any], param_groups: list[dict[str, Any]],
                     owners: Sequence[int], rank: int) -> dict[str, Any]:
    """The part of a plain optimizer's ``state_dict`` that ``rank``'s local optimizer
    loads: its parameters' state, renumbered in its own order."""
    groups = state_dict["param_groups"]
    if len(groups) != len(param_groups):
        raise ArgumentError(f"load_state_dict: the state dict has {len(groups)} parameter "
                            f"group(s), the optimizer {len(param_groups)}")
    for i, (saved, mine) in enumerate(zip(groups, param_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ArgumentError(f"load_state_dict: parameter group {i} has "
                                f"{len(saved['params'])} parameters in the state dict, "
                                f"{len(mine['params'])} in the optimizer")
    saved_ids = list(itertools.chain.from_iterable(g["params"] for g in groups))
    position = {saved_id: i for i, saved_id in enumerate(saved_ids)}
    local_index = {index: k for k, index in enumerate(local_positions(owners, rank))}
    local_state = {}
    for saved_id, value in state_dict["state"].items():
        k = local_index.get(position.get(saved_id, -1))
        if k is not None:
            local_state[k] = value
    local_groups, at, k = [], 0, 0
    for saved in groups:
        n = len(saved["params"])
        count = sum(1 for o in owners[at:at + n] if o == rank)
        local_groups.append({**{key: v for key, v in saved.items() if key != "params"},
                             "params": list(range(k, k + count))})
        at, k = at + n, k + count
    return {"state": local_state, "param_groups": local_groups}


def clip_sharded(grads: list[torch.Tensor], max_norm: float, norm_type: float,
                 group: ProcessGroup) -> torch.Tensor:
    """Scale ``grads`` (this rank's share) so that the norm over every rank's share is at
    most ``max_norm``; return that norm. Every rank of ``group`` calls it."""
    norm_type = float(norm_type)
    norms = [torch.linalg.vector_norm(g, norm_type).double() for g in grads]
    if math.isinf(norm_type):
        local = torch.stack(norms).max() if norms else torch.zeros((), dtype=torch.float64)
        all_reduce(local, op=ReduceOp.MAX, group=group)
        total = local
    else:
        local = (torch.stack(norms) ** norm_type).sum() if norms else torch.zeros(
            (), dtype=torch.float64)
        all_reduce(local, op=ReduceOp.SUM, group=group)
        total = local ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total.float()
