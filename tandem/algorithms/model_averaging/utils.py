"""Averaging parameters over a group: one flat all-reduce of every parameter."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from tandem.collectives.api import all_reduce
from tandem.collectives.group import NonMemberGroup
from tandem.collectives.reduce_op import ReduceOp
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.errors import ArgumentError

__all__ = ["average_parameters", "get_params_to_average",
           "average_parameters_or_parameter_groups"]

Params = Iterable[torch.nn.Parameter] | Iterable[Mapping[str, Any]]


def average_parameters(params: Iterable[torch.Tensor], process_group: AnyGroup | None) -> None:
    """Set each of ``params`` to its mean over ``process_group`` (None: the default group).

    The parameters travel as one flat buffer (one all-reduce, and a copy of their size in
    memory); mixed dtypes are promoted in the buffer and cast back. A rank outside the
    group leaves its parameters as they are.
    """
    tensors = list(params)
    if not tensors:
        raise ArgumentError("average_parameters: params is empty; pass the parameters to "
                            "average (get_params_to_average keeps only those with a .grad)")
    if isinstance(process_group, NonMemberGroup):
        return
    group = resolve_group(process_group, "average_parameters")
    flat = torch.cat([p.detach().reshape(-1) for p in tensors])
    # divide before summing, as torch does: the same rounding, and no overflow in half
    flat /= group.group_size
    all_reduce(flat, op=ReduceOp.SUM, group=group)
    offset = 0
    with torch.no_grad():
        for p in tensors:
            # in place (torch rebinds p.data): views of the parameters stay valid
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def get_params_to_average(params: Params) -> list[torch.nn.Parameter]:
    """The parameters with a gradient, from ``model.parameters()`` or an optimizer's
    ``param_groups``: those without one took no part in the step."""
    chosen: list[torch.nn.Parameter] = []
    for item in params:
        if isinstance(item, torch.nn.Parameter):
            members: Iterable[Any] = [item]
        elif isinstance(item, Mapping) and "params" in item:
            members = item["params"]
        else:
            raise ArgumentError(f"get_params_to_average: params must hold parameters or "
                                f"parameter groups (dicts with 'params'), got an item of "
                                f"type {type(item).__name__}")
        chosen.extend(p for p in members if p.grad is not None)
    return chosen


def average_parameters_or_parameter_groups(params: Params,
                                           process_group: AnyGroup | None) -> None:
    """Average the parameters with a gradient among ``params`` (a model's parameters or an
    optimizer's parameter groups) over ``process_group``."""
    average_parameters(get_params_to_average(params), process_group)
