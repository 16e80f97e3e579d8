"""``scatter`` inputs over devices and ``gather`` outputs back (``torch.nn.parallel`` names).

``scatter(inputs, devices, dim)`` cuts every tensor inside ``inputs`` (nested in
tuples, lists, dicts, named tuples) into ``len(devices)`` chunks along ``dim`` and
moves chunk ``i`` to ``devices[i]``; anything else is passed to every device as it is.
A batch smaller than the device list gives fewer chunks, and only that many replicas
run. ``gather(outputs, device, dim)`` concatenates the replicas' outputs on
``device``. Both are differentiable: gradients flow back through the chunks.

Devices are ``torch.device`` objects, strings (``"cpu"``, ``"cuda:1"``) or accelerator
indices (ints, as torch takes them; ``-1`` is the CPU for ``gather``). Chunks for the
CPU are views of the input; for an accelerator, copies made with ``tensor.to(device)``
on the current stream (the replica runs on that stream, see ``parallel_apply``).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from tandem.errors import ArgumentError

__all__ = ["scatter", "scatter_kwargs", "gather", "resolve_device", "DeviceLike"]

DeviceLike = int | str | torch.device


def resolve_device(device: DeviceLike, what: str = "device") -> torch.device:
    """A ``torch.device`` from what torch accepts; ints name accelerator devices."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except RuntimeError as exc:
            raise ArgumentError(f"{what}: {device!r} is not a device") from exc
    if isinstance(device, int) and not isinstance(device, bool):
        if device == -1:
            return torch.device("cpu")
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \
            else None
        if accelerator is None:
            raise ArgumentError(
                f"{what}: {device} names accelerator device {device}, but this machine has no "
                f"accelerator; pass 'cpu' entries (for example device_ids=['cpu', 'cpu']) "
                f"to run CPU replicas in threads")
        return torch.device(accelerator.type, device)
    raise ArgumentError(f"{what}: expected a device, an index or a name, got "
                        f"{type(device).__name__}")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _chunks(t: torch.Tensor, devices: Sequence[torch.device], dim: int) -> list[torch.Tensor]:
    pieces = t.chunk(len(devices), dim)
    return [p if p.device == d else p.to(d) for p, d in zip(pieces, devices)]


def _scatter(obj: Any, devices: Sequence[torch.device], dim: int) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return _chunks(obj, devices, dim)
    if _is_namedtuple(obj):
        return [type(obj)(*parts) for parts in zip(*(_scatter(x, devices, dim) for x in obj))]
    if isinstance(obj, tuple) and obj:
        return [tuple(parts) for parts in zip(*(_scatter(x, devices, dim) for x in obj))]
    if isinstance(obj, list) and obj:
        return [list(parts) for parts in zip(*(_scatter(x, devices, dim) for x in obj))]
    if isinstance(obj, dict) and obj:
        keys = list(obj)
        columns = zip(*(_scatter(obj[k], devices, dim) for k in keys))
        return [type(obj)(zip(keys, values)) for values in columns]
    return [obj for _ in devices]


def scatter(inputs: Any, target_gpus: Sequence[DeviceLike], dim: int = 0) -> list[Any]:
    """One slice of ``inputs`` per device (fewer when a tensor has fewer rows)."""
    devices = [resolve_device(d, "scatter") for d in target_gpus]
    if not devices:
        raise ArgumentError("scatter: target_gpus is empty")
    return _scatter(inputs, devices, dim)


def scatter_kwargs(inputs: tuple[Any, ...], kwargs: dict[str, Any] | None,
                   target_gpus: Sequence[DeviceLike],
                   dim: int = 0) -> tuple[tuple[Any, ...], tuple[dict[str, Any], ...]]:
    """Scatter positional and keyword inputs alike; pad the shorter list with empties."""
    parts: list[Any] = scatter(inputs, target_gpus, dim) if inputs else []
    kw_parts: list[Any] = scatter(kwargs, target_gpus, dim) if kwargs else []
    n = max(len(parts), len(kw_parts))
    parts += [() for _ in range(n - len(parts))]
    kw_parts += [{} for _ in range(n - len(kw_parts))]
    return tuple(parts), tuple(kw_parts)


def _gather(outputs: Sequence[Any], device: torch.device, dim: int) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise ArgumentError("gather: the replicas returned tensors and non-tensors in the "
                                "same place")
        tensors = [o if o.device == device else o.to(device) for o in outputs]
        if all(t.dim() == 0 for t in tensors):
            warnings.warn("gather: the replicas returned scalars; returning a vector of one "
                          "value per replica instead", stacklevel=3)
            return torch.stack(tensors)
        return torch.cat(tensors, dim)
    if first is None:
        return None
    if isinstance(first, dict):
        if any(set(o) != set(first) for o in outputs):
            raise ArgumentError("gather: the replicas returned dicts with different keys")
        return type(first)((k, _gather([o[k] for o in outputs], device, dim)) for k in first)
    if isinstance(first, (list, tuple)):
        if any(len(o) != len(first) for o in outputs):
            raise ArgumentError("gather: the replicas returned sequences of different lengths")
        columns = [_gather(col, device, dim) for col in zip(*outputs)]
        return type(first)(*columns) if _is_namedtuple(first) else type(first)(columns)
    raise ArgumentError(f"gather: cannot combine outputs of type {type(first).__name__} "
                        f"(tensors, None, and dicts/lists/tuples of them can be gathered)")


def gather(outputs: Any, target_device: DeviceLike, dim: int = 0) -> Any:
    """The replicas' ``outputs`` (one per replica) combined on ``target_device``."""
    outputs = list(outputs)
    if not outputs:
        raise ArgumentError("gather: outputs is empty")
    return _gather(outputs, resolve_device(target_device, "gather"), dim)
