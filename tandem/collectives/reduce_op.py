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

__all__ = ["ReduceOp", "Combine", "combine", "combiner", "finish", "check_dtype"]

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


Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]

_KERNELS: dict[str, Combine] = {
    "SUM": lambda a, b, out: torch.add(a, b, out=out),
    "AVG": lambda a, b, out: torch.add(a, b, out=out),
    "PRODUCT": lambda a, b, out: torch.mul(a, b, out=out),
    "MIN": lambda a, b, out: torch.minimum(a, b, out=out),
    "MAX": lambda a, b, out: torch.maximum(a, b, out=out),
    "BAND": lambda a, b, out: torch.bitwise_and(a, b, out=out),
    "BOR": lambda a, b, out: torch.bitwise_or(a, b, out=out),
    "BXOR": lambda a, b, out: torch.bitwise_xor(a, b, out=out),
}
_BOOL_KERNELS: dict[str, Combine] = {
    "SUM": lambda a, b, out: torch.logical_or(a, b, out=out),
    "AVG": lambda a, b, out: torch.logical_or(a, b, out=out),
    "PRODUCT": lambda a, b, out: torch.logical_and(a, b, out=out),
}


def combiner(op: ReduceOp, dtype: torch.dtype) -> Combine:
    """The function ``f(low, high, out)`` that computes ``out = op(low, high)`` for
    ``dtype`` (looked up once per call, not once per chunk)."""
    fn = op.fn
    if fn is not None:
        return lambda low, high, out: out.copy_(fn(low, high))
    kernel = (_BOOL_KERNELS.get(op.name) if dtype == torch.bool else None) or _KERNELS.get(op.name)
    if kernel is None:  # pragma: no cover - ReduceOp instances are made only above
        raise ArgumentError(f"unknown reduce op {op!r}")
    return kernel


def combine(op: ReduceOp, low: torch.Tensor, high: torch.Tensor, out: torch.Tensor) -> None:
    """``out = op(low, high)`` elementwise; ``out`` may alias ``low`` or ``high``."""
    combiner(op, low.dtype)(low, high, out)


def finish(op: ReduceOp, t: torch.Tensor, world: int) -> None:
    """Post-processing after the combine (AVG divides by the number of ranks)."""
    if op.name == "AVG" and op.fn is None:
        t.div_(world)
