"""Reduce operations: the built-in ones and user-defined ones.

Every combine runs as one torch kernel on whole buffers (``torch.add(a, b, out=a)``
and friends), never as a Python loop over elements. A user-defined op is any
Python callable ``fn(a, b) -> Tensor`` that is associative and commutative::

    import tandem as dist
    absmax = dist.ReduceOp.custom(lambda a, b: torch.maximum(a.abs(), b.abs()), "ABSMAX")
    dist.all_reduce(t, op=absmax)

Combines are always applied as ``fn(lower_rank_data, higher_rank_data)``, so every
rank computes bit-identical results.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.errors import ArgumentError

__all__ = ["ReduceOp", "combine", "finish", "check_dtype"]

_BITWISE_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
# dtypes whose CPU kernels cover every combine below; torch's uint16/32/64, complex32 and
# float8 types lack add, minimum or maximum, which would fail mid-collective on the
# combining ranks only and leave the others waiting
_REDUCIBLE_DTYPES = _BITWISE_DTYPES | {torch.float64, torch.float32, torch.float16,
                                       torch.bfloat16, torch.complex64, torch.complex128}


class ReduceOp:
    """A reduce operation; compare with ``ReduceOp.SUM`` etc. as in torch."""

    SUM: "ReduceOp"
    PRODUCT: "ReduceOp"
    MIN: "ReduceOp"
    MAX: "ReduceOp"
    AVG: "ReduceOp"
    BAND: "ReduceOp"
    BOR: "ReduceOp"
    BXOR: "ReduceOp"

    __slots__ = ("name", "fn", "code")

    def __init__(self, name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 code: int) -> None:
        self.name = name
        self.fn = fn
        self.code = code

    @classmethod
    def custom(cls, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               name: str | None = None) -> "ReduceOp":
        """A user-defined reduce op from an associative, commutative ``fn(a, b)``."""
        if not callable(fn):
            raise ArgumentError(f"custom reduce op needs a callable, got {type(fn).__name__}")
        label = name or getattr(fn, "__name__", "custom")
        return cls(f"custom:{label}", fn, 100)

    def __repr__(self) -> str:
        return f"<ReduceOp.{self.name}>"


def _builtin(name: str, code: int) -> ReduceOp:
    op = ReduceOp(name, None, code)
    setattr(ReduceOp, name, op)
    return op


_builtin("SUM", 0)
_builtin("AVG", 1)
_builtin("PRODUCT", 2)
_builtin("MIN", 3)
_builtin("MAX", 4)
_builtin("BAND", 5)
_builtin("BOR", 6)
_builtin("BXOR", 7)


def check_dtype(op: ReduceOp, dtype: torch.dtype) -> None:
    """Refuse combinations torch itself cannot compute, naming both."""
    if not isinstance(op, ReduceOp):
        raise ArgumentError(f"op must be a tandem ReduceOp, got {op!r}")
    if op.fn is not None:
        return
    if dtype not in _REDUCIBLE_DTYPES:
        raise ArgumentError(f"ReduceOp.{op.name} is not supported for {dtype}; reductions take "
                            f"{sorted(str(d) for d in _REDUCIBLE_DTYPES)}")
    if op.name in ("BAND", "BOR", "BXOR") and dtype not in _BITWISE_DTYPES:
        raise ArgumentError(f"ReduceOp.{op.name} needs an integer or bool tensor, got {dtype}")
    if op.name == "AVG" and not (dtype.is_floating_point or dtype.is_complex):
        raise ArgumentError(f"ReduceOp.AVG needs a floating or complex tensor, got {dtype}")
    if op.name in ("MIN", "MAX") and dtype.is_complex:
        raise ArgumentError(f"ReduceOp.{op.name} is undefined for complex tensors ({dtype})")


def combine(op: ReduceOp, low: torch.Tensor, high: torch.Tensor, out: torch.Tensor) -> None:
    """``out = op(low, high)`` elementwise; ``out`` may alias ``low`` or ``high``."""
    name = op.name
    if op.fn is not None:
        out.copy_(op.fn(low, high))
    elif name in ("SUM", "AVG"):
        if low.dtype == torch.bool:
            torch.logical_or(low, high, out=out)
        else:
            torch.add(low, high, out=out)
    elif name == "PRODUCT":
        if low.dtype == torch.bool:
            torch.logical_and(low, high, out=out)
        else:
            torch.mul(low, high, out=out)
    elif name == "MIN":
        torch.minimum(low, high, out=out)
    elif name == "MAX":
        torch.maximum(low, high, out=out)
    elif name == "BAND":
        torch.bitwise_and(low, high, out=out)
    elif name == "BOR":
        torch.bitwise_or(low, high, out=out)
    elif name == "BXOR":
        torch.bitwise_xor(low, high, out=out)
    else:  # pragma: no cover - ReduceOp instances are made only above
        raise ArgumentError(f"unknown reduce op {op!r}")


def finish(op: ReduceOp, t: torch.Tensor, world: int) -> None:
    """Post-processing after the combine (AVG divides by the number of ranks)."""
    if op.name == "AVG" and op.fn is None:
        t.div_(world)
