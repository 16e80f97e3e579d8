"""Argument checks shared by the public functions, run before any byte moves.

Each raises :class:`~tandem.errors.ArgumentError` naming the function, the argument and
what to pass instead. A check that were missing here would let one rank start a call
its peers never join (they wait out their deadline), or fail half-way with a raw torch
or struct error.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from tandem._words import counted, in_order
from tandem.config import flag_argument
from tandem.collectives.group import ProcessGroup
from tandem.errors import ArgumentError, StateError

__all__ = ["tensor_arg", "tensors_arg", "output_arg", "plain_output", "sizes_match",
           "root_rank", "tag_arg", "int_list", "check_cpu_device", "refuse_pg_options",
           "span", "shares_memory", "refused_alone", "bool_arg", "any_shared", "crossed",
           "overlapping_pair", "distinct_outputs", "TAG_MIN", "TAG_MAX"]

# a p2p tag travels as a signed 32-bit field of the message header
TAG_MIN, TAG_MAX = -(2 ** 31), 2 ** 31 - 1


def tensor_arg(t: Any, what: str, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ArgumentError(f"{what}: {name} is on {t.device}; tandem collectives take CPU tensors")
    if t.is_nested:
        raise ArgumentError(f"{what}: {name} is a nested tensor; pass its components "
                            f"({name}.unbind()) or a padded tensor ({name}.to_padded_tensor(0))")
    if t.layout != torch.strided:
        raise ArgumentError(f"{what}: {name} has layout {t.layout}; only dense tensors are supported")
    if t.is_conj() or t.is_neg():
        # its memory holds the conjugates (negatives) of its elements, and collectives move
        # memory: refused rather than sent or filled wrong (torch's gloo refuses most too)
        kind, fix = ("conjugate", "resolve_conj()") if t.is_conj() else ("negative", "resolve_neg()")
        raise ArgumentError(f"{what}: {name} is a {kind} view, whose memory does not hold its "
                            f"elements; pass {name}.{fix}")
    return t


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are the same memory (e.g. made by ``expand``)."""
    if t.is_contiguous() or t.numel() <= 1:
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # the largest offset the smaller strides reach
    for stride, n in dims:
        if stride == 0:
            return True
        if stride <= reach:
            break  # interleaved dimensions: count the distinct offsets below
        reach += stride * (n - 1)
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    return bool(offsets.reshape(-1).unique().numel() != t.numel())


def output_arg(t: Any, what: str, name: str) -> torch.Tensor:
    """A tensor the call writes into: its elements must be distinct memory."""
    tensor_arg(t, what, name)
    if _overlaps(t):
        raise ArgumentError(
            f"{what}: {name} (shape {list(t.shape)}, stride {list(t.stride())}) has elements "
            f"that overlap in memory, e.g. made by expand(); results cannot be written into "
            f"it: pass a tensor of its own (.clone())")
    return t


def span(t: torch.Tensor) -> tuple[int, int]:
    """The byte addresses from ``t``'s first element to just past its last (strides are never
    negative in torch)."""
    start = t.data_ptr()
    if t.is_contiguous():  # the common case, in three attribute reads (~0.6 us)
        return start, start + t.nbytes
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share memory: their byte spans overlap. Two interleaved
    views (``t[0::2]``, ``t[1::2]``) count as sharing, so callers copy rather than refuse."""
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1 and a0 < a1 and b0 < b1  # an empty span shares nothing


def any_shared(ts: Sequence[torch.Tensor]) -> bool:
    """Whether two of ``ts`` may share memory (as :func:`shares_memory`), in one sort."""
    spans = sorted(s for s in map(span, ts) if s[0] < s[1])
    return any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))


def crossed(ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> bool:
    """Whether an input may share memory with an output: one sweep over the sorted spans,
    keeping the furthest end of each kind seen so far."""
    spans = sorted([(*span(t), True) for t in ins] + [(*span(t), False) for t in outs])
    end = {True: 0, False: 0}
    for start, stop, is_in in spans:
        if start < stop:
            if start < end[not is_in]:
                return True
            end[is_in] = max(end[is_in], stop)
    return False


# elements compared one by one (~50 MB of addresses at most), beyond which views whose
# spans overlap are refused as if they shared elements
_EXACT_MAX = 1 << 20


def _element_bytes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First and past-the-last byte address of each element of ``t``."""
    starts = torch.full((), t.data_ptr(), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride()):
        starts = starts.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * (stride * t.element_size())
    starts = starts.reshape(-1)
    return starts, starts + t.element_size()


def _elements_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether an element of ``a`` and one of ``b`` share a byte; their spans overlap."""
    if a.is_contiguous() and b.is_contiguous():
        return True  # dense spans that overlap share bytes
    if a.numel() + b.numel() > _EXACT_MAX:
        return True  # too many to compare here: refused as overlapping (the message says so)
    (a0, a1), (b0, b1) = _element_bytes(a), _element_bytes(b)
    starts, order = torch.cat([a0, b0]).sort()
    ends = torch.cat([a1, b1])[order]
    # sorted by start, some element begins before an earlier one has ended
    return bool((starts[1:] < ends.cummax(0).values[:-1]).any())


def overlapping_pair(ts: Sequence[torch.Tensor]) -> tuple[int, int] | None:
    """Positions ``(i, j)``, ``i < j``, of two of ``ts`` that share memory, or None.

    One sort of the byte spans (the common answer, ~1 us per tensor); only spans that
    overlap are compared element by element, so interleaved views (``t[0::2]``,
    ``t[1::2]``) pass."""
    if len(ts) == 2:  # two ranks: one comparison, no sort
        (a0, a1), (b0, b1) = span(ts[0]), span(ts[1])
        if not (a0 < b1 and b0 < a1 and a0 < a1 and b0 < b1):
            return None
    spans = sorted([(*span(t), i) for i, t in enumerate(ts)])
    reach = 0
    for start, stop, _ in spans:
        if start < reach and start < stop:
            return _pair_of_elements(ts, spans)
        if stop > reach:
            reach = stop
    return None


def _pair_of_elements(ts: Sequence[torch.Tensor], spans: list[tuple[int, int, int]]
                      ) -> tuple[int, int] | None:
    """:func:`overlapping_pair` once two spans overlap: compare their elements."""
    open_: list[tuple[int, int]] = []  # (end, position) of spans the next ones may overlap
    for start, stop, i in spans:
        if start >= stop:
            continue
        open_ = [(end, j) for end, j in open_ if end > start]
        for _, j in open_:
            if _elements_overlap(ts[j], ts[i]):
                return min(i, j), max(i, j)
        open_.append((stop, i))
    return None


def distinct_outputs(ts: Sequence[torch.Tensor], what: str, name: str) -> None:
    """Refuse outputs that share memory: each would be written with another rank's data,
    and all but the last writer's would be lost without a word."""
    pair = overlapping_pair(ts)
    if pair is None:
        return
    i, j = pair
    a, b = ts[i], ts[j]
    verb = "overlap"
    if a is b:
        kind = "the same tensor twice"
    elif a.numel() + b.numel() > _EXACT_MAX and not (a.is_contiguous() and b.is_contiguous()):
        verb = "may overlap"
        kind = (f"strided views whose byte ranges overlap, with more than {_EXACT_MAX} "
                f"elements to compare one by one")
    else:
        kind = "views of one buffer sharing elements"
    raise ArgumentError(f"{what}: {name}[{i}] and {name}[{j}] {verb} in memory ({kind}); each "
                        f"output is written with its own data and needs memory of its own: "
                        f"pass separate tensors (e.g. torch.empty_like)")


def plain_output(t: Any) -> bool:
    """Whether ``t`` is a CPU tensor that :func:`output_arg` accepts as it is, answered in
    a few attribute reads for the common case (dense, contiguous, so no two elements
    share memory). False says nothing: ``output_arg`` then gives the verdict."""
    return (isinstance(t, torch.Tensor) and t.is_cpu and t.layout is torch.strided
            and not t.is_nested and t.is_contiguous() and not t.is_conj() and not t.is_neg())


def tensors_arg(ts: Any, what: str, name: str, count: int, dtype: torch.dtype,
                output: bool = False) -> list[torch.Tensor]:
    if not isinstance(ts, (list, tuple)):
        raise ArgumentError(f"{what}: {name} must be a list of tensors, got {type(ts).__name__}")
    if len(ts) != count:
        raise ArgumentError(f"{what}: {name} has {len(ts)} tensors; the group has {counted(count, 'rank')}")
    check = output_arg if output else tensor_arg
    out = [check(t, what, f"{name}[{i}]") for i, t in enumerate(ts)]
    for i, t in enumerate(out):
        if t.dtype != dtype:
            raise ArgumentError(f"{what}: {name}[{i}] is {t.dtype}, expected {dtype}")
    if output:
        distinct_outputs(out, what, name)
    return out


def refused_alone(g: ProcessGroup, what: str, exc: ArgumentError) -> ArgumentError:
    """Abort ``g`` with ``exc``, an argument refused by a check that only this rank makes
    (a root's list, a list passed where only the root takes one), and return ``exc`` to
    raise: the peers passed their checks and wait in the call, so they fail now, naming
    this rank's problem, rather than at their deadline."""
    g.abort(StateError(f"{what} on group '{g.group_name}' cannot run: rank "
                       f"{g.ranks[g.group_rank]} refused its arguments ({exc})"))
    return exc


def sizes_match(ts: Sequence[torch.Tensor], what: str, name: str, numel: int) -> None:
    for i, t in enumerate(ts):
        if t.numel() != numel:
            raise ArgumentError(f"{what}: {name}[{i}] has {t.numel()} elements, tensor has {numel}")


def root_rank(g: ProcessGroup, what: str, rank: int | None, group_rank: int | None,
              name: str) -> int:
    """Group rank of a root given as a global rank (torch) or a group rank, not both."""
    if rank is not None and group_rank is not None:
        raise ArgumentError(f"{what}: pass {name}={rank} or group_{name}={group_rank}, not both")
    if group_rank is not None:
        index = _as_int(group_rank)
        if index is None:
            raise ArgumentError(f"{what}: group_{name} must be an int (a rank of the group), "
                                f"got {type(group_rank).__name__} {group_rank!r}")
        if not 0 <= index < g.group_size:
            raise ArgumentError(f"{what}: group_{name}={index} is outside "
                                f"[0, {g.group_size})")
        return index
    given = 0 if rank is None else _as_int(rank)
    if given is None:
        raise ArgumentError(f"{what}: {name} must be an int (a global rank), got "
                            f"{type(rank).__name__} {rank!r}")
    if given not in g.ranks:
        raise ArgumentError(f"{what}: {name}={given} is not a member of group "
                            f"'{g.group_name}' (global ranks {in_order(g.ranks)})")
    return g.ranks.index(given)


def _as_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer (numpy's and torch's too), else None."""
    if isinstance(value, bool):
        return None  # True is an int to Python, but never a rank, a size or a tag
    try:
        return operator.index(value)
    except TypeError:
        return None


def bool_arg(value: Any, what: str, name: str) -> bool:
    """A flag that must be True or False (see ``tandem.config.flag_argument``)."""
    return flag_argument(f"{what}: {name}", value)


def tag_arg(tag: Any, what: str) -> int:
    value = _as_int(tag)
    if value is None:
        raise ArgumentError(f"{what}: tag must be an int, got {type(tag).__name__} {tag!r}")
    tag = value
    if not TAG_MIN <= tag <= TAG_MAX:
        raise ArgumentError(f"{what}: tag={tag} does not fit in 32 bits; use a tag in "
                            f"[{TAG_MIN}, {TAG_MAX}]")
    return tag


def int_list(values: Any, what: str, name: str) -> list[int]:
    """Integers (numpy's and torch's too, not bools, floats or strings) as a list of ints,
    for ranks and split sizes."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise ArgumentError(f"{what}: {name} must be a list of ints, got {type(values).__name__}")
    values = list(values)
    out = [_as_int(v) for v in values]
    bad = [v for v, n in zip(values, out) if n is None]
    if bad:
        raise ArgumentError(f"{what}: {name} must be ints, got {bad[0]!r} "
                            f"({type(bad[0]).__name__}) in {list(values)}")
    return [n for n in out if n is not None]


def check_cpu_device(what: str, name: str, device: object) -> None:
    """Refuse a device other than the CPU: tandem moves CPU tensors only."""
    if device is None:
        return
    try:
        kind = torch.device(device).type  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise ArgumentError(f"{what}: {name}={device!r} is not a device") from exc
    if kind != "cpu":
        raise ArgumentError(f"{what}: {name}={device!r}: tandem moves CPU tensors only; pass "
                            f"None or 'cpu'")


def refuse_pg_options(what: str, pg_options: object) -> None:
    if pg_options is not None:
        raise ArgumentError(f"{what}: pg_options is not supported (tandem backends take no "
                            f"options objects); configure tandem with the TANDEM_* variables "
                            f"of tandem.config")
