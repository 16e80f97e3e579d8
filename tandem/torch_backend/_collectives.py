"""The collective methods torch calls on a process group, mapped onto tandem's functions.

torch's Python API (``torch.distributed.all_reduce`` and friends), its C++ code (DDP's
reducer, functional collectives through pybind11) and object collectives all land
on these methods, with group ranks for roots and one options object per call. Each
method checks what tandem cannot serve, then runs the matching function of
:mod:`tandem.collectives.api` on the group's tandem ``ProcessGroup``, so signatures,
mismatch detection, deadlines and algorithm choice are tandem's own. The coalesced
all-gather and reduce-scatter of small tensors run as one packed call
(:mod:`tandem.torch_backend._fused`).
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tandem.collectives import alltoall, api
from tandem.collectives.checks import plain_output
from tandem.collectives.group import ProcessGroup
from tandem.collectives.reduce_op import ReduceOp, accepts
from tandem.errors import ArgumentError, TandemError
from tandem.torch_backend._options import (cpu_tensors, one_tensor, premultiplied, reduce_op,
                                           root_tensor_zero)
from tandem.torch_backend._fused import packed_all_gather, packed_reduce_scatter
from tandem.torch_backend._work import NO_TIMEOUT

__all__ = ["Collectives"]

def _pairs(outputs: Sequence[Any], inputs: Sequence[Any], what: str) -> None:
    if len(outputs) != len(inputs):
        raise ArgumentError(f"{what}: {len(outputs)} output tensors for {len(inputs)} inputs")
    cpu_tensors(outputs, what, "outputs")
    cpu_tensors(inputs, what, "inputs")


def _all_reduce(t: torch.Tensor, op: ReduceOp, g: ProcessGroup, async_op: bool) -> Any:
    """tandem's all_reduce, without its argument checks when ``t`` and ``op`` plainly pass
    them (torch hands over checked tensors nearly always); else with them, for their
    messages."""
    if plain_output(t) and accepts(op, t.dtype):
        return api.checked_all_reduce(g, t, op, async_op)
    return api.all_reduce(t, op, g, async_op)


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype, in order of first appearance (alike on every rank)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


class Collectives:
    """Collective methods of :class:`~tandem.torch_backend.TandemProcessGroup`."""

    _call: Callable[..., dist.Work | None]
    _coalesced: list[Any] | None
    _group: ProcessGroup
    _config_checked: bool

    def _usable(self) -> ProcessGroup:
        raise NotImplementedError  # the process group's tandem group, checked on first use

    def _reraise(self, exc: TandemError) -> NoReturn:
        raise NotImplementedError  # raises the exception torch code expects for ``exc``

    # -- all-reduce family -------------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor],
                  opts: c10d.AllreduceOptions | None = None) -> dist.Work | None:
        # the small-message latency path, every step counted: each pybind11 option read
        # costs 0.1-0.2 us, and checks tandem's all_reduce would repeat are made once
        if opts is None:
            opts = c10d.AllreduceOptions()
        g = self._group if self._config_checked else self._usable()
        t = one_tensor(tensors, "allreduce")
        op, factor = reduce_op(opts.reduceOp, "allreduce")
        if factor is not None:
            premultiplied(t, factor, in_place=True)
        if opts.asyncOp or opts.timeout > NO_TIMEOUT or self._coalesced is not None:
            return self._call("allreduce", opts, _all_reduce, (t, op, g), [t])
        try:  # _call's inline case, spelled out
            _all_reduce(t, op, g, False)
        except TandemError as exc:
            self._reraise(exc)
        return None

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor],
                            opts: c10d.AllreduceCoalescedOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.AllreduceCoalescedOptions()
        g = self._usable()
        cpu_tensors(tensors, "allreduce_coalesced", "tensors")
        op, factor = reduce_op(opts.reduceOp, "allreduce_coalesced")
        for t in tensors:
            premultiplied(t, factor, in_place=True)
        same = _by_dtype(tensors)  # tandem's coalesced call takes one dtype
        return self._call("allreduce_coalesced", opts,
                          lambda a: [api.all_reduce_coalesced(ts, op, g, a) for ts in same], (),
                          list(tensors))

    def reduce(self, tensors: Sequence[torch.Tensor],
               opts: c10d.ReduceOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.ReduceOptions()
        g = self._usable()
        t = one_tensor(tensors, "reduce")
        root_tensor_zero(opts, "reduce")
        op, factor = reduce_op(opts.reduceOp, "reduce")
        premultiplied(t, factor, in_place=True)
        root = opts.rootRank
        return self._call("reduce", opts,
                          lambda a: api.reduce(t, None, op, g, a, group_dst=root), (), [t])

    def reduce_scatter(self, output_tensors: Sequence[torch.Tensor],
                       input_tensors: Sequence[Sequence[torch.Tensor]],
                       opts: c10d.ReduceScatterOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.ReduceScatterOptions()
        g = self._usable()
        out = one_tensor(output_tensors, "reduce_scatter", "output_tensors")
        if len(input_tensors) != 1:
            raise ArgumentError(f"reduce_scatter: input_tensors must hold one list of tensors, "
                                f"got {len(input_tensors)}")
        cpu_tensors(input_tensors[0], "reduce_scatter", "input_tensors[0]")
        op, factor = reduce_op(opts.reduceOp, "reduce_scatter")
        ins = [premultiplied(t, factor, in_place=False) for t in input_tensors[0]]
        return self._call("reduce_scatter", opts,
                          api.reduce_scatter, (out, ins, op, g), [out])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: c10d.ReduceScatterOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.ReduceScatterOptions()
        g = self._usable()
        _pairs((output,), (input,), "reduce_scatter_tensor")
        op, factor = reduce_op(opts.reduceOp, "reduce_scatter_tensor")
        input = premultiplied(input, factor, in_place=False)
        return self._call("reduce_scatter_tensor", opts, api.reduce_scatter_tensor,
                          (output, input, op, g), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: Sequence[torch.Tensor],
                                        inputs: Sequence[torch.Tensor],
                                        opts: c10d.ReduceScatterOptions | None = None
                                        ) -> dist.Work | None:
        opts = opts or c10d.ReduceScatterOptions()
        g = self._usable()
        _pairs(outputs, inputs, "reduce_scatter_tensor")
        op, factor = reduce_op(opts.reduceOp, "reduce_scatter_tensor")
        pairs = [(o, premultiplied(i, factor, in_place=False)) for o, i in zip(outputs, inputs)]
        packed = None if self._coalesced is not None else packed_reduce_scatter(
            outputs, [i for _, i in pairs], g.group_size)
        if packed is not None:
            return self._call("reduce_scatter_tensor", opts, api.reduce_scatter_tensor,
                              (packed.output, packed.input, op, g), list(outputs),
                              packed.unpack)
        return self._call("reduce_scatter_tensor", opts,
                          lambda a: [api.reduce_scatter_tensor(o, i, op, g, a)
                                     for o, i in pairs], (), list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- broadcast and gathers -----------------------------------------------------------
    def broadcast(self, tensors: Sequence[torch.Tensor],
                  opts: c10d.BroadcastOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.BroadcastOptions()
        g = self._usable()
        t = one_tensor(tensors, "broadcast")
        root_tensor_zero(opts, "broadcast")
        root = opts.rootRank
        return self._call("broadcast", opts,
                          lambda a: api.broadcast(t, None, g, a, group_src=root), (), [t])

    def allgather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
                  input_tensors: Sequence[torch.Tensor],
                  opts: c10d.AllgatherOptions | None = None) -> dist.Work | None:
        """``output_tensors[i][r]`` receives rank ``r``'s ``input_tensors[i]`` (one list of
        outputs per input: ``all_gather`` passes ``[tensor_list], [tensor]``)."""
        opts = opts or c10d.AllgatherOptions()
        g = self._usable()
        _pairs(output_tensors, input_tensors, "allgather")
        return self._gather_lists("allgather", opts, g,
                                  [list(outs) for outs in output_tensors], input_tensors)

    def allgather_coalesced(self, output_lists: Sequence[Sequence[torch.Tensor]],
                            input_tensors: Sequence[torch.Tensor],
                            opts: c10d.AllgatherOptions | None = None) -> dist.Work | None:
        """``output_lists[r][i]`` receives rank ``r``'s ``input_tensors[i]`` (one list per
        rank, as ``all_gather_coalesced`` passes them: the transpose of ``allgather``'s)."""
        opts = opts or c10d.AllgatherOptions()
        g = self._usable()
        cpu_tensors(input_tensors, "allgather_coalesced", "input_tensors")
        if len(output_lists) != g.group_size:
            raise ArgumentError(f"all_gather_coalesced: output_tensor_lists must hold one list "
                                f"per rank ({g.group_size}), got {len(output_lists)}")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_tensors):
                raise ArgumentError(
                    f"all_gather_coalesced: output_tensor_lists[{r}] holds {len(outs)} tensors "
                    f"for {len(input_tensors)} inputs; each rank's list has one per input")
        per_input = [[outs[i] for outs in output_lists] for i in range(len(input_tensors))]
        return self._gather_lists("allgather_coalesced", opts, g, per_input, input_tensors)

    def _gather_lists(self, what: str, opts: c10d.AllgatherOptions, g: ProcessGroup,
                      per_input: list[list[torch.Tensor]],
                      input_tensors: Sequence[torch.Tensor]) -> dist.Work | None:
        """One tandem all_gather per input ``i`` into ``per_input[i]`` (one tensor per rank)."""
        for outs in per_input:
            cpu_tensors(outs, what, "output_tensors")
        pairs = list(zip(per_input, input_tensors))
        return self._call(what, opts,
                          lambda a: [api.all_gather(outs, t, g, a) for outs, t in pairs], (),
                          per_input)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: c10d.AllgatherOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.AllgatherOptions()
        g = self._usable()
        _pairs((output,), (input,), "all_gather_into_tensor")
        return self._call("all_gather_into_tensor", opts, api.all_gather_into_tensor,
                          (output, input, g), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: Sequence[torch.Tensor],
                                    inputs: Sequence[torch.Tensor],
                                    opts: c10d.AllgatherOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.AllgatherOptions()
        g = self._usable()
        _pairs(outputs, inputs, "all_gather_into_tensor")
        packed = None if self._coalesced is not None else packed_all_gather(
            outputs, inputs, g.group_size)
        if packed is not None:
            return self._call("all_gather_into_tensor", opts, api.all_gather_into_tensor,
                              (packed.output, packed.input, g), list(outputs), packed.unpack)
        pairs = list(zip(outputs, inputs))
        return self._call("all_gather_into_tensor", opts,
                          lambda a: [api.all_gather_into_tensor(o, i, g, a) for o, i in pairs], (),
                          list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: Sequence[Sequence[torch.Tensor]],
               input_tensors: Sequence[torch.Tensor],
               opts: c10d.GatherOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.GatherOptions()
        g = self._usable()
        t = one_tensor(input_tensors, "gather", "input_tensors")
        root = opts.rootRank
        outs = _at_root(g, root, output_tensors, "gather", "output_tensors")
        return self._call("gather", opts,
                          lambda a: api.gather(t, outs, None, g, a, group_dst=root), (),
                          [outs or []])

    def scatter(self, output_tensors: Sequence[torch.Tensor],
                input_tensors: Sequence[Sequence[torch.Tensor]],
                opts: c10d.ScatterOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.ScatterOptions()
        g = self._usable()
        t = one_tensor(output_tensors, "scatter", "output_tensors")
        root = opts.rootRank
        ins = _at_root(g, root, input_tensors, "scatter", "input_tensors")
        return self._call("scatter", opts,
                          lambda a: api.scatter(t, ins, None, g, a, group_src=root), (), [t])

    # -- all-to-all ------------------------------------------------------------------------
    def alltoall(self, output_tensors: Sequence[torch.Tensor],
                 input_tensors: Sequence[torch.Tensor],
                 opts: c10d.AllToAllOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.AllToAllOptions()
        g = self._usable()
        cpu_tensors(output_tensors, "alltoall", "output_tensors")
        cpu_tensors(input_tensors, "alltoall", "input_tensors")
        outs, ins = list(output_tensors), list(input_tensors)
        return self._call("alltoall", opts, alltoall.all_to_all, (outs, ins, g), outs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None,
                          opts: c10d.AllToAllOptions | None = None) -> dist.Work | None:
        opts = opts or c10d.AllToAllOptions()
        g = self._usable()
        cpu_tensors([output, input], "all_to_all_single", "tensors")
        return self._call("all_to_all_single", opts,
                          alltoall.all_to_all_single,
                          (output, input, output_split_sizes, input_split_sizes, g), [output])

    alltoall_base = all_to_all_single


def _at_root(g: ProcessGroup, root: int, lists: Sequence[Sequence[torch.Tensor]], what: str,
             name: str) -> list[torch.Tensor] | None:
    """At the root, the single list of torch's one-list-per-process argument; else None."""
    if g.group_rank != root:
        return None
    if len(lists) != 1:
        raise ArgumentError(f"{what}: the root's {name} must hold one list of tensors, got "
                            f"{len(lists)}")
    cpu_tensors(lists[0], what, f"{name}[0]")
    return list(lists[0])
