"""The 1-D contiguous buffers the algorithms take, made from any caller's tensor."""

from __future__ import annotations

import torch

__all__ = ["Flat", "copy_overlap"]


class Flat:
    """A contiguous 1-D view of a tensor, or a copy written back afterwards."""

    __slots__ = ("orig", "flat", "copied")

    def __init__(self, t: torch.Tensor, load: bool = True) -> None:
        self.orig = t
        self.copied = not t.is_contiguous()
        if self.copied:
            self.flat = (t.contiguous() if load else torch.empty(t.shape, dtype=t.dtype)).view(-1)
        elif t.ndim == 1 and not t.requires_grad:
            # already what the algorithms take (a bucket, a flat buffer): the detached
            # view cost 1.8 us of a 4 KB all_reduce's ~28 us of CPU (measured)
            self.flat = t
        else:
            self.flat = t.detach().view(-1)

    def done(self) -> None:
        if self.copied:
            with torch.no_grad():
                self.orig.copy_(self.flat.view(self.orig.shape))


def copy_overlap(dst: torch.Tensor, dst_at: int, src: torch.Tensor, src_at: int) -> None:
    """Copy the elements ``dst`` and ``src`` share when each is a stretch of one stream,
    from ``dst_at`` and ``src_at`` on (a staged round and a piece, either way round)."""
    a, b = max(dst_at, src_at), min(dst_at + dst.numel(), src_at + src.numel())
    if a < b:
        dst[a - dst_at:b - dst_at].copy_(src[a - src_at:b - src_at])
