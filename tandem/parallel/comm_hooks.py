"""Communication hooks for ``DistributedDataParallel.register_comm_hook``.

A hook is ``hook(state, bucket) -> torch.futures.Future[Any]`` whose value is the reduced
flat bucket (``bucket.buffer()`` or a tensor of the same size)::

    from tandem.parallel import comm_hooks
    ddp.register_comm_hook(None, comm_hooks.fp16_compress_hook)      # half the bytes
    state = comm_hooks.PowerSGDState(None, matrix_approximation_rank=2)
    ddp.register_comm_hook(state, comm_hooks.powerSGD_hook)           # low-rank
    ddp.register_comm_hook(state, comm_hooks.fp16_compress_wrapper(comm_hooks.powerSGD_hook))

``state`` of the simple hooks is the process group to use (None: the default
group). Hooks issue only ``async_op=True`` collectives and must never block on a
future inside a callback: callbacks run on the group's progress thread, which is
the thread that would have to complete it. DDP runs hooks one bucket at a time,
so a hook may chain several collectives.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from tandem.collectives.api import all_reduce
from tandem.collectives.reduce_op import ReduceOp
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.errors import ArgumentError
from tandem.parallel._buckets import GradBucket
from tandem.parallel._powersgd import PowerSGDState, powerSGD_hook

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
           "fp16_compress_wrapper", "bf16_compress_wrapper", "PowerSGDState", "powerSGD_hook",
           "GradBucket"]


def _group(state: Any) -> AnyGroup | None:
    # torch passes the process group as the state of the simple hooks
    group: AnyGroup | None = getattr(state, "process_group", state)
    return group


def allreduce_hook(process_group: AnyGroup | None, bucket: GradBucket) -> torch.futures.Future[Any]:
    """Average the bucket over the group (what DDP does without a hook)."""
    buf = bucket.buffer()
    work = all_reduce(buf, op=ReduceOp.AVG, group=_group(process_group), async_op=True)
    assert work is not None
    return work.get_future().then(lambda f: f.value()[0])


def _compress_hook(dtype: torch.dtype, state: Any, bucket: GradBucket) -> torch.futures.Future[Any]:
    group = _group(state)
    size = resolve_group(group, "comm hook").group_size
    buf = bucket.buffer()
    # divide before summing: the half-precision sum of many ranks could overflow
    compressed = buf.to(dtype).div_(size)
    work = all_reduce(compressed, op=ReduceOp.SUM, group=group, async_op=True)
    assert work is not None

    def decompress(f: torch.futures.Future[Any]) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: AnyGroup | None,
                       bucket: GradBucket) -> torch.futures.Future[Any]:
    """Send the bucket as float16 (half the bytes), average, and cast back."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: AnyGroup | None,
                       bucket: GradBucket) -> torch.futures.Future[Any]:
    """Send the bucket as bfloat16 (half the bytes, float32's range), average, cast back."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


Hook = Callable[[Any, GradBucket], "torch.futures.Future[Any]"]


class _CastBucket(GradBucket):
    """``bucket`` seen through a copy of its buffer in another dtype: what a wrapped hook
    reduces (its gradients are views of the copy, shaped like the parameters)."""

    def __init__(self, bucket: GradBucket, buf: torch.Tensor) -> None:
        # no GradBucket.__init__: every method is overridden to answer from ``bucket``
        self._outer = bucket
        self._buf = buf
        self._views = [buf[o:o + n].view(g.shape) for o, n, g in
                       zip(bucket.offsets(), bucket.lengths(), bucket.gradients())]

    def index(self) -> int:
        return self._outer.index()

    def buffer(self) -> torch.Tensor:
        return self._buf

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buf.copy_(tensor.reshape(-1))

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def parameters(self) -> list[torch.Tensor]:
        return self._outer.parameters()

    def is_last(self) -> bool:
        return self._outer.is_last()

    def offsets(self) -> list[int]:
        return self._outer.offsets()

    def lengths(self) -> list[int]:
        return self._outer.lengths()

    def __repr__(self) -> str:
        return f"<GradBucket {self.index()}: {self._buf.numel()} x {self._buf.dtype}, cast>"


def _compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    if not callable(hook):
        raise ArgumentError(f"a compress wrapper wraps a communication hook, got {hook!r}")

    def wrapped(state: Any, bucket: GradBucket) -> torch.futures.Future[Any]:
        buf = bucket.buffer()
        fut = hook(state, _CastBucket(bucket, buf.to(dtype)))

        def decompress(f: torch.futures.Future[Any]) -> torch.Tensor:
            value = f.value()
            buf.copy_(value[0] if isinstance(value, (list, tuple)) else value)
            return buf

        return fut.then(decompress)

    short = "fp16" if dtype == torch.float16 else "bf16"
    wrapped.__name__ = f"{short}_compress_wrapper({getattr(hook, '__name__', hook)})"
    return wrapped


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """``hook`` run on a float16 copy of each bucket (PowerSGD on half the bytes, say);
    its result is cast back into the bucket."""
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """``hook`` run on a bfloat16 copy of each bucket; its result is cast back."""
    return _compress_wrapper(torch.bfloat16, hook)
