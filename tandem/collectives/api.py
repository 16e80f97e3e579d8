"""The torch.distributed collective functions, on tandem's process groups.

Names, arguments, defaults and in-place semantics follow ``torch.distributed``:
``src``/``dst`` are global ranks (``group_src``/``group_dst`` take group ranks),
results are written into the caller's tensors, ``async_op=True`` returns a
:class:`~tandem.collectives.work.Work`. Every call carries a signature (op, dtype,
shape, reduce op, root, algorithm) that peers check before combining anything.
"""

from __future__ import annotations

import datetime
import os
import struct
import sys
import time
import zlib
from typing import Any, Callable, Sequence

import torch

from tandem.collectives import algorithms as algo
from tandem.collectives.group import Op, ProcessGroup, as_bytes, timeout_seconds
from tandem.collectives.reduce_op import ReduceOp, check_dtype
from tandem.collectives.work import Work
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.errors import ArgumentError, CollectiveTimeoutError

__all__ = [
    "broadcast", "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor", "gather",
    "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "call_site",
]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_INSIDE: dict[str, bool] = {}  # file name -> part of the tandem package


def call_site() -> str:
    """``file:line`` of the first caller outside the tandem package."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        inside = _INSIDE.get(name)
        if inside is None:
            inside = _INSIDE[name] = name.startswith(_PKG)
        if not inside:
            return f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "?"


def _tensor(t: Any, what: str, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ArgumentError(f"{what}: {name} is on {t.device}; tandem collectives take CPU tensors")
    if t.layout != torch.strided:
        raise ArgumentError(f"{what}: {name} has layout {t.layout}; only dense tensors are supported")
    return t


def _tensors(ts: Any, what: str, name: str, count: int, dtype: torch.dtype) -> list[torch.Tensor]:
    if not isinstance(ts, (list, tuple)):
        raise ArgumentError(f"{what}: {name} must be a list of tensors, got {type(ts).__name__}")
    if len(ts) != count:
        raise ArgumentError(f"{what}: {name} has {len(ts)} tensors; the group has {count} ranks")
    out = [_tensor(t, what, f"{name}[{i}]") for i, t in enumerate(ts)]
    for i, t in enumerate(out):
        if t.dtype != dtype:
            raise ArgumentError(f"{what}: {name}[{i}] is {t.dtype}, expected {dtype}")
    return out


def _sizes_match(ts: Sequence[torch.Tensor], what: str, name: str, numel: int) -> None:
    for i, t in enumerate(ts):
        if t.numel() != numel:
            raise ArgumentError(f"{what}: {name}[{i}] has {t.numel()} elements, tensor has {numel}")


def _root(g: ProcessGroup, what: str, rank: int | None, group_rank: int | None, name: str) -> int:
    """Group rank of a root given as a global rank (torch) or a group rank."""
    if group_rank is not None:
        if not 0 <= group_rank < g.group_size:
            raise ArgumentError(f"{what}: group_{name}={group_rank} is outside [0, {g.group_size})")
        return group_rank
    rank = 0 if rank is None else rank
    if rank not in g.ranks:
        raise ArgumentError(f"{what}: {name}={rank} is not a member of group '{g.group_name}' "
                            f"(global ranks {g.ranks})")
    return g.ranks.index(rank)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


_SIGS: dict[tuple[Any, ...], str] = {}


def _sig(name: str, t: torch.Tensor | None, **extra: Any) -> str:
    """The call's signature, compared by every peer (cached: it runs on every call)."""
    key = (name, None if t is None else (t.dtype, t.shape), *extra.values())
    try:
        return _SIGS[key]
    except KeyError:
        text = _make_sig(name, t, extra)
        if len(_SIGS) < 4096:  # bounded: shapes may vary without end
            _SIGS[key] = text
        return text
    except TypeError:  # an unhashable extra (a list of sizes)
        return _make_sig(name, t, extra)


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _make_sig(name: str, t: torch.Tensor | None, extra: dict[str, Any]) -> str:
    text = name
    if t is not None:
        text = f"{name} {_dtype_name(t.dtype)}{list(t.shape)}"
    for key, value in extra.items():
        text = f"{text} {key}={value}"
    return text


class _Flat:
    """A contiguous 1-D view of a tensor, or a copy written back afterwards."""

    __slots__ = ("orig", "flat", "copied")

    def __init__(self, t: torch.Tensor, load: bool = True) -> None:
        self.orig = t
        self.copied = not t.is_contiguous()
        if self.copied:
            self.flat = (t.contiguous() if load else torch.empty(t.shape, dtype=t.dtype)).view(-1)
        else:
            self.flat = t.detach().view(-1)

    def done(self) -> None:
        if self.copied:
            with torch.no_grad():
                self.orig.copy_(self.flat.view(self.orig.shape))


def _launch(g: ProcessGroup, name: str, sig: str, body: Callable[[Op], None], async_op: bool,
            result: Any) -> Work | None:
    op = g.new_op(name, sig, call_site())
    return g.run(op, body, async_op, result)


def broadcast(tensor: torch.Tensor, src: int | None = None, group: AnyGroup | None = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    g = resolve_group(group, "broadcast")
    _tensor(tensor, "broadcast", "tensor")
    root = _root(g, "broadcast", src, group_src, "src")
    buf = _Flat(tensor, load=(g.group_rank == root))

    def body(op: Op) -> None:
        if g.shares_memory:
            algo.shm_broadcast(op, buf.flat, root)
        else:
            algo.hierarchical_broadcast(op, buf.flat, root)  # a tree when on one host
        buf.done()

    return _launch(g, "broadcast", _sig("broadcast", tensor, root=root), body, async_op, [tensor])


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
               async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_reduce")
    _tensor(tensor, "all_reduce", "tensor")
    check_dtype(op, tensor.dtype)
    buf = _Flat(tensor)
    name, fn = algo.select_all_reduce(g, buf.flat)

    def body(o: Op) -> None:
        fn(o, buf.flat, op)
        buf.done()

    sig = _sig("all_reduce", tensor, op=op.name, algorithm=name)
    return _launch(g, "all_reduce", sig, body, async_op, [tensor])


def all_reduce_coalesced(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                         group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    """All-reduce several tensors of one dtype in one call, each in place.

    Same-host groups stream them through shared memory as they are (no flat copy);
    elsewhere they are packed into one buffer, all-reduced, and unpacked.
    """
    g = resolve_group(group, "all_reduce_coalesced")
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise ArgumentError("all_reduce_coalesced: tensors must be a non-empty list of tensors")
    ts = [_tensor(t, "all_reduce_coalesced", f"tensors[{i}]") for i, t in enumerate(tensors)]
    dtype = ts[0].dtype
    for i, t in enumerate(ts):
        if t.dtype != dtype:
            raise ArgumentError(f"all_reduce_coalesced: tensors[{i}] is {t.dtype}, tensors[0] "
                                f"is {dtype}; one call takes one dtype")
    check_dtype(op, dtype)
    bufs = [_Flat(t) for t in ts]
    sizes = [b.flat.numel() for b in bufs]
    if g.shares_memory and algo.select_all_reduce(g, bufs[0].flat)[0] == "shm":
        name = "shm"

        def body(o: Op) -> None:
            algo.shm_all_reduce_many(o, [b.flat for b in bufs], op)
            for b in bufs:
                b.done()
    else:
        packed = torch.cat([b.flat for b in bufs])
        name, fn = algo.select_all_reduce(g, packed)

        def body(o: Op) -> None:
            packed.copy_(torch.cat([b.flat for b in bufs]))  # the values as of the call
            fn(o, packed, op)
            with torch.no_grad():
                for b, part in zip(bufs, packed.split(sizes)):
                    b.flat.copy_(part)
                    b.done()

    layout = zlib.crc32(struct.pack(f"<{len(sizes)}q", *sizes))
    sig = _sig("all_reduce_coalesced", None, dtype=_dtype_name(dtype), tensors=len(sizes),
               numel=sum(sizes), layout=f"{layout:08x}", op=op.name, algorithm=name)
    return _launch(g, "all_reduce_coalesced", sig, body, async_op, list(tensors))


def reduce(tensor: torch.Tensor, dst: int | None = None, op: ReduceOp = ReduceOp.SUM,
           group: AnyGroup | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    g = resolve_group(group, "reduce")
    _tensor(tensor, "reduce", "tensor")
    check_dtype(op, tensor.dtype)
    root = _root(g, "reduce", dst, group_dst, "dst")
    buf = _Flat(tensor)

    def body(o: Op) -> None:
        algo.tree_reduce(o, buf.flat, root, op)
        if g.group_rank == root:
            buf.done()

    sig = _sig("reduce", tensor, op=op.name, root=root)
    return _launch(g, "reduce", sig, body, async_op, [tensor])


def _gather_ring(g: ProcessGroup, op: Op, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    sizes = [t.numel() for t in outs]
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    # the group's working memory, not a fresh buffer: at 4 x 64 MB, faulting a new one in
    # cost more than the copies (an all-gather's ring and leaders use no scratch)
    flat = g.scratch(start, mine.dtype)
    a, b = bounds[g.group_rank]
    flat[a:b].copy_(mine.reshape(-1))
    algo.hierarchical_all_gather(op, flat, bounds)  # the ring when on one host
    with torch.no_grad():
        for t, (a, b) in zip(outs, bounds):
            t.copy_(flat[a:b].view(t.shape))


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor,
               group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_gather")
    _tensor(tensor, "all_gather", "tensor")
    outs = _tensors(tensor_list, "all_gather", "tensor_list", g.group_size, tensor.dtype)
    if outs[g.group_rank].numel() != tensor.numel():
        raise ArgumentError(f"all_gather: tensor_list[{g.group_rank}] has "
                            f"{outs[g.group_rank].numel()} elements, tensor has {tensor.numel()}")

    def body(o: Op) -> None:
        if g.shares_memory:
            flats = [_Flat(t, load=False) for t in outs]
            algo.shm_all_gather(o, [f.flat for f in flats], tensor.reshape(-1))
            for f in flats:
                f.done()
        else:
            _gather_ring(g, o, outs, tensor)

    if g.shares_memory:  # members read each other's sizes from here: all must agree
        layout = zlib.crc32(struct.pack(f"<{len(outs)}q", *(t.numel() for t in outs)))
        sig = _sig("all_gather", None, dtype=tensor.dtype, sizes=f"{layout:08x}")
    else:
        sig = _sig("all_gather", None, dtype=tensor.dtype)
    return _launch(g, "all_gather", sig, body, async_op, tensor_list)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_gather_into_tensor")
    _tensor(output_tensor, "all_gather_into_tensor", "output_tensor")
    _tensor(input_tensor, "all_gather_into_tensor", "input_tensor")
    n = input_tensor.numel()
    if output_tensor.numel() != n * g.group_size or output_tensor.dtype != input_tensor.dtype:
        raise ArgumentError(
            f"all_gather_into_tensor: output_tensor must hold {g.group_size} x {n} elements of "
            f"{input_tensor.dtype}, got {output_tensor.numel()} of {output_tensor.dtype}")
    out = _Flat(output_tensor, load=False)

    def body(o: Op) -> None:
        r = g.group_rank
        if g.shares_memory:
            algo.shm_all_gather(o, list(out.flat.split(n)) if n else [out.flat] * g.group_size,
                                input_tensor.reshape(-1))
        else:
            out.flat[r * n:(r + 1) * n].copy_(input_tensor.reshape(-1))
            algo.hierarchical_all_gather(o, out.flat,
                                         [(i * n, (i + 1) * n) for i in range(g.group_size)])
        out.done()

    sig = _sig("all_gather_into_tensor", input_tensor)
    return _launch(g, "all_gather_into_tensor", sig, body, async_op, [output_tensor])


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int | None = None, group: AnyGroup | None = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    g = resolve_group(group, "gather")
    _tensor(tensor, "gather", "tensor")
    root = _root(g, "gather", dst, group_dst, "dst")
    outs: list[_Flat] | None = None
    if g.group_rank == root:
        if gather_list is None:
            raise ArgumentError("gather: the destination rank must pass gather_list")
        lst = _tensors(gather_list, "gather", "gather_list", g.group_size, tensor.dtype)
        _sizes_match(lst, "gather", "gather_list", tensor.numel())
        outs = [_Flat(t, load=False) for t in lst]
    src = _Flat(tensor)

    def body(o: Op) -> None:
        algo.direct_gather(o, src.flat, [f.flat for f in outs] if outs else None, root)
        for f in outs or []:
            f.done()

    return _launch(g, "gather", _sig("gather", tensor, root=root), body, async_op, gather_list)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
            src: int | None = None, group: AnyGroup | None = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    g = resolve_group(group, "scatter")
    _tensor(tensor, "scatter", "tensor")
    root = _root(g, "scatter", src, group_src, "src")
    ins: list[torch.Tensor] | None = None
    if g.group_rank == root:
        if scatter_list is None:
            raise ArgumentError("scatter: the source rank must pass scatter_list")
        ins = [t.contiguous().view(-1) for t in
               _tensors(scatter_list, "scatter", "scatter_list", g.group_size, tensor.dtype)]
        _sizes_match(ins, "scatter", "scatter_list", tensor.numel())
    out = _Flat(tensor, load=False)

    def body(o: Op) -> None:
        algo.direct_scatter(o, out.flat, ins, root)
        out.done()

    return _launch(g, "scatter", _sig("scatter", tensor, root=root), body, async_op, [tensor])


def _reduce_scatter_flat(g: ProcessGroup, o: Op, flat: torch.Tensor, sizes: Sequence[int],
                         op: ReduceOp) -> tuple[int, int]:
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    algo.hierarchical_reduce_scatter(o, flat, bounds, op)  # the ring when on one host
    return bounds[g.group_rank]


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor],
                   op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
                   async_op: bool = False) -> Work | None:
    g = resolve_group(group, "reduce_scatter")
    _tensor(output, "reduce_scatter", "output")
    check_dtype(op, output.dtype)
    ins = _tensors(input_list, "reduce_scatter", "input_list", g.group_size, output.dtype)
    if ins[g.group_rank].numel() != output.numel():
        raise ArgumentError(f"reduce_scatter: input_list[{g.group_rank}] has "
                            f"{ins[g.group_rank].numel()} elements, output has {output.numel()}")

    def body(o: Op) -> None:
        if g.shares_memory:
            out = _Flat(output, load=False)
            algo.shm_reduce_scatter(o, out.flat, [t.reshape(-1) for t in ins], op)
            out.done()
            return
        flat = torch.cat([t.reshape(-1) for t in ins])
        a, b = _reduce_scatter_flat(g, o, flat, [t.numel() for t in ins], op)
        with torch.no_grad():
            output.copy_(flat[a:b].view(output.shape))

    sig = _sig("reduce_scatter", None, dtype=output.dtype, op=op.name,
               sizes=[t.numel() for t in ins])
    return _launch(g, "reduce_scatter", sig, body, async_op, [output])


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor,
                          op: ReduceOp = ReduceOp.SUM, group: AnyGroup | None = None,
                          async_op: bool = False) -> Work | None:
    g = resolve_group(group, "reduce_scatter_tensor")
    _tensor(output, "reduce_scatter_tensor", "output")
    _tensor(input, "reduce_scatter_tensor", "input")
    check_dtype(op, output.dtype)
    n = output.numel()
    if input.numel() != n * g.group_size or input.dtype != output.dtype:
        raise ArgumentError(
            f"reduce_scatter_tensor: input must hold {g.group_size} x {n} elements of "
            f"{output.dtype}, got {input.numel()} of {input.dtype}")

    def body(o: Op) -> None:
        if g.shares_memory:
            out = _Flat(output, load=False)
            algo.shm_reduce_scatter(o, out.flat, list(input.reshape(-1).split(n)) if n else
                                    [input.reshape(-1)] * g.group_size, op)
            out.done()
            return
        flat = input.reshape(-1).clone()  # the caller's input stays untouched
        a, b = _reduce_scatter_flat(g, o, flat, [n] * g.group_size, op)
        with torch.no_grad():
            output.copy_(flat[a:b].view(output.shape))

    sig = _sig("reduce_scatter_tensor", output, op=op.name)
    return _launch(g, "reduce_scatter_tensor", sig, body, async_op, [output])


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_to_all")
    if not input_tensor_list:
        raise ArgumentError("all_to_all: input_tensor_list is empty")
    dtype = _tensor(input_tensor_list[0], "all_to_all", "input_tensor_list[0]").dtype
    ins = [t.contiguous() for t in
           _tensors(input_tensor_list, "all_to_all", "input_tensor_list", g.group_size, dtype)]
    outs = [_Flat(t, load=False) for t in
            _tensors(output_tensor_list, "all_to_all", "output_tensor_list", g.group_size, dtype)]
    r = g.group_rank
    if outs[r].flat.numel() != ins[r].numel():
        raise ArgumentError(f"all_to_all: output_tensor_list[{r}] has {outs[r].flat.numel()} "
                            f"elements, input_tensor_list[{r}] has {ins[r].numel()}")

    def body(o: Op) -> None:
        algo.pairwise_all_to_all(o, [f.flat for f in outs], [t.view(-1) for t in ins])
        for f in outs:
            f.done()

    return _launch(g, "all_to_all", _sig("all_to_all", None, dtype=dtype), body, async_op,
                   output_tensor_list)


def _splits(t: torch.Tensor, sizes: Sequence[int] | None, p: int, name: str) -> list[int]:
    rows = t.shape[0] if t.dim() > 0 else t.numel()
    if sizes is None or len(sizes) == 0:
        if rows % p:
            raise ArgumentError(f"all_to_all_single: {name} has {rows} rows, not divisible by "
                                f"{p} ranks; pass {name}_split_sizes")
        return [rows // p] * p
    sizes = list(sizes)
    if len(sizes) != p or sum(sizes) != rows or min(sizes) < 0:
        raise ArgumentError(f"all_to_all_single: {name}_split_sizes={sizes} must be {p} "
                            f"non-negative sizes adding up to {rows} rows")
    return sizes


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_to_all_single")
    _tensor(output, "all_to_all_single", "output")
    _tensor(input, "all_to_all_single", "input")
    if output.dtype != input.dtype:
        raise ArgumentError(f"all_to_all_single: output is {output.dtype}, input {input.dtype}")
    p = g.group_size
    in_sizes = _splits(input, input_split_sizes, p, "input")
    out_sizes = _splits(output, output_split_sizes, p, "output")
    src = input.contiguous()
    out = _Flat(output, load=False)
    row_in = src[0].numel() if src.dim() > 0 and src.shape[0] else 1
    row_out = out.orig[0].numel() if output.dim() > 0 and output.shape[0] else 1

    def pieces(flat: torch.Tensor, sizes: list[int], row: int) -> list[torch.Tensor]:
        return list(flat.split([s * row for s in sizes]))

    def body(o: Op) -> None:
        algo.pairwise_all_to_all(o, pieces(out.flat, out_sizes, row_out),
                                 pieces(src.view(-1), in_sizes, row_in))
        out.done()

    return _launch(g, "all_to_all_single", _sig("all_to_all_single", None, dtype=input.dtype),
                   body, async_op, [output])


def barrier(group: AnyGroup | None = None, async_op: bool = False,
            device_ids: Any = None, timeout: float | datetime.timedelta | None = None) -> Work | None:
    """Return once every rank of the group has entered the barrier (``timeout``: this call's
    deadline instead of the group's)."""
    g = resolve_group(group, "barrier")
    token = torch.zeros(1, dtype=torch.uint8)
    seconds = None if timeout is None else timeout_seconds(timeout, g.timeout)

    def body(o: Op) -> None:
        if seconds is not None:
            o.deadline = time.monotonic() + seconds
        algo.ALL_REDUCE["doubling"](o, token, ReduceOp.MAX)

    return _launch(g, "barrier", "barrier", body, async_op, None)


def monitored_barrier(group: AnyGroup | None = None,
                      timeout: float | datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive within ``timeout``.

    Rank 0 of the group collects an arrival from every other rank, then releases
    them. With ``wait_all_ranks`` it waits the full timeout and names every missing
    rank; otherwise it reports the first one it runs out of time on.
    """
    g = resolve_group(group, "monitored_barrier")
    seconds = timeout_seconds(timeout, g.timeout)
    token = torch.zeros(1, dtype=torch.uint8)

    def body(o: Op) -> None:
        o.deadline = time.monotonic() + seconds
        if g.group_rank != 0:
            o.wait(o.send(0, 0, as_bytes(token)))
            o.wait(o.recv(0, 1, as_bytes(torch.zeros(1, dtype=torch.uint8))))
            return
        slots = [o.recv(i, 0, as_bytes(torch.zeros(1, dtype=torch.uint8)))
                 for i in range(1, g.group_size)]
        missing = []
        for i, slot in enumerate(slots, start=1):
            try:
                o.wait(slot)
            except CollectiveTimeoutError:
                missing.append(g.ranks[i])
                if not wait_all_ranks:
                    break
        if missing:
            raise CollectiveTimeoutError(
                f"monitored_barrier on group '{g.group_name}': rank(s) {missing} did not "
                f"arrive within {seconds:.1f}s", tuple(missing))
        o.wait(*[o.send(i, 1, as_bytes(token)) for i in range(1, g.group_size)])

    _launch(g, "monitored_barrier", "monitored_barrier", body, False, None)
