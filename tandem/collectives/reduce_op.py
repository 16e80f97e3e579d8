"""Reduce operations: the built-in ones and user-defined ones.

Every combine runs as one torch kernel on whole buffers (``torch.add(a, b, out=a)``
and friends), never as a Python loop over elements. A user-defined op is any
Python callable ``fn(a, b) -> Tensor`` that is associative and commutative::

    import tandem as dist
    absmax = dist.ReduceOp.custom(lambda a, b: torch.maximum(a.abs(), b.abs()), "ABSMAX")
    dist.all_reduce(t, op=absmax)

Combines are always applied as ``fn(lower_rank_data, higher_rank_data)``, so every
rank computes bit-identical results.

Ranks compare a custom op by its *fingerprint*, not by its name alone: a hash of what
the op reads, taken when the op is made (module, qualified name, code, constants,
defaults, closure cells, the module globals its code names, a callable object's or
bound method's attributes; numbers, strings, tensors and containers by value). Two
different lambdas, one function that differs between ranks, or the same code reading a
per-rank value (``SCALE = rank + 1``) are a ``CollectiveMismatchError`` before anything
is combined. ``name=`` only labels the op in messages. (Bytecode differs between Python
versions, so all ranks of a job need the same Python to use custom ops.)

What the fingerprint cannot see (state changed after the op was made, values reached
through attributes of other objects, randomness) may still make ranks compute
differently. So ``all_reduce`` and ``all_reduce_coalesced`` with a custom op also
compare a checksum of the result across ranks (one 8-byte message per pair of ranks)
and raise ``CollectiveMismatchError`` on every rank when they differ. An op whose
result depends only on its arguments can skip that check::

    dist.ReduceOp.custom(fn, "ABSMAX", pure=True)
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import types
import zlib
from typing import Any, Callable

import torch

from tandem.errors import ArgumentError

__all__ = ["ReduceOp", "Combine", "combine", "combiner", "finish", "check_dtype", "accepts",
           "fingerprint", "checksum"]

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

    __slots__ = ("name", "fn", "code", "sig", "pure")

    def __init__(self, name: str, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                 code: int, sig: str | None = None, pure: bool = True) -> None:
        self.name = name
        self.fn = fn
        self.code = code
        self.sig = sig or name  # what peers compare: the name, plus a fingerprint if custom
        self.pure = pure  # False: results are compared across ranks (see the module doc)

    @classmethod
    def custom(cls, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               name: str | None = None, pure: bool = False) -> "ReduceOp":
        """A user-defined reduce op from an associative, commutative ``fn(a, b)``.

        ``pure=True`` declares that ``fn``'s result depends on its arguments alone, the
        same on every rank; all-reduces then skip comparing the result's checksum."""
        if not callable(fn):
            raise ArgumentError(f"custom reduce op needs a callable, got {type(fn).__name__}")
        if name is not None and not isinstance(name, str):
            raise ArgumentError(f"custom reduce op name must be a str, got {name!r}")
        if not isinstance(pure, bool):
            raise ArgumentError(f"custom reduce op: pure must be True or False, got {pure!r}")
        label = name or getattr(fn, "__name__", type(fn).__name__)
        mark = "pure" if pure else "checked"  # ranks must agree on whether results are compared
        return cls(f"custom:{label}", fn, 100,
                   f"custom:{label}#{fingerprint(fn, state=not pure)}:{mark}", pure)

    def __repr__(self) -> str:
        return f"<ReduceOp.{self.name}>"


def fingerprint(fn: Callable[..., Any], state: bool = True) -> str:
    """12 hex digits that differ between functions that compute differently.

    Hashes the function's module and qualified name, its bytecode, constants and names
    (nested functions included), its defaults, the values it closes over and the module
    globals its code names; a ``functools.partial`` adds its arguments, a callable object
    its class's ``__call__`` and its attributes, a bound method its object's attributes.
    Numbers, strings, tensors and containers count by value; modules, classes and
    builtins by name; other objects by their attributes. ``state=False`` leaves out
    globals and attributes (an op declared pure: its code, defaults and closure only).
    """
    h = hashlib.sha256()
    _feed(h, fn, 0, _Walk(state))
    return h.hexdigest()[:12]


class _Walk:
    """What one fingerprint has visited, and whether it reads state (see ``fingerprint``)."""

    __slots__ = ("seen", "state")

    def __init__(self, state: bool) -> None:
        self.seen: set[int] = set()
        self.state = state


_CRC_MAX = 64 << 10  # bytes below which a CRC is the cheaper checksum (fewer torch calls)
_TENSOR_HASHED = 1 << 20  # bytes of a tensor hashed whole; larger ones by checksum()
_BUILTINS = vars(builtins)
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def checksum(t: torch.Tensor) -> int:
    """A cheap, exact checksum of ``t``'s bytes: a CRC of small tensors, else their 64-bit
    words (or narrower, when the size needs it) summed with wrap-around in one
    vectorised pass (16 MB: 0.8 ms, a fifth of one torch.maximum over it)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n <= _CRC_MAX:
        return zlib.crc32(flat.numpy())  # type: ignore[arg-type]
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if n % size == 0:
            return int(flat.view(dtype).sum(dtype=torch.int64))
    return int(flat.sum(dtype=torch.int64))


def _feed_tensor(h: Any, t: torch.Tensor) -> None:
    h.update(f"tensor:{t.dtype}{list(t.shape)};".encode())
    if t.layout != torch.strided or t.is_nested or t.device.type == "meta":
        return
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if t.nbytes <= _TENSOR_HASHED:
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(f"sum:{checksum(t)};".encode())


def _feed_globals(h: Any, code: types.CodeType, space: dict[str, Any], depth: int,
                  walk: _Walk) -> None:
    """The module globals ``code`` (and the code nested in it) names, by value."""
    names: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    for name in sorted(names):
        if name in space:
            h.update(f"global {name}=".encode())
            _feed(h, space[name], depth + 1, walk)
        elif name not in _BUILTINS:
            h.update(f"unbound {name};".encode())  # an attribute name, or missing


def _feed(h: Any, value: Any, depth: int, walk: _Walk) -> None:
    if depth > 8:  # deep enough for any real op
        h.update(b"...")
        return
    if isinstance(value, _PLAIN) or isinstance(value, (torch.dtype, torch.device)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
        return
    if isinstance(value, torch.Tensor):
        _feed_tensor(h, value)
        return
    if isinstance(value, (types.ModuleType, type)) or (
            callable(value) and not isinstance(value, (types.FunctionType, types.MethodType,
                                                       functools.partial))
            and hasattr(value, "__qualname__") and not hasattr(value, "__dict__")):
        # a module, a class, or a builtin or extension function (torch.maximum): its name
        # is its identity
        name = getattr(value, "__qualname__", getattr(value, "__name__", "?"))
        h.update(f"named:{getattr(value, '__module__', '')}.{name};".encode())
        return
    if id(value) in walk.seen:  # a cycle (a function naming itself, an object holding itself)
        h.update(b"<cycle>")
        return
    walk.seen.add(id(value))
    try:
        _feed_compound(h, value, depth, walk)
    finally:
        walk.seen.discard(id(value))


def _feed_compound(h: Any, value: Any, depth: int, walk: _Walk) -> None:
    if isinstance(value, (tuple, list)):
        h.update(f"{type(value).__name__}[".encode())
        for item in value:
            _feed(h, item, depth + 1, walk)
        h.update(b"]")
    elif isinstance(value, (set, frozenset)):
        # string hashing is randomised per process: sorted, and only plain values by repr
        plain = all(isinstance(v, _PLAIN) for v in value)
        h.update(f"{type(value).__name__}{sorted(map(repr, value)) if plain else len(value)};"
                 .encode())
    elif isinstance(value, dict):
        h.update(b"dict{")
        keys = list(value)
        if all(isinstance(k, _PLAIN) for k in keys):
            keys.sort(key=repr)  # else insertion order, the same where the code is
        for key in keys:
            _feed(h, key, depth + 1, walk)
            _feed(h, value[key], depth + 1, walk)
        h.update(b"}")
    elif isinstance(value, types.CodeType):
        h.update(value.co_code)
        _feed(h, value.co_consts, depth + 1, walk)
        _feed(h, value.co_names, depth + 1, walk)
        _feed(h, (value.co_argcount, value.co_kwonlyargcount, value.co_flags), depth + 1, walk)
    elif isinstance(value, functools.partial):
        h.update(b"partial(")
        _feed(h, value.func, depth + 1, walk)
        _feed(h, value.args, depth + 1, walk)
        _feed(h, dict(value.keywords), depth + 1, walk)
        h.update(b")")
    elif isinstance(value, types.FunctionType):
        h.update(f"fn:{value.__module__}.{value.__qualname__};".encode())
        _feed(h, value.__code__, depth + 1, walk)
        _feed(h, value.__defaults__, depth + 1, walk)
        _feed(h, dict(value.__kwdefaults__ or {}), depth + 1, walk)
        _feed(h, tuple(_cell(c) for c in value.__closure__ or ()), depth + 1, walk)
        if walk.state:
            _feed_globals(h, value.__code__, value.__globals__, depth, walk)
    elif isinstance(value, types.MethodType):
        _feed(h, value.__func__, depth + 1, walk)
        h.update(b"bound to ")
        _feed_object(h, value.__self__, depth + 1, walk)
    else:
        _feed_object(h, value, depth, walk)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _feed_object(h: Any, value: Any, depth: int, walk: _Walk) -> None:
    """Another object: its class (and the class's ``__call__``), then its attributes."""
    kind = type(value)
    h.update(f"object:{kind.__module__}.{kind.__qualname__};".encode())
    call = getattr(kind, "__call__", None)
    if isinstance(call, types.FunctionType):
        _feed(h, call, depth + 1, walk)
    state: dict[str, Any] = dict(getattr(value, "__dict__", None) or {})
    for klass in kind.__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__"):
                state[slot] = getattr(value, slot, None)
    if state and walk.state:
        _feed(h, state, depth + 1, walk)


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
