"""``replicate(module, devices)``: one copy of a module per device, gradients flowing home.

A replica is a shallow copy of every submodule (``Module._replicate_for_data_parallel``,
which modules such as RNNs adapt) whose parameters are *differentiable copies* of the
original's: on the original's device a view (``p.view_as(p)``, no memory), elsewhere
``p.to(device)``. A backward through any replica therefore sums its gradients into
the original parameters' ``.grad``; ``detach=True`` cuts that link (for forwards
without gradients).

Buffers: the first replica shares the original's when it is on the same device, so
running statistics updated there (BatchNorm) are the module's own; the other
replicas get copies, and what they write to them is lost, as with torch.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import torch
from torch import nn

from tandem.errors import ArgumentError
from tandem.parallel.scatter_gather import DeviceLike, resolve_device

__all__ = ["replicate"]

M = TypeVar("M", bound=nn.Module)


def _copy_param(p: torch.Tensor, device: torch.device, detach: bool) -> torch.Tensor:
    src = p.detach() if detach else p
    if p.device == device:
        return src.view_as(src) if not detach else src
    return src.to(device)


def _copy_buffer(b: torch.Tensor, device: torch.device, share: bool) -> torch.Tensor:
    if share and b.device == device:
        return b
    return b.detach().clone() if b.device == device else b.detach().to(device)


def replicate(network: M, devices: Sequence[DeviceLike], detach: bool = False) -> list[M]:
    """One replica of ``network`` per entry of ``devices``."""
    targets = [resolve_device(d, "replicate") for d in devices]
    if not targets:
        raise ArgumentError("replicate: devices is empty")
    modules = list(network.modules())  # each shared submodule once
    replicas: list[M] = []
    for j, device in enumerate(targets):
        copies = {id(m): m._replicate_for_data_parallel() for m in modules}
        params: dict[int, torch.Tensor] = {}
        for m in modules:
            r = copies[id(m)]
            for name, child in m._modules.items():
                r._modules[name] = None if child is None else copies[id(child)]
            for name, p in m._parameters.items():
                if p is None:
                    setattr(r, name, None)
                    continue
                if id(p) not in params:  # tied weights stay tied
                    params[id(p)] = _copy_param(p, device, detach)
                setattr(r, name, params[id(p)])
            for name, b in m._buffers.items():
                if b is not None:
                    r._buffers[name] = _copy_buffer(b, device, share=j == 0)
        replicas.append(copies[id(network)])
    return replicas
