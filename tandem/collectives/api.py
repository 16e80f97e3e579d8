"""The torch.distributed collective functions, on tandem's process groups.

Names, arguments, defaults and in-place semantics follow ``torch.distributed`` (the
all-to-all family is in :mod:`~tandem.collectives.alltoall`, the barriers in
:mod:`~tandem.collectives.barriers`):
``src``/``dst`` are global ranks (``group_src``/``group_dst`` take group ranks),
results are written into the caller's tensors, ``async_op=True`` returns a
:class:`~tandem.collectives.work.Work`. Every call carries a signature (op, dtype,
shape, reduce op, root, algorithm) that peers check before combining anything.
"""

from __future__ import annotations

import os
import struct
import sys
import zlib
from typing import Any, Callable, Sequence

import torch

from tandem.collectives import algorithms as algo
from tandem.collectives.algorithms.flat import Flat
from tandem.collectives.algorithms.roots import ROOT_STEP
from tandem.collectives.checks import (bool_arg, output_arg, plain_output, refused_alone,
                                      root_rank, shares_memory, sizes_match, span, tensor_arg,
                                      tensors_arg)
from tandem.collectives.group import Op, ProcessGroup
from tandem.collectives.reduce_op import ReduceOp, accepts, check_dtype, checksum
from tandem.collectives.work import Work
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.errors import ArgumentError, CollectiveMismatchError

__all__ = [
    "broadcast", "all_reduce", "checked_all_reduce", "all_reduce_coalesced", "reduce",
    "all_gather", "all_gather_into_tensor", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "call_site",
]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch's frames are skipped as well: under tandem's torch backend (and in autograd hooks)
# torch.distributed, DDP or the autograd engine sit between the user's line and tandem
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# the benchmarks call tandem as a user does: their lines are the sites a report names
_BENCH = os.path.join(_PKG, "bench") + os.sep


_INSIDE: dict[str, bool] = {}  # file name -> part of the tandem or torch package
# file name -> line -> "file:line": one string per call site, made once (a call's
# record keeps its site; a fresh string per call would be freed cold much later)
_SITES: dict[str, dict[int, str]] = {}


def call_site() -> str:
    """``file:line`` of the first caller outside the tandem and torch packages."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        inside = _INSIDE.get(name)
        if inside is None:
            inside = _INSIDE[name] = (name.startswith((_PKG, _TORCH))
                                      and not name.startswith(_BENCH))
        if not inside:
            lines = _SITES.get(name)
            if lines is None:
                lines = _SITES[name] = {}
            line = f.f_lineno
            site = lines.get(line)
            if site is None:
                site = f"{os.path.basename(name)}:{line}"
                if len(lines) < 4096:  # bounded: generated code may have endless lines
                    lines[line] = site
            return site
        f = f.f_back  # type: ignore[assignment]
    return "?"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


class Sig(str):
    """A call's signature text, with ``nbytes``: the bytes of the tensor it describes
    (-1 when it describes none). Calls that return that one tensor hand the figure to
    the flight recorder, which then need not ask the tensor on every call."""

    nbytes = -1


_SIGS: dict[tuple[Any, ...], Sig] = {}
_SIZES_SHOWN = 16  # per-tensor sizes shown in a signature; more are summed up by a checksum


def _sig(name: str, t: torch.Tensor | None, **extra: Any) -> Sig:
    """The call's signature, compared by every peer (cached: it runs on every call)."""
    key = (name, None if t is None else (t.dtype, t.shape), *extra.values())
    try:
        return _SIGS[key]
    except KeyError:
        sig = _make_sig(name, t, extra)
        if len(_SIGS) < 4096:  # bounded: shapes may vary without end
            _SIGS[key] = sig
        return sig
    except TypeError:  # an unhashable extra (a list of sizes)
        return _make_sig(name, t, extra)


def _sizes(sizes: list[int]) -> str:
    """Element counts of a call's tensors as signature text: the counts themselves when
    there are a few (a mismatch then shows them: ``sizes=3,3`` against ``sizes=4,4``),
    else how many and a checksum. Hashable, so the signature stays cached."""
    if len(sizes) <= _SIZES_SHOWN:
        return ",".join(map(str, sizes))
    return f"{len(sizes)}:{zlib.crc32(struct.pack(f'<{len(sizes)}q', *sizes)):08x}"


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _make_sig(name: str, t: torch.Tensor | None, extra: dict[str, Any]) -> Sig:
    text = name
    if t is not None:
        text = f"{name} {_dtype_name(t.dtype)}{list(t.shape)}"
    for key, value in extra.items():
        text = f"{text} {key}={value}"
    sig = Sig(text)
    if t is not None:
        sig.nbytes = t.numel() * t.element_size()
    return sig


def _launch(g: ProcessGroup, name: str, sig: str, body: Callable[[Op], None], async_op: bool,
            result: Any, nbytes: int = -1) -> Work | None:
    """Issue the call; ``result`` is the list of tensors it returns, ``nbytes`` their bytes
    when known (``sig.nbytes`` of a call returning the tensor its signature describes)."""
    if async_op is not False and async_op is not True:  # checked before the call is numbered
        bool_arg(async_op, name, "async_op")
    op = g.new_op(name, sig, call_site())
    return g.run(op, body, async_op, result, nbytes)


_CHECK_STEP = ROOT_STEP - 1  # a custom op's result checksums (the root checks use ROOT_STEP)


def _same_result(o: Op, results: Sequence[torch.Tensor], redop: ReduceOp) -> None:
    """Compare the checksum of an all-reduce's result across ranks; raise on every rank
    when they differ (a custom op that computes differently per rank would otherwise
    leave each rank with its own answer). Every rank sends its 8 bytes to every other,
    so all reach the same verdict."""
    g = o.group
    me, p = g.group_rank, g.group_size
    if p == 1:
        return
    mine = sum(checksum(t) for t in results) & (2 ** 64 - 1)
    sums = [bytearray(8) for _ in range(p)]
    struct.pack_into("<Q", sums[me], 0, mine)
    recvs = [o.recv(q, _CHECK_STEP, memoryview(sums[q])) for q in range(p) if q != me]
    sends = [o.send(q, _CHECK_STEP, memoryview(sums[me])) for q in range(p) if q != me]
    o.wait(*recvs, *sends)
    seen: dict[int, list[int]] = {}
    for q in range(p):
        seen.setdefault(struct.unpack_from("<Q", sums[q])[0], []).append(g.ranks[q])
    if len(seen) > 1:
        camps = "; ".join(f"rank(s) {', '.join(map(str, ranks))} got checksum {value:016x}"
                          for value, ranks in seen.items())
        raise CollectiveMismatchError(
            f"{o.name} with custom reduce op {redop.name} gave different results on different "
            f"ranks of group '{g.group_name}' ({camps}): the op computes differently per rank "
            f"(it reads a per-rank value: a global, an object's attribute, a tensor, changed "
            f"after the op was made). Make it depend on its arguments alone; "
            f"ReduceOp.custom(fn, pure=True) skips this check")


def broadcast(tensor: torch.Tensor, src: int | None = None, group: AnyGroup | None = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    g = resolve_group(group, "broadcast")
    output_arg(tensor, "broadcast", "tensor")
    root = root_rank(g, "broadcast", src, group_src, "src")
    buf = Flat(tensor, load=(g.group_rank == root))
    _, fn = algo.select_broadcast(g, buf.flat)

    def body(o: Op) -> None:
        fn(o, buf.flat, root)
        buf.done()

    sig = _sig("broadcast", tensor, root=root)
    return _launch(g, "broadcast", sig, body, async_op, [tensor], sig.nbytes)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
               async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_reduce")
    # the full checks only when the few attribute reads of the common case do not pass
    # (1.3 -> 0.5 us per call, measured)
    if not (plain_output(tensor) and accepts(op, tensor.dtype)):
        output_arg(tensor, "all_reduce", "tensor")
        check_dtype(op, tensor.dtype)
    return checked_all_reduce(g, tensor, op, async_op)


def checked_all_reduce(g: ProcessGroup, tensor: torch.Tensor, op: ReduceOp,
                       async_op: bool) -> Work | None:
    """:func:`all_reduce` once its arguments passed its checks, for a caller that made
    them itself: torch's process-group adapter, whose per-call cost is torch's layer
    (its own checks and tandem's, made twice, were 40% of that layer, measured)."""
    buf = Flat(tensor)
    name, fn = algo.select_all_reduce(g, buf.flat)

    def body(o: Op) -> None:
        fn(o, buf.flat, op)
        buf.done()
        if not op.pure:
            _same_result(o, [buf.flat], op)

    sig = _sig("all_reduce", tensor, op=op.sig, algorithm=name)
    return _launch(g, "all_reduce", sig, body, async_op, [tensor], sig.nbytes)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                         group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    """All-reduce several tensors of one dtype in one call, each in place.

    Same-host groups stream them through shared memory as they are (no flat copy);
    elsewhere they are packed into one buffer, all-reduced, and unpacked.
    """
    g = resolve_group(group, "all_reduce_coalesced")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ArgumentError("all_reduce_coalesced: tensors must be a non-empty list of tensors")
    ts = [output_arg(t, "all_reduce_coalesced", f"tensors[{i}]") for i, t in enumerate(tensors)]
    dtype = ts[0].dtype
    for i, t in enumerate(ts):
        if t.dtype != dtype:
            raise ArgumentError(f"all_reduce_coalesced: tensors[{i}] is {t.dtype}, tensors[0] "
                                f"is {dtype}; one call takes one dtype")
    check_dtype(op, dtype)
    bufs = [Flat(t) for t in ts]
    sizes = [b.flat.numel() for b in bufs]
    many = algo.select_all_reduce_coalesced(g, [b.flat for b in bufs], ts)
    if many is not None:
        name = "shm"

        def body(o: Op) -> None:
            many(o, [b.flat for b in bufs], op)
            for b in bufs:
                b.done()
            if not op.pure:
                _same_result(o, [b.flat for b in bufs], op)
    else:  # packed, each is reduced once as of the call and written back in list order
        packed = torch.cat([b.flat for b in bufs])
        name, fn = algo.select_all_reduce(g, packed)

        def body(o: Op) -> None:
            packed.copy_(torch.cat([b.flat for b in bufs]))  # the values as of the call
            fn(o, packed, op)
            with torch.no_grad():
                for b, part in zip(bufs, packed.split(sizes)):
                    b.flat.copy_(part)
                    b.done()
            if not op.pure:
                _same_result(o, [packed], op)

    sig = _sig("all_reduce_coalesced", None, dtype=_dtype_name(dtype), tensors=len(sizes),
               numel=sum(sizes), sizes=_sizes(sizes), op=op.sig, algorithm=name)
    return _launch(g, "all_reduce_coalesced", sig, body, async_op, list(tensors))


def reduce(tensor: torch.Tensor, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
           group: AnyGroup | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    g = resolve_group(group, "reduce")
    output_arg(tensor, "reduce", "tensor")
    check_dtype(op, tensor.dtype)
    root = root_rank(g, "reduce", dst, group_dst, "dst")
    buf = Flat(tensor)
    _, fn = algo.select_reduce(g, buf.flat)

    def body(o: Op) -> None:
        fn(o, buf.flat, root, op)
        if g.group_rank == root:
            buf.done()

    sig = _sig("reduce", tensor, op=op.sig, root=root)
    return _launch(g, "reduce", sig, body, async_op, [tensor], sig.nbytes)


def _aliases_an_output(t: torch.Tensor, outs: list[torch.Tensor], mine: int) -> bool:
    """Whether ``t`` shares memory with an output other than being its own slot itself."""
    t0, t1 = span(t)
    for i, o in enumerate(outs):
        o0, o1 = span(o)
        if o0 < t1 and t0 < o1 and not (i == mine and o0 == t0 and o.stride() == t.stride()):
            return True
    return False


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_gather")
    tensor_arg(tensor, "all_gather", "tensor")
    outs = tensors_arg(tensor_list, "all_gather", "tensor_list", g.group_size, tensor.dtype,
                       output=True)
    if outs[g.group_rank].numel() != tensor.numel():
        raise ArgumentError(f"all_gather: tensor_list[{g.group_rank}] has "
                            f"{outs[g.group_rank].numel()} elements, tensor has {tensor.numel()}")
    if _aliases_an_output(tensor, outs, g.group_rank):
        tensor = tensor.clone()  # else a peer's part could overwrite it before it is sent

    _, fn = algo.select_all_gather(g, outs)

    def body(o: Op) -> None:
        fn(o, outs, tensor)

    if g.shares_memory:  # members read each other's sizes from here: all must agree
        sig = _sig("all_gather", None, dtype=tensor.dtype, sizes=_sizes([t.numel() for t in outs]))
    else:
        sig = _sig("all_gather", None, dtype=tensor.dtype)
    return _launch(g, "all_gather", sig, body, async_op, tensor_list)


def _own_chunk(out: torch.Tensor, t: torch.Tensor, rank: int) -> bool:
    """Whether ``t`` is exactly this rank's chunk of ``out`` (the usual in-place call)."""
    return (out.is_contiguous() and t.is_contiguous()
            and t.data_ptr() == out.data_ptr() + rank * t.nbytes)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_gather_into_tensor")
    output_arg(output_tensor, "all_gather_into_tensor", "output_tensor")
    tensor_arg(input_tensor, "all_gather_into_tensor", "input_tensor")
    n = input_tensor.numel()
    if output_tensor.numel() != n * g.group_size or output_tensor.dtype != input_tensor.dtype:
        raise ArgumentError(
            f"all_gather_into_tensor: output_tensor must hold {g.group_size} x {n} elements of "
            f"{input_tensor.dtype}, got {output_tensor.numel()} of {output_tensor.dtype}")
    if shares_memory(output_tensor, input_tensor) and not _own_chunk(output_tensor, input_tensor,
                                                                     g.group_rank):
        input_tensor = input_tensor.clone()  # it sits where another rank's part goes
    out = Flat(output_tensor, load=False)
    _, fn = algo.select_all_gather_into_tensor(g, n)

    def body(o: Op) -> None:
        fn(o, out.flat, n, input_tensor)
        out.done()

    sig = _sig("all_gather_into_tensor", input_tensor)
    return _launch(g, "all_gather_into_tensor", sig, body, async_op, [output_tensor])


def _given(lst: object) -> bool:
    """Whether a root-only list argument was given (None and [] mean not given)."""
    return lst is not None and not (isinstance(lst, (list, tuple)) and not lst)


def _not_root_list(g: ProcessGroup, what: str, name: str, role: str, arg: str, root: int,
                   hint: str) -> None:
    """A list passed where it is never read or written: refused (torch refuses it too)."""
    raise ArgumentError(f"{what}: {name} is used only on the {role} rank ({arg}="
                        f"{g.ranks[root]}); rank {g.ranks[g.group_rank]} must pass None{hint}")


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int | None = None, group: AnyGroup | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    g = resolve_group(group, "gather")
    tensor_arg(tensor, "gather", "tensor")
    root = root_rank(g, "gather", dst, group_dst, "dst")
    outs: list[Flat] | None = None
    try:  # checks of this rank alone: its peers are in the call (refused_alone)
        if g.group_rank == root:
            if gather_list is None:
                raise ArgumentError("gather: the destination rank must pass gather_list")
            lst = tensors_arg(gather_list, "gather", "gather_list", g.group_size, tensor.dtype,
                              output=True)
            sizes_match(lst, "gather", "gather_list", tensor.numel())
            outs = [Flat(t, load=False) for t in lst]
        elif _given(gather_list):
            _not_root_list(g, "gather", "gather_list", "destination", "dst", root,
                           "; all_gather fills a list on every rank")
    except ArgumentError as exc:
        raise refused_alone(g, "gather", exc)
    src = Flat(tensor)
    _, fn = algo.select_gather(g, src.flat)

    def body(o: Op) -> None:
        fn(o, src.flat, [f.flat for f in outs] if outs else None, root)
        for f in outs or []:
            f.done()

    return _launch(g, "gather", _sig("gather", tensor, root=root), body, async_op, gather_list)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
            src: int | None = None, group: AnyGroup | None = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    g = resolve_group(group, "scatter")
    output_arg(tensor, "scatter", "tensor")
    root = root_rank(g, "scatter", src, group_src, "src")
    ins: list[torch.Tensor] | None = None
    try:  # checks of this rank alone: its peers are in the call (refused_alone)
        if g.group_rank == root:
            if scatter_list is None:
                raise ArgumentError("scatter: the source rank must pass scatter_list")
            ins = [t.contiguous().view(-1) for t in
                   tensors_arg(scatter_list, "scatter", "scatter_list", g.group_size,
                               tensor.dtype)]
            sizes_match(ins, "scatter", "scatter_list", tensor.numel())
        elif _given(scatter_list):
            _not_root_list(g, "scatter", "scatter_list", "source", "src", root, "")
    except ArgumentError as exc:
        raise refused_alone(g, "scatter", exc)
    out = Flat(tensor, load=False)
    _, fn = algo.select_scatter(g, out.flat)

    def body(o: Op) -> None:
        fn(o, out.flat, ins, root)
        out.done()

    sig = _sig("scatter", tensor, root=root)
    return _launch(g, "scatter", sig, body, async_op, [tensor], sig.nbytes)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
                   async_op: bool = False) -> Work | None:
    g = resolve_group(group, "reduce_scatter")
    output_arg(output, "reduce_scatter", "output")
    check_dtype(op, output.dtype)
    ins = tensors_arg(input_list, "reduce_scatter", "input_list", g.group_size, output.dtype)
    if ins[g.group_rank].numel() != output.numel():
        raise ArgumentError(f"reduce_scatter: input_list[{g.group_rank}] has "
                            f"{ins[g.group_rank].numel()} elements, output has {output.numel()}")

    sizes = [t.numel() for t in ins]
    _, fn = algo.select_reduce_scatter(g, sizes, output.dtype)

    def body(o: Op) -> None:
        fn(o, output, [t.reshape(-1) for t in ins], op)

    sig = _sig("reduce_scatter", None, dtype=output.dtype, op=op.sig, sizes=_sizes(sizes))
    return _launch(g, "reduce_scatter", sig, body, async_op, [output])


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
                          async_op: bool = False) -> Work | None:
    g = resolve_group(group, "reduce_scatter_tensor")
    output_arg(output, "reduce_scatter_tensor", "output")
    tensor_arg(input, "reduce_scatter_tensor", "input")
    check_dtype(op, output.dtype)
    n = output.numel()
    if input.numel() != n * g.group_size or input.dtype != output.dtype:
        raise ArgumentError(
            f"reduce_scatter_tensor: input must hold {g.group_size} x {n} elements of "
            f"{output.dtype}, got {input.numel()} of {input.dtype}")

    _, fn = algo.select_reduce_scatter(g, [n] * g.group_size, output.dtype)

    def body(o: Op) -> None:
        fn(o, output, input.reshape(-1), op)

    sig = _sig("reduce_scatter_tensor", output, op=op.sig)
    return _launch(g, "reduce_scatter_tensor", sig, body, async_op, [output], sig.nbytes)


# torch's newer names for the same two calls
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor
