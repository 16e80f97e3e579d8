"""One collective for torch's coalesced all-gather or reduce-scatter of small tensors.

torch's ``_coalescing_manager`` and its functional collectives
(``all_gather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``) hand a
process group several (output, input) pairs in one call. Every tandem collective has a
fixed cost (its signature check, a round of the shared-memory arena or a message per
peer) that dwarfs the data of a small tensor, so pairs of one dtype travel as one
collective over a packed buffer: the inputs are copied in when the call is made (rank
segment by rank segment), the outputs copied out once it completes. Past
``FUSE_BYTES`` of input those copies cost more than the calls they save, and each pair
goes as its own call.

Each element is combined from the same ranks' values as in its own call, so results
are the same; only the signature differs (one packed call), and every rank packs alike
because torch requires equal shapes and dtypes on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch

__all__ = ["FUSE_BYTES", "Packed", "packed_all_gather", "packed_reduce_scatter"]

FUSE_BYTES = 1 << 20  # input bytes up to which one packed call beats one call per pair


@dataclasses.dataclass(frozen=True)
class Packed:
    """The packed call's ``output`` and ``input``; ``unpack()`` fills the caller's outputs."""

    output: torch.Tensor
    input: torch.Tensor
    unpack: Callable[[], None]


def _fusable(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
             out_numels: Sequence[int]) -> bool:
    """Two or more well-formed pairs of one dtype, not empty, small enough to pack."""
    if len(inputs) < 2 or len(outputs) != len(inputs):
        return False
    first = inputs[0]
    if not all(isinstance(t, torch.Tensor) and t.is_cpu and not t.is_sparse
               and t.dtype == first.dtype for t in (*inputs, *outputs)):
        return False  # left to the per-pair calls, whose checks name the problem
    if any(o.numel() != n for o, n in zip(outputs, out_numels)):
        return False
    return 0 < sum(t.numel() for t in inputs) * first.element_size() <= FUSE_BYTES


def packed_all_gather(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                      world: int) -> Packed | None:
    """One all_gather_into_tensor for every pair, or None when that would not pay."""
    sizes = [t.numel() for t in inputs]
    if not _fusable(outputs, inputs, [world * n for n in sizes]):
        return None
    packed_in = torch.cat([t.detach().reshape(-1) for t in inputs])
    packed_out = torch.empty(world * packed_in.numel(), dtype=packed_in.dtype)

    def unpack() -> None:
        # row r of packed_out is rank r's packed input: pair i's piece is a column block
        rows = packed_out.view(world, packed_in.numel()).split(sizes, dim=1)
        _copy_out([o.view(world, n) if o.is_contiguous() else o for o, n in zip(outputs, sizes)],
                  rows)

    return Packed(packed_out, packed_in, unpack)


def packed_reduce_scatter(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                          world: int) -> Packed | None:
    """One reduce_scatter_tensor for every pair, or None when that would not pay."""
    sizes = [t.numel() for t in outputs]
    if not all(t.numel() == world * n for t, n in zip(inputs, sizes)):
        return None
    if not _fusable(outputs, inputs, sizes):
        return None
    # rank r's segment of the packed input holds segment r of every pair's input
    packed_in = torch.cat([t.detach().reshape(world, n) for t, n in zip(inputs, sizes)],
                          dim=1).view(-1)
    packed_out = torch.empty(sum(sizes), dtype=packed_in.dtype)

    def unpack() -> None:
        _copy_out([o.view(-1) if o.is_contiguous() else o for o in outputs],
                  packed_out.split(sizes))

    return Packed(packed_out, packed_in, unpack)


def _copy_out(dsts: list[torch.Tensor], parts: Sequence[torch.Tensor]) -> None:
    """``dsts[i] <- parts[i]``: one foreach copy for the views shaped like their part
    (a copy per tensor costs more than the copying of a small one), the rest one by one."""
    alike = [(d, p) for d, p in zip(dsts, parts) if d.shape == p.shape]
    with torch.no_grad():
        if alike:
            torch._foreach_copy_([d for d, _ in alike], [p for _, p in alike])
        for d, p in zip(dsts, parts):
            if d.shape != p.shape:  # a strided output, kept in its own shape
                d.copy_(p.reshape(d.shape))
