"""``torch.distributed.checkpoint``'s form of :func:`tandem.checkpoint.save` and ``load``::

    import tandem.checkpoint as dcp               # torch: torch.distributed.checkpoint

    state = {"app": AppState(model, optimizer)}   # anything with state_dict/load_state_dict
    dcp.save(state, checkpoint_id="ckpt/step_100")     # every rank calls it
    ...
    dcp.load(state, checkpoint_id="ckpt/step_100")     # fills ``state`` in place

``checkpoint_id`` is a directory holding one file, written by rank 0 of
``process_group`` with :func:`tandem.checkpoint.save` (atomic), since what a
data-parallel job keeps is the same on every rank; ``save`` returns on every rank once
the file is in place. ``load`` reads it on every rank and fills ``state`` as torch's
does: tensors are copied into in place (a shape or dtype that differs is refused,
naming the key), other values are replaced, and an object with ``state_dict`` and
``load_state_dict`` gets its ``load_state_dict`` called with its filled state. A key of
``state`` that the checkpoint lacks is refused, naming it; keys the checkpoint has
beyond ``state``'s are left alone. ``no_dist=True`` (or no process group) saves and
loads in this process alone. Sharded tensors are not tandem's: each tensor is saved
whole, as rank 0 holds it.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tandem.errors import ArgumentError

__all__ = ["FILE", "save", "load", "check_unsupported"]

FILE = "tandem_state.pt"  # the one file in a checkpoint_id directory


def check_unsupported(what: str, **given: Any) -> None:
    """Refuse torch's storage and planner plug-ins (tandem has one storage layout)."""
    for name, value in given.items():
        if value is not None:
            raise ArgumentError(
                f"{what}: {name}= is torch.distributed.checkpoint's plug-in for other storage "
                f"or sharding layouts; tandem writes one file per checkpoint_id directory, "
                f"so leave {name} unset")


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)) and not isinstance(value, torch.Tensor)


def _plain(state: Any) -> Any:
    """``state`` with every stateful object replaced by its state_dict()."""
    if _stateful(state):
        return _plain(state.state_dict())
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_plain(v) for v in state]
    if isinstance(state, tuple):
        return tuple(_plain(v) for v in state)
    return state


def save(state: Any, directory: str, process_group: Any, no_dist: bool) -> None:
    from tandem.checkpoint import save as save_file, save_on_rank0
    from tandem.collectives.world import is_initialized

    if not isinstance(state, dict):
        raise ArgumentError(f"checkpoint.save: the state must be a dict, got "
                            f"{type(state).__name__}")
    path = os.path.join(directory, FILE)
    if no_dist or (process_group is None and not is_initialized()):
        save_file(_plain(state), path)
    else:
        save_on_rank0(_plain(state), path, group=process_group)


def _fill(target: Any, saved: Any, key: str) -> Any:
    """``target`` loaded from ``saved`` in place where it can be; the loaded value."""
    if _stateful(target):
        target.load_state_dict(_fill(target.state_dict(), saved, key))
        return target
    if isinstance(target, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise ArgumentError(f"checkpoint.load: '{key}' is a tensor in the state but "
                                f"{type(saved).__name__} in the checkpoint")
        if saved.shape != target.shape or saved.dtype != target.dtype:
            raise ArgumentError(
                f"checkpoint.load: '{key}' is {target.dtype}{list(target.shape)} in the state "
                f"but {saved.dtype}{list(saved.shape)} in the checkpoint")
        with torch.no_grad():
            target.copy_(saved)
        return target
    if isinstance(target, dict):
        if not isinstance(saved, dict):
            raise ArgumentError(f"checkpoint.load: '{key}' is a dict in the state but "
                                f"{type(saved).__name__} in the checkpoint")
        for name in list(target):
            inner = f"{key}.{name}" if key else str(name)
            if name not in saved:
                raise ArgumentError(f"checkpoint.load: '{inner}' is in the state but not in "
                                    f"the checkpoint")
            target[name] = _fill(target[name], saved[name], inner)
        return target
    if isinstance(target, list) and isinstance(saved, list) and len(target) == len(saved):
        for i in range(len(target)):
            target[i] = _fill(target[i], saved[i], f"{key}.{i}")
        return target
    return saved  # a number, a string, a tuple...: replaced, as torch's load does


def load(state: Any, directory: str, weights_only: bool) -> None:
    from tandem.checkpoint import load as load_file

    if not isinstance(state, dict):
        raise ArgumentError(f"checkpoint.load: the state to fill must be a dict, got "
                            f"{type(state).__name__}")
    path = os.path.join(directory, FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint.load: no checkpoint in {directory} (no {FILE}; "
                                f"was it written with checkpoint.save(..., checkpoint_id=)?)")
    _fill(state, load_file(path, weights_only=weights_only), "")
