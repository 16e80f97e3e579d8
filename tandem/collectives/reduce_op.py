"""Reduce operations: the built-in ones and user-defined ones.

Every combine runs as one torch kernel on whole buffers (``torch.add(a, b, out=a)``
and friends), never as a Python loop over elements. A user-defined op is any
Python callable ``fn(a, b) -> Tensor`` that is associative and commutative::

    import tandem as dist
    absmax = dist.ReduceOp.custom(lambda a, b: torch.maximum(a.abs(), b.abs()), "ABSMAX")
    dist.all_reduce(t, op=absmax)

Combines are always applied as ``fn(lower_rank_data, higher_rank_data)``, so every
rank computes bit-identical results.

Ranks compare a custom op by its *fingerprint* (module, qualified name, and a hash of
the function's code, constants, defaults and closure values), not by its name alone:
two different lambdas, or one function that differs between ranks, are a
``CollectiveMismatchError`` before anything is combined. ``name=`` only labels the op
in messages. (Bytecode differs between Python versions, so all ranks of a job need the
same Python to use custom ops, as they need the same code.)
"""

from __future__ import annotations

import functools
import hashlib
import types
from typing import Any, Callable

import torch

from tandem.errors import ArgumentError

__all__ = ["ReduceOp", "Combine", "combine", "combiner", "finish", "check_dtype", "accepts",
           "fingerprint"]

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

    __slots__ = ("name", "fn", "code", "sig")

    def __init__(self, name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 code: int, sig: str | None = None) -> None:
        self.name = name
        self.fn = fn
        self.code = code
        self.sig = sig or name  # what peers compare: the name, plus a fingerprint if custom

    @classmethod
    def custom(cls, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               name: str | None = None) -> "ReduceOp":
        """A user-defined reduce op from an associative, commutative ``fn(a, b)``."""
        if not callable(fn):
            raise ArgumentError(f"custom reduce op needs a callable, got {type(fn).__name__}")
        if name is not None and not isinstance(name, str):
            raise ArgumentError(f"custom reduce op name must be a str, got {name!r}")
        label = name or getattr(fn, "__name__", type(fn).__name__)
        return cls(f"custom:{label}", fn, 100, f"custom:{label}#{fingerprint(fn)}")

    def __repr__(self) -> str:
        return f"<ReduceOp.{self.name}>"


def fingerprint(fn: Callable[..., Any]) -> str:
    """12 hex digits that differ between functions that compute differently.

    Hashes the function's module and qualified name, its bytecode, constants and names
    (nested functions included), its defaults and the values it closes over; a
    ``functools.partial`` adds its arguments, a callable object its class's ``__call__``.
    Values without a stable text (tensors, arbitrary objects) contribute their type only.
    """
    h = hashlib.sha256()
    _feed(h, fn, depth=0)
    return h.hexdigest()[:12]


def _feed(h: Any, value: Any, depth: int) -> None:
    if depth > 8:  # deep enough for any real op; guards against cycles
        h.update(b"...")
        return
    if isinstance(value, (int, float, complex, str, bytes, bool, type(None))):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (tuple, list, frozenset)):
        h.update(f"{type(value).__name__}[".encode())
        for item in value if not isinstance(value, frozenset) else sorted(map(repr, value)):
            _feed(h, item, depth + 1)
        h.update(b"]")
    elif isinstance(value, types.CodeType):
        h.update(value.co_code)
        _feed(h, value.co_consts, depth + 1)
        _feed(h, value.co_names, depth + 1)
        _feed(h, (value.co_argcount, value.co_kwonlyargcount, value.co_flags), depth + 1)
    elif isinstance(value, functools.partial):
        h.update(b"partial(")
        _feed(h, value.func, depth + 1)
        _feed(h, value.args, depth + 1)
        _feed(h, sorted(value.keywords.items()), depth + 1)
        h.update(b")")
    elif isinstance(value, types.FunctionType):
        h.update(f"fn:{value.__module__}.{value.__qualname__};".encode())
        _feed(h, value.__code__, depth + 1)
        _feed(h, value.__defaults__, depth + 1)
        _feed(h, tuple(sorted((value.__kwdefaults__ or {}).items())), depth + 1)
        _feed(h, tuple(c.cell_contents for c in value.__closure__ or ()), depth + 1)
    elif isinstance(value, types.MethodType):
        _feed(h, value.__func__, depth + 1)
        h.update(f"bound to {type(value.__self__).__qualname__};".encode())
    elif callable(value) and not isinstance(value, type) and hasattr(value, "__qualname__"):
        # a builtin or extension function (torch.maximum): its name is its identity
        h.update(f"builtin:{getattr(value, '__module__', '')}.{value.__qualname__};".encode())
    elif callable(value) and callable(getattr(type(value), "__call__", None)):
        h.update(f"object:{type(value).__module__}.{type(value).__qualname__};".encode())
        _feed(h, getattr(type(value), "__call__"), depth + 1)
    else:
        h.update(f"{type(value).__module__}.{type(value).__qualname__};".encode())


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


def _passes(op: ReduceOp, dtype: torch.dtype) -> bool:
    try:
        check_dtype(op, dtype)
    except ArgumentError:
        return False
    return True


# every (built-in op, dtype) pair check_dtype lets through
_ACCEPTED = frozenset((op, dtype) for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT,
                                             ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
                                             ReduceOp.BOR, ReduceOp.BXOR)
                      for dtype in _REDUCIBLE_DTYPES if _passes(op, dtype))


def accepts(op: ReduceOp, dtype: torch.dtype) -> bool:
    """Whether :func:`check_dtype` lets a built-in ``op`` on ``dtype`` through, in one set
    lookup. False for custom ops, whatever they take: ``check_dtype`` decides those."""
    return (op, dtype) in _ACCEPTED
