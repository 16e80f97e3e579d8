"""Looking inside a forward's outputs: the tensors they hold, the parameters they reach.

:func:`find_tensors` digs tensors out of nested containers (DDP and DataParallel
take any output structure); :func:`reachable_parameters` walks the autograd graph
back from them, which is how DDP's ``find_unused_parameters`` predicts the
parameters a backward cannot reach.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import torch

__all__ = ["find_tensors", "reachable_leaves", "reachable_parameters"]


def find_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (nested lists, tuples, dicts, dataclasses)."""
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            stack.extend(getattr(o, f.name) for f in dataclasses.fields(o))
    return out


def reachable_leaves(outputs: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf tensor requiring grad that backward from ``outputs`` reaches, once each
    (an output that is itself such a leaf included)."""
    seen: set[Any] = set()
    leaves: dict[int, torch.Tensor] = {}
    stack = []
    for t in outputs:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            leaves[id(t)] = t
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:  # AccumulateGrad
            leaves[id(variable)] = variable
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                stack.append(nxt)
    return list(leaves.values())


def reachable_parameters(outputs: Iterable[torch.Tensor]) -> set[int]:
    """``id()`` of every leaf tensor whose gradient backward from ``outputs`` can reach."""
    return {id(t) for t in reachable_leaves(outputs)}
