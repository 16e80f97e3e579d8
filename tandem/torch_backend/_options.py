"""Reading torch's per-call options: reduce ops, roots, tensors.

torch hands a process group one options object per call (``AllreduceOptions``,
``BroadcastOptions``, ...). Every field is either honoured or refused here with a
message saying what to do instead; none is ignored.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from tandem.collectives.reduce_op import ReduceOp
from tandem.errors import ArgumentError

__all__ = ["reduce_op", "premultiplied", "one_tensor", "cpu_tensors", "root_tensor_zero"]

# torch's RedOpType members by name; PREMUL_SUM sums after each rank multiplies its input
_OPS: dict[str, ReduceOp] = {
    "SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PRODUCT,
    "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX, "BAND": ReduceOp.BAND, "BOR": ReduceOp.BOR,
    "BXOR": ReduceOp.BXOR, "PREMUL_SUM": ReduceOp.SUM,
}
# looked up by the enum's integer value: the enum's .name costs microseconds per call
_RED_OP_TYPE = dist.ReduceOp.RedOpType
_BY_VALUE = {v.value: (_OPS[n], n == "PREMUL_SUM") for n, v in _RED_OP_TYPE.__members__.items()
             if n in _OPS}

_ACCELERATOR_HINT = ("the 'tandem' torch backend moves CPU tensors; copy the tensor to the CPU, "
                     "or run accelerator collectives on a group of their own backend, e.g. "
                     "torch.distributed.new_group(backend='nccl')")


_TORCH_OP = dist.ReduceOp
_TORCH_SUM = dist.ReduceOp.SUM
_SUM: tuple[ReduceOp, None] = (ReduceOp.SUM, None)


def reduce_op(op: Any, what: str) -> tuple[ReduceOp, float | torch.Tensor | None]:
    """tandem's reduce op for torch's ``op``, and PREMUL_SUM's factor (None otherwise)."""
    if type(op) is _TORCH_OP and op == _TORCH_SUM:  # the common case, in a third of the time
        return _SUM
    kind = getattr(op, "op", op)  # a ReduceOp carries its RedOpType in .op
    found = _BY_VALUE.get(kind.value) if isinstance(kind, _RED_OP_TYPE) else None
    if found is None:
        raise ArgumentError(f"{what}: reduce op {op!r} is not one of torch's ReduceOp values")
    mapped, premul = found
    if not premul:
        return mapped, None
    factor = op.factor
    if isinstance(factor, torch.Tensor) and (factor.numel() != 1 or factor.device.type != "cpu"):
        raise ArgumentError(f"{what}: PREMUL_SUM's factor must be a number or a one-element CPU "
                            f"tensor, got a tensor of shape {list(factor.shape)} on "
                            f"{factor.device}")
    return mapped, factor


def premultiplied(t: torch.Tensor, factor: float | torch.Tensor | None,
                  in_place: bool) -> torch.Tensor:
    """``t`` times PREMUL_SUM's ``factor`` (in place when ``t`` is also the output)."""
    if factor is None:
        return t
    with torch.no_grad():
        return t.mul_(factor) if in_place else t * factor


def cpu_tensors(tensors: Sequence[Any], what: str, name: str) -> None:
    for i, t in enumerate(tensors):
        if isinstance(t, torch.Tensor) and not t.is_cpu:
            raise ArgumentError(f"{what}: {name}[{i}] is on {t.device}; {_ACCELERATOR_HINT}")


def one_tensor(tensors: Any, what: str, name: str = "tensors") -> torch.Tensor:
    """The single tensor of torch's one-tensor-per-process list."""
    if type(tensors) is list and len(tensors) == 1:  # what torch passes: the fast path
        t = tensors[0]
        if isinstance(t, torch.Tensor) and t.is_cpu:
            return t
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    if not isinstance(tensors, (list, tuple)) or len(tensors) != 1:
        count = len(tensors) if isinstance(tensors, (list, tuple)) else type(tensors).__name__
        raise ArgumentError(f"{what}: {name} must hold exactly one tensor, got {count}; one "
                            f"process drives one device, as torch.distributed requires")
    cpu_tensors(tensors, what, name)
    return tensors[0]


def root_tensor_zero(opts: Any, what: str) -> None:
    if opts.rootTensor != 0:
        raise ArgumentError(f"{what}: rootTensor={opts.rootTensor}; each process passes one "
                            f"tensor, so it must be 0")
