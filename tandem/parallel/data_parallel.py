"""``DataParallel``: one process, the batch split over several replicas of a module.

Same constructor and behaviour as ``torch.nn.DataParallel``::

    from tandem.parallel import DataParallel
    model = DataParallel(net, device_ids=["cpu", "cpu"])   # two CPU replicas, in threads
    loss = loss_fn(model(x), y)      # x split along dim 0, outputs concatenated
    loss.backward()                  # gradients summed into net's parameters
    model.module                     # the wrapped module

Each forward: ``scatter`` the inputs (positional and keyword) along ``dim``,
``replicate`` the module on as many devices as there are chunks, ``parallel_apply``
the replicas in threads, ``gather`` the outputs on ``output_device``. Gradients reach
the original parameters because every replica's parameters are differentiable
copies of them.

``device_ids=None`` uses every accelerator device, and on a machine without one runs
the module directly, as torch does. Integer ids name accelerator devices; an explicit
list of CPU devices (``["cpu", "cpu"]``) runs CPU replicas in threads. A single device
runs the module directly. BatchNorm in training mode normalises each chunk with its
own statistics, as in torch; the first replica's running statistics are the module's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from tandem.config import at_most
from tandem.errors import ArgumentError
from tandem.parallel.parallel_apply import parallel_apply
from tandem.parallel.replicate import replicate
from tandem.parallel.scatter_gather import DeviceLike, gather, resolve_device, scatter_kwargs

__all__ = ["DataParallel", "data_parallel", "MAX_REPLICAS"]

MAX_REPLICAS = 1024  # as many threads as an RPC worker may run at once


def _all_accelerators() -> list[torch.device]:
    if not torch.accelerator.is_available():
        return []
    accelerator = torch.accelerator.current_accelerator()
    assert accelerator is not None
    return [torch.device(accelerator.type, i) for i in range(torch.accelerator.device_count())]


def _devices(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    if device_ids is None:
        return _all_accelerators()
    if isinstance(device_ids, (str, int, torch.device)):
        raise ArgumentError(f"DataParallel: device_ids must be a list of devices, got "
                            f"{device_ids!r}")
    device_ids = list(device_ids)
    # each entry is a replica and a thread per forward: 10**6 'cpu' entries were taken
    at_most("DataParallel: len(device_ids)", len(device_ids), MAX_REPLICAS,
            "replicas, each a copy of the module run in a thread of its own",
            "give one entry per device (a few CPU entries run CPU replicas in threads)")
    devices = [resolve_device(d, "DataParallel device_ids") for d in device_ids]
    if len({d.type for d in devices}) > 1:
        raise ArgumentError(f"DataParallel: device_ids mixes device types {devices}; use CPU "
                            f"devices only or accelerator devices only")
    return devices


class DataParallel(nn.Module):
    """Split each batch over replicas of ``module`` on ``device_ids``; see the module doc."""

    def __init__(self, module: nn.Module, device_ids: Sequence[DeviceLike] | None = None,
                 output_device: DeviceLike | None = None, dim: int = 0) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ArgumentError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        self.module = module
        if isinstance(dim, bool) or not isinstance(dim, int):
            # it failed inside torch.chunk at the first forward
            raise ArgumentError(f"DataParallel: dim must be an int, got {dim!r}")
        self.dim = dim
        devices = _devices(device_ids)
        self.device_ids: list[torch.device] = devices
        if not devices:  # no accelerator and no explicit list: the module runs as it is
            if output_device is not None:
                raise ArgumentError("DataParallel: output_device needs device_ids (this machine "
                                    "has no accelerator, so the module runs directly)")
            self.output_device: torch.device | None = None
            return
        self.output_device = resolve_device(output_device if output_device is not None
                                            else devices[0], "DataParallel output_device")
        self.src_device_obj = devices[0]
        if len(devices) == 1:
            module.to(devices[0])

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self.device_ids:
            return self.module(*inputs, **kwargs)
        for name, t in list(self.module.named_parameters()) + list(self.module.named_buffers()):
            if t.device != self.src_device_obj:
                raise ArgumentError(
                    f"DataParallel: '{name}' is on {t.device}; the module must live on "
                    f"device_ids[0] = {self.src_device_obj}")
        chunks, chunk_kwargs = self.scatter(inputs, kwargs, self.device_ids)
        if not chunks:  # no inputs at all: one call with nothing
            chunks, chunk_kwargs = ((),), ({},)
        if len(self.device_ids) == 1:
            return self.module(*chunks[0], **chunk_kwargs[0])
        replicas = self.replicate(self.module, self.device_ids[:len(chunks)])
        outputs = self.parallel_apply(replicas, chunks, chunk_kwargs)
        assert self.output_device is not None
        return self.gather(outputs, self.output_device)

    def scatter(self, inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
                device_ids: Sequence[DeviceLike]) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def replicate(self, module: nn.Module, device_ids: Sequence[DeviceLike]) -> list[nn.Module]:
        return replicate(module, device_ids, not torch.is_grad_enabled())

    def parallel_apply(self, replicas: Sequence[nn.Module], inputs: Sequence[Any],
                       kwargs: Sequence[dict[str, Any]]) -> list[Any]:
        return parallel_apply(replicas, inputs, kwargs, self.device_ids[:len(replicas)])

    def gather(self, outputs: Sequence[Any], output_device: DeviceLike) -> Any:
        return gather(outputs, output_device, dim=self.dim)


def data_parallel(module: nn.Module, inputs: Any, device_ids: Sequence[DeviceLike] | None = None,
                  output_device: DeviceLike | None = None, dim: int = 0,
                  module_kwargs: dict[str, Any] | None = None) -> Any:
    """``DataParallel(module, device_ids, output_device, dim)(*inputs, **module_kwargs)``
    without keeping the wrapper."""
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    return DataParallel(module, device_ids, output_device, dim)(*args, **(module_kwargs or {}))
