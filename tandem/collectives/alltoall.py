"""all_to_all and all_to_all_single: every rank sends a piece to every rank.

``all_to_all`` takes a list of tensors per rank (piece ``i`` goes to group rank ``i``);
``all_to_all_single`` cuts one tensor into rows (``*_split_sizes`` rows per rank, even
splits by default) and receives into one. Pieces move pairwise, straight into the
output (see :func:`~tandem.collectives.algorithms.pairwise_all_to_all`).

What each rank sends a peer is fixed by the sender's input splits and, separately, by
the receiver's output splits, so a rank whose splits disagree with a peer's would move
data into pieces of the wrong size. Before any data moves, every rank therefore sends
every peer its row size and splits (one message of 2p+1 integers each way, the pattern
the data then follows); every rank checks the whole table alike and, on a
disagreement, raises the same error naming both ranks' splits. Small pieces travel
with the splits and wait, parked at their receiver, until the check passed; a failed
check aborts the call, and its parked pieces are dropped unread.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tandem.collectives import algorithms as algo
from tandem.collectives import api
from tandem.collectives.algorithms.flat import Flat
from tandem.collectives.algorithms.leaders import leaders_table
from tandem.collectives.algorithms.select import AllToAll, all_to_all_in_host_arena
from tandem.collectives.checks import (crossed, int_list, output_arg, shares_memory,
                                       tensor_arg, tensors_arg)
from tandem.collectives.group import Op, as_bytes
from tandem.transport import Slot
from tandem.collectives.work import Work
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.errors import ArgumentError, CollectiveMismatchError

__all__ = ["all_to_all", "all_to_all_single"]


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_to_all")
    if not input_tensor_list:
        raise ArgumentError("all_to_all: input_tensor_list is empty")
    dtype = tensor_arg(input_tensor_list[0], "all_to_all", "input_tensor_list[0]").dtype
    ins = [t.contiguous() for t in
           tensors_arg(input_tensor_list, "all_to_all", "input_tensor_list", g.group_size, dtype)]
    outs = [Flat(t, load=False) for t in
            tensors_arg(output_tensor_list, "all_to_all", "output_tensor_list", g.group_size, dtype,
                        output=True)]
    r = g.group_rank
    if crossed(ins, [f.flat for f in outs]):
        # an output that is another part's input would be filled before that part is sent
        ins = [t.clone() for t in ins]
    if outs[r].flat.numel() != ins[r].numel():  # found here, before anything moves
        raise ArgumentError(f"all_to_all: output_tensor_list[{r}] has {outs[r].flat.numel()} "
                            f"elements, input_tensor_list[{r}] has {ins[r].numel()}")
    in_sizes = [t.numel() for t in ins]
    out_sizes = [f.flat.numel() for f in outs]
    name, fn = algo.select_all_to_all(g)

    def body(o: Op) -> None:
        flat_ins = [t.view(-1) for t in ins]
        _exchange(o, name, fn, "all_to_all", 1, in_sizes, out_sizes, "elements",
                  "input_tensor_list numels", "output_tensor_list numels",
                  [f.flat for f in outs], flat_ins)
        for f in outs:
            f.done()

    return api._launch(g, "all_to_all", api._sig("all_to_all", None, dtype=dtype), body, async_op,
                   output_tensor_list)


def _splits(t: torch.Tensor, sizes: Sequence[int] | None, p: int, name: str) -> list[int]:
    rows = t.shape[0] if t.dim() > 0 else t.numel()
    if sizes is None or len(sizes) == 0:
        if rows % p:
            raise ArgumentError(f"all_to_all_single: {name} has {rows} rows, not divisible by "
                                f"{p} ranks; pass {name}_split_sizes")
        return [rows // p] * p
    sizes = int_list(sizes, "all_to_all_single", f"{name}_split_sizes")
    if len(sizes) != p or sum(sizes) != rows or min(sizes) < 0:
        raise ArgumentError(f"all_to_all_single: {name}_split_sizes={sizes} must be {p} "
                            f"non-negative sizes adding up to {rows} rows")
    return sizes


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None,
                      group: AnyGroup | None = None, async_op: bool = False) -> Work | None:
    g = resolve_group(group, "all_to_all_single")
    output_arg(output, "all_to_all_single", "output")
    tensor_arg(input, "all_to_all_single", "input")
    if output.dtype != input.dtype:
        raise ArgumentError(f"all_to_all_single: output is {output.dtype}, input {input.dtype}")
    p = g.group_size
    in_sizes = _splits(input, input_split_sizes, p, "input")
    out_sizes = _splits(output, output_split_sizes, p, "output")
    row_in, row_out = math.prod(input.shape[1:]), math.prod(output.shape[1:])
    if row_in != row_out:
        raise ArgumentError(
            f"all_to_all_single: output has rows of {row_out} elements (shape "
            f"{list(output.shape)}) but input has rows of {row_in} (shape {list(input.shape)}); "
            f"rows move whole, so both need the same number of elements per row")
    # an in-place exchange (output is input) would overwrite rows before they are sent
    src = (input.clone(memory_format=torch.contiguous_format) if shares_memory(output, input)
           else input.contiguous())
    out = Flat(output, load=False)
    name, fn = algo.select_all_to_all(g)

    def pieces(flat: torch.Tensor, sizes: list[int], row: int) -> list[torch.Tensor]:
        return list(flat.split([s * row for s in sizes]))

    def body(o: Op) -> None:
        ins = pieces(src.view(-1), in_sizes, row_in)
        _exchange(o, name, fn, "all_to_all_single", row_in, in_sizes, out_sizes, "rows",
                  "input_split_sizes", "output_split_sizes", pieces(out.flat, out_sizes, row_out),
                  ins)
        out.done()

    return api._launch(g, "all_to_all_single", api._sig("all_to_all_single", None, dtype=input.dtype),
                   body, async_op, [output])


_SPLITS_STEP = 1  # the data moves at step 0
# Pieces up to this size go out with the splits, before the check: their receivers park
# them until the check passed, which saves small calls the check's round trip; larger
# ones wait for the check, so the receiver never copies them twice.
_EARLY_BYTES = 64 << 10


def _agree(o: Op, algorithm: str, what: str, row: int, in_sizes: list[int],
           out_sizes: list[int], unit: str, in_name: str, out_name: str,
           ins: list[torch.Tensor]) -> tuple[dict[int, Slot], list[list[int]]]:
    """Raise, on every rank alike, unless each rank's input piece for every rank is as
    large as that rank's output piece for it (``row`` elements per unit on each side).

    Returns the sends of the pieces of ``ins`` sent with the splits, by peer, and the
    elements each rank sends each rank. Through the hosts' leaders (``algorithm``
    "leaders") the splits go as their data does, and no piece goes early."""
    g = o.group
    p, r = g.group_size, g.group_rank
    mine = _row(row, in_sizes, out_sizes)
    layout = algo.host_layout(g) if algorithm == "leaders" else None
    early: dict[int, Slot] = {}
    if layout is not None:
        table = leaders_table(o, mine, layout)
    else:
        table = [mine if j == r else torch.empty_like(mine) for j in range(p)]
        recvs = [o.recv(j, _SPLITS_STEP, as_bytes(table[j])) for j in range(p) if j != r]
        sends = [o.send(j, _SPLITS_STEP, as_bytes(mine)) for j in range(p) if j != r]
        early = {j: o.send(j, 0, as_bytes(ins[j])) for j in range(p)
                 if j != r and ins[j].numel() * ins[j].element_size() <= _EARLY_BYTES}
        o.wait(*recvs, *sends)
    return early, _check(o, table, what, unit, in_name, out_name)


def _row(row: int, in_sizes: list[int], out_sizes: list[int]) -> torch.Tensor:
    """This rank's row of the split table."""
    return torch.tensor([row, *in_sizes, *out_sizes], dtype=torch.int64)


def _check(o: Op, table: list[torch.Tensor], what: str, unit: str, in_name: str,
           out_name: str) -> list[list[int]]:
    """The elements each rank sends each rank, from every rank's row (by group rank);
    raises the same error on every rank when two ranks disagree."""
    g = o.group
    p = g.group_size
    # checked and counted in torch: at 64 ranks the pairs in Python took ~2 ms a rank
    full = torch.stack(table)
    units = full[:, :1]
    elements = units * full[:, 1:1 + p]  # [a][b]: elements rank a sends rank b
    if torch.equal(elements, (units * full[:, 1 + p:]).T):
        return elements.tolist()
    rows = full.tolist()
    for a in range(p):  # every rank finds the same first disagreement
        for b in range(p):
            sent, expected = rows[a][1 + b], rows[b][1 + p + a]
            if sent * rows[a][0] == expected * rows[b][0]:
                continue
            ga, gb = g.ranks[a], g.ranks[b]
            shapes = ("" if rows[a][0] == rows[b][0] else
                      f" (rows of {rows[a][0]} elements on rank {ga}, {rows[b][0]} on rank {gb})")
            raise CollectiveMismatchError(
                f"{what}: rank {ga} sends rank {gb} {sent} {unit} ({in_name}="
                f"{rows[a][1:1 + p]} on rank {ga}) but rank {gb} expects {expected} {unit} from "
                f"rank {ga} ({out_name}={rows[b][1 + p:]} on rank {gb}){shapes}; "
                f"{out_name}[i] on each rank must match {in_name}[that rank] on rank i")
    raise AssertionError("the split tables differ but no pair of ranks disagrees")


def _exchange(o: Op, algorithm: str, fn: AllToAll, what: str, row: int,
              in_sizes: list[int], out_sizes: list[int], unit: str, in_name: str,
              out_name: str, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    """The split check, then the data: through the host's arena where this rank's host
    takes it (the table goes with the data there), else by messages."""
    if algorithm == "leaders" and all_to_all_in_host_arena(
            o, outs, ins, _row(row, in_sizes, out_sizes),
            lambda table: _check(o, table, what, unit, in_name, out_name)):
        return
    early, counts = _agree(o, algorithm, what, row, in_sizes, out_sizes, unit, in_name,
                           out_name, ins)
    fn(o, outs, ins, early, counts)
