"""Making the replicas of a module identical: shape checks and state broadcasts.

* :func:`verify_same_model` compares every rank's parameter and buffer list
  (names, shapes, dtypes) and raises :class:`~tandem.errors.ArgumentError` naming the
  first difference and the ranks on each side. It sends one short digest per rank;
  the full description travels only when the digests differ.
* :func:`broadcast_tensors` copies one rank's values (rank 0's unless told otherwise)
  into every rank's tensors: large ones in place, small ones packed into a few byte
  buffers.
* :class:`BufferBroadcaster` does that for the module's buffers before every
  training forward, reusing one preallocated byte buffer.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from tandem.collectives.api import broadcast
from tandem.collectives.group import ProcessGroup
from tandem.collectives.objects import all_gather_object
from tandem.errors import ArgumentError

__all__ = ["describe_module", "verify_same_model", "broadcast_tensors", "BufferBroadcaster"]

Entry = tuple[str, str, tuple[int, ...], str]  # (kind, name, shape, dtype)

_ALIGN = 16  # byte offset of every tensor in a packed buffer, so dtype views line up
_CHUNK_BYTES = 16 << 20  # packing cap: bounds the temporary copy
_ALONE_BYTES = 1 << 20  # tensors this large are broadcast in place, unpacked


def describe_module(named_params: Sequence[tuple[str, torch.Tensor]],
                    named_buffers: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    out: list[Entry] = []
    for kind, items in (("parameter", named_params), ("buffer", named_buffers)):
        for name, t in items:
            out.append((kind, name, tuple(t.shape), str(t.dtype).replace("torch.", "")))
    return out


def _show(entry: Entry | None) -> str:
    if entry is None:
        return "nothing (fewer parameters and buffers)"
    kind, name, shape, dtype = entry
    return f"{kind} '{name}' {list(shape)} {dtype}"


def verify_same_model(group: ProcessGroup, entries: list[Entry],
                      what: str = "DistributedDataParallel") -> None:
    """Raise ArgumentError on every rank unless all ranks describe the same model."""
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    digests: list[object] = [None] * group.group_size
    all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    every: list[object] = [None] * group.group_size
    all_gather_object(every, entries, group=group)
    lists: list[list[Entry]] = every  # type: ignore[assignment]
    length = max(len(e) for e in lists)
    for i in range(length):
        at = [e[i] if i < len(e) else None for e in lists]
        if len(set(at)) == 1:
            continue
        groups: dict[Entry | None, list[int]] = {}
        for rank, entry in enumerate(at):
            groups.setdefault(entry, []).append(group.ranks[rank])
        first = next(e for e in at if e is not None)
        sides = "; ".join(f"{_show(e)} on rank(s) {ranks}" for e, ranks in groups.items())
        raise ArgumentError(
            f"{what}: the model differs across ranks at {first[0]} #{i} "
            f"'{first[1]}': {sides}. Every rank must build the same model "
            f"(same parameter names, shapes and dtypes, registered in the same order).")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += _padded(_nbytes(t))
    return offsets, total


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _pack(tensors: Sequence[torch.Tensor], offsets: list[int], out: torch.Tensor) -> None:
    for t, off in zip(tensors, offsets):
        out[off:off + _nbytes(t)].copy_(_bytes_of(t))


def _unpack(tensors: Sequence[torch.Tensor], offsets: list[int], src: torch.Tensor) -> None:
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            piece = src[off:off + _nbytes(t)].view(t.dtype).view(t.shape)
            t.copy_(piece)


def broadcast_tensors(group: ProcessGroup, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` on every rank with group rank ``src``'s values.

    Large contiguous tensors travel on their own, in place (no copy); small ones are
    packed together so a model with hundreds of biases costs a few messages.
    """
    chunk: list[torch.Tensor] = []
    size = 0
    for t in [t for t in tensors if t.numel() > 0]:
        if _nbytes(t) >= _ALONE_BYTES and t.is_contiguous():
            broadcast(t.detach(), group=group, group_src=src)
            continue
        if chunk and size + _padded(_nbytes(t)) > _CHUNK_BYTES:
            _broadcast_chunk(group, chunk, src)
            chunk, size = [], 0
        chunk.append(t)
        size += _padded(_nbytes(t))
    if chunk:
        _broadcast_chunk(group, chunk, src)


def _broadcast_chunk(group: ProcessGroup, tensors: list[torch.Tensor], src: int) -> None:
    offsets, total = _layout(tensors)
    buf = torch.zeros(total, dtype=torch.uint8)
    root = group.group_rank == src
    if root:
        _pack(tensors, offsets, buf)
    broadcast(buf, group=group, group_src=src)
    if not root:
        _unpack(tensors, offsets, buf)


class BufferBroadcaster:
    """Broadcast a fixed list of buffers from one group rank (0 by default), one message
    per call."""

    def __init__(self, group: ProcessGroup, buffers: Sequence[torch.Tensor]) -> None:
        self.group = group
        self.buffers = [b for b in buffers if b.numel() > 0]
        self.offsets, total = _layout(self.buffers)
        self.buf = torch.zeros(total, dtype=torch.uint8)

    def __call__(self, src: int = 0) -> None:
        if not self.buffers:
            return
        root = self.group.group_rank == src
        if root:
            _pack(self.buffers, self.offsets, self.buf)
        broadcast(self.buf, group=self.group, group_src=src)
        if not root:
            _unpack(self.buffers, self.offsets, self.buf)
