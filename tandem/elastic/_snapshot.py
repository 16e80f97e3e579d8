"""In-memory snapshots of the training state: what a commit keeps, what a rollback restores.

A snapshot holds copies, never references: the model's ``state_dict`` (parameters and
buffers), the optimizer's, the user's values (an object with ``state_dict`` and
``load_state_dict``, such as an LR scheduler, is kept through them; anything else is
deep-copied) and each elastic sampler's position. Restoring copies back into the live
objects (parameters keep their identity, so the optimizer still holds them) and gives
the optimizer a fresh copy: torch's ``load_state_dict`` keeps the tensors it is given,
and the optimizer's in-place updates must not reach the snapshot.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

__all__ = ["Snapshot", "clone", "capture", "restore"]


@dataclasses.dataclass
class Snapshot:
    commit: int  # the commit's number, the same on every member
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    values: dict[str, Any]
    positions: list[int]  # one per elastic sampler, in registration order

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Snapshot:
        return cls(int(data["commit"]), data["model"], data["optimizer"], data["values"],
                   [int(p) for p in data["positions"]])


def clone(obj: Any) -> Any:
    """A copy of ``obj`` whose tensors share no memory with it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone(v) for v in obj)
    return copy.deepcopy(obj)


def stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


def capture(commit: int, module: nn.Module | None, optimizer: torch.optim.Optimizer | None,
            values: dict[str, Any], positions: list[int]) -> Snapshot:
    return Snapshot(
        commit=commit,
        model={} if module is None else clone(module.state_dict()),
        optimizer=None if optimizer is None else clone(optimizer.state_dict()),
        values={k: clone(v.state_dict() if stateful(v) else v) for k, v in values.items()},
        positions=list(positions))


def restore(snap: Snapshot, module: nn.Module | None, optimizer: torch.optim.Optimizer | None,
            values: dict[str, Any]) -> dict[str, Any]:
    """Copy ``snap`` into ``module`` and ``optimizer``; return the values to set.

    Gradients are dropped: a step cut short may have left half of them behind.
    """
    if module is not None:
        with torch.no_grad():
            module.load_state_dict(snap.model)
        for p in module.parameters():
            p.grad = None
    if optimizer is not None and snap.optimizer is not None:
        optimizer.load_state_dict(clone(snap.optimizer))
    out = {}
    for name, saved in snap.values.items():
        current = values.get(name)
        if current is not None and stateful(current):
            current.load_state_dict(clone(saved))
            out[name] = current
        else:
            out[name] = clone(saved)
    return out
