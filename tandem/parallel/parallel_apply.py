"""``parallel_apply(modules, inputs)``: run each replica on its inputs, one thread each.

Each thread runs with the caller's grad mode and autocast settings (both are
per-thread in torch) and, for an accelerator replica, with the caller's current
device and stream of that device (so the replica's kernels queue behind the copies
``scatter`` made there; no stream is created). The device of replica ``i`` is
``devices[i]``, or else that of the first tensor in its inputs, or of its first
parameter. A replica that raises makes the call raise the same exception, naming
the replica; the call waits at most ``TANDEM_TIMEOUT`` seconds for the replicas
(threads are daemons: a stuck replica cannot keep the process alive).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from tandem._words import secs
from tandem.config import load_settings
from tandem.errors import ArgumentError, TimeoutError
from tandem.parallel._graph import find_tensors
from tandem.parallel.scatter_gather import DeviceLike, resolve_device

__all__ = ["parallel_apply"]


def _device_of(module: nn.Module, inputs: Any, kwargs: dict[str, Any]) -> torch.device:
    for t in find_tensors(inputs) + find_tensors(kwargs):
        return t.device
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def _settings(device: torch.device, grad: bool, autocast: list[tuple[str, bool, torch.dtype]],
              stream: torch.Stream | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        for device_type, enabled, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        if device.type != "cpu":
            stack.enter_context(torch.accelerator.device_index(device.index))
            if stream is not None:
                stack.enter_context(stream)
        yield


def parallel_apply(modules: Sequence[nn.Module], inputs: Sequence[Any],
                   kwargs_tup: Sequence[dict[str, Any]] | None = None,
                   devices: Sequence[DeviceLike | None] | None = None) -> list[Any]:
    """``[modules[i](*inputs[i], **kwargs_tup[i]) for i]``, each in a thread of its own."""
    n = len(modules)
    kwargs = list(kwargs_tup) if kwargs_tup is not None else [{} for _ in range(n)]
    where = list(devices) if devices is not None else [None] * n
    if not (len(inputs) == len(kwargs) == len(where) == n):
        raise ArgumentError(f"parallel_apply: {n} modules but {len(inputs)} inputs, "
                            f"{len(kwargs)} keyword dicts and {len(where)} devices")
    args = [x if isinstance(x, (list, tuple)) else (x,) for x in inputs]
    targets = [resolve_device(d, "parallel_apply") if d is not None
               else _device_of(m, a, k) for m, a, k, d in zip(modules, args, kwargs, where)]
    grad = torch.is_grad_enabled()
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \
        else None
    types = ["cpu"] + ([accelerator.type] if accelerator is not None else [])
    autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]
    streams = [torch.accelerator.current_stream(d) if d.type != "cpu" else None for d in targets]
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def run(i: int) -> None:
        try:
            with _settings(targets[i], grad, autocast, streams[i]):
                results[i] = modules[i](*args[i], **kwargs[i])
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
            errors[i] = exc

    if n == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(i,), daemon=True,
                                    name=f"tandem-replica-{i}") for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + load_settings().timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [i for i, t in enumerate(threads) if t.is_alive()]
        if stuck:
            raise TimeoutError(f"parallel_apply: replica(s) {stuck} still running after "
                               f"TANDEM_TIMEOUT={secs(load_settings().timeout)}s")
    for i, exc in enumerate(errors):
        if exc is not None:
            note = getattr(exc, "add_note", None)  # Python >= 3.11
            if note is not None:
                note(f"(raised by replica {i} on {targets[i]}, in parallel_apply)")
            raise exc
    return results
