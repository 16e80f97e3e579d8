"""Collectives that autograd differentiates, with the names of ``torch.distributed.nn``.

    import tandem.nn.functional as F            # torch: torch.distributed.nn.functional
    feats = torch.cat(F.all_gather(local))      # every rank's features, with gradients
    loss = contrastive(local, feats)
    loss.backward()                             # each rank's gradient reaches its owner

Each function returns new tensors (its input is not changed) whose backward pass is the
matching collective: all_reduce's is an all_reduce, broadcast's a reduce to the source,
all_gather's a reduce_scatter, and so on. Every rank must run the backward pass, since
it communicates. A rank's gradient is that of the sum of every rank's loss, as if one
process had run the whole job. ``src``/``dst`` are global ranks, as in torch.

Only linear reductions have a gradient: SUM and AVG. A call with another op (MAX,
PRODUCT, a custom op...) is refused when autograd would need its gradient, instead of
returning a wrong one; under ``torch.no_grad()`` or for tensors that need no gradient
every op works.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd import Function

import tandem
from tandem.collectives.reduce_op import ReduceOp
from tandem.errors import ArgumentError

__all__ = ["broadcast", "gather", "scatter", "reduce", "reduce_scatter", "all_gather",
           "all_to_all", "all_to_all_single", "all_reduce"]

_LINEAR = ("SUM", "AVG")


def _check_op(op: ReduceOp, what: str, tensors: Sequence[torch.Tensor]) -> None:
    if not isinstance(op, ReduceOp):
        raise ArgumentError(f"{what}: op must be a tandem ReduceOp, got {op!r}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if needs_grad and op.name not in _LINEAR:
        raise ArgumentError(
            f"{what}: ReduceOp.{op.name} has no gradient here (only SUM and AVG are linear); "
            f"use SUM or AVG, or call it under torch.no_grad() or on a tensor that needs "
            f"no gradient")


def _size(group: Any) -> int:
    return tandem.get_world_size(group)


def _scaled(op: ReduceOp, group: Any, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """AVG divides by the group's size, so its gradient does too."""
    if op.name == "AVG":
        n = _size(group)
        return tuple(g / n for g in grads)
    return tuple(grads)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, group: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.op, ctx.group = op, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        tandem.all_reduce(out, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # SUM: every output depends on every input with weight 1; AVG: with 1/n
        return None, None, _AllReduce.apply(ctx.op, ctx.group, grad)


class _Broadcast(Function):
    @staticmethod
    def forward(ctx: Any, src: int, group: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.src, ctx.group = src, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        tandem.broadcast(out, src, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        summed = _Reduce.apply(ctx.src, ReduceOp.SUM, ctx.group, grad)
        if tandem.get_rank() != ctx.src:
            summed = torch.zeros_like(summed)  # only the source's tensor was sent anywhere
        return None, None, summed


class _Reduce(Function):
    @staticmethod
    def forward(ctx: Any, dst: int, op: ReduceOp, group: Any,
                tensor: torch.Tensor) -> torch.Tensor:
        ctx.dst, ctx.op, ctx.group = dst, op, group
        out = tensor.clone(memory_format=torch.contiguous_format)
        tandem.reduce(out, dst, op=op, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # only the destination's output is the reduction; its gradient goes to every input
        spread = _Broadcast.apply(ctx.dst, ctx.group, grad)
        return (None, None, None) + _scaled(ctx.op, ctx.group, [spread])


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, group: Any, output: list[torch.Tensor],
                *inputs: torch.Tensor) -> torch.Tensor:
        ctx.op, ctx.group = op, group
        out = output[0]  # the caller's tensor, filled as torch's function fills it
        tandem.reduce_scatter(out, [t.contiguous() for t in inputs], op=op, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gathered = _AllGather.apply(ctx.group, grad)
        return (None, None, None) + _scaled(ctx.op, ctx.group, gathered)


class _AllGather(Function):
    @staticmethod
    def forward(ctx: Any, group: Any, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        outs = [torch.empty_like(tensor, memory_format=torch.contiguous_format)
                for _ in range(_size(group))]
        tandem.all_gather(outs, tensor.contiguous(), group=group)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        # my tensor is every rank's output number <my rank>: its gradient is their sum
        mine = torch.empty_like(grads[0], memory_format=torch.contiguous_format)
        return None, _ReduceScatter.apply(ReduceOp.SUM, ctx.group, [mine], *grads)


class _Gather(Function):
    @staticmethod
    def forward(ctx: Any, dst: int, group: Any, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dst, ctx.group = dst, group
        outs = [torch.zeros_like(tensor, memory_format=torch.contiguous_format)
                for _ in range(_size(group))]
        here = tandem.get_rank() == dst
        tandem.gather(tensor.contiguous(), outs if here else None, dst, group=group)
        return tuple(outs)  # zeros except on dst, as torch's

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return None, None, _Scatter.apply(ctx.dst, ctx.group, *grads)


class _Scatter(Function):
    @staticmethod
    def forward(ctx: Any, src: int, group: Any, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.src, ctx.group = src, group
        out = torch.zeros_like(tensors[0], memory_format=torch.contiguous_format)
        here = tandem.get_rank() == src
        tandem.scatter(out, [t.contiguous() for t in tensors] if here else None, src,
                       group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        # the gradients of the source's tensors; zeros elsewhere (nothing was sent)
        return (None, None) + _Gather.apply(ctx.src, ctx.group, grad)


class _AllToAll(Function):
    @staticmethod
    def forward(ctx: Any, group: Any, outputs: list[torch.Tensor],
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.shapes = [(t.shape, t.dtype) for t in inputs]
        tandem.all_to_all(outputs, [t.contiguous() for t in inputs], group=group)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        back = [torch.empty(shape, dtype=dtype) for shape, dtype in ctx.shapes]
        return (None, None) + _AllToAll.apply(ctx.group, back, *grads)


class _AllToAllSingle(Function):
    @staticmethod
    def forward(ctx: Any, group: Any, output: list[torch.Tensor], out_splits: Any,
                in_splits: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        ctx.shape = tensor.shape
        tandem.all_to_all_single(output[0], tensor.contiguous(), out_splits, in_splits,
                                 group=group)
        return output[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits = ctx.splits
        back = torch.empty(ctx.shape, dtype=grad.dtype)
        # what I received from rank j goes back to rank j: the splits swap
        return (None, None, None, None,
                _AllToAllSingle.apply(ctx.group, [back], in_splits, out_splits,
                                      grad.contiguous()))


# -- the public functions, with torch's signatures -----------------------------------------
def broadcast(tensor: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    """``src``'s tensor on every rank; the gradient flows back to ``src``."""
    return _Broadcast.apply(src, group, tensor)


def gather(tensor: torch.Tensor, dst: int = 0, group: Any = None) -> tuple[torch.Tensor, ...]:
    """Every rank's tensor, in group-rank order, on ``dst`` (zeros on the other ranks)."""
    return _Gather.apply(dst, group, tensor)


def scatter(tensors: Sequence[torch.Tensor], src: int = 0,
            group: Any = None) -> torch.Tensor:
    """Part i of ``src``'s ``tensors`` to group rank i; every rank passes tensors of the
    same shape (only ``src``'s are sent)."""
    if not tensors:
        raise ArgumentError("scatter: tensors must hold one tensor per rank, got none")
    if len({t.shape for t in tensors}) != 1:
        raise ArgumentError(f"scatter: the tensors must have one shape, got "
                            f"{[tuple(t.shape) for t in tensors]}")
    return _Scatter.apply(src, group, *tensors)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
           group: Any = None) -> torch.Tensor:
    """The reduction on ``dst`` (other ranks' results are not defined, as in torch)."""
    _check_op(op, "reduce", [tensor])
    return _Reduce.apply(dst, op, group, tensor)


def reduce_scatter(output: torch.Tensor, input_list: Sequence[torch.Tensor],
                   op: ReduceOp = ReduceOp.SUM, group: Any = None) -> torch.Tensor:
    """Reduce ``input_list`` over the ranks and give rank i part i: fills ``output`` and
    returns it, with a gradient to every rank's inputs."""
    _check_op(op, "reduce_scatter", list(input_list))
    if not output.is_contiguous():
        raise ArgumentError("reduce_scatter: output must be contiguous (it is filled in place)")
    return _ReduceScatter.apply(op, group, [output], *input_list)


def all_gather(tensor: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, ...]:
    """Every rank's tensor, in group-rank order, on every rank."""
    return _AllGather.apply(group, tensor)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: Sequence[torch.Tensor],
               group: Any = None) -> tuple[torch.Tensor, ...]:
    """Part i of my inputs to rank i; ``output_tensor_list`` receives rank j's part in
    place j and is returned as a tuple."""
    return _AllToAll.apply(group, output_tensor_list, *input_tensor_list)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: Any = None) -> torch.Tensor:
    """``all_to_all`` on rows of one tensor: fills ``output`` and returns it."""
    return _AllToAllSingle.apply(group, [output], output_split_sizes, input_split_sizes,
                                 input)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
               group: Any = None) -> torch.Tensor:
    """The reduction over every rank, as a new tensor on every rank."""
    _check_op(op, "all_reduce", [tensor])
    return _AllReduce.apply(op, group, tensor)
