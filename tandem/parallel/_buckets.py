"""Gradient buckets: which parameters share one flat buffer, and the hook-facing view.

Parameters are bucketed in *reverse registration order*, because backward produces
the gradients of the last layers first: the first bucket fills (and its all-reduce
starts) while earlier layers are still computing. The first bucket is kept small
(:data:`FIRST_BUCKET_BYTES`) so communication starts as early as possible; later
buckets hold up to ``bucket_cap_mb``. A bucket holds one dtype; a parameter larger
than the cap gets a bucket of its own.

:class:`GradBucket` is what a communication hook receives (the torch names:
``buffer()``, ``index()``, ``parameters()``, ``gradients()``, ``is_last()``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["FIRST_BUCKET_BYTES", "Bucket", "GradBucket", "assign_buckets"]

# torch uses 1 MiB as well: large enough to amortise one message's latency,
# small enough that the first reduction starts after the last layer's backward
FIRST_BUCKET_BYTES = 1 << 20


def assign_buckets(params: Sequence[torch.Tensor], cap_bytes: int,
                   first_cap_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group parameter indices into buckets, last parameter first.

    A bucket closes once it holds at least its cap (``first_cap_bytes`` for the
    first bucket of each dtype, ``cap_bytes`` after); buckets never mix dtypes.
    """
    done: list[list[int]] = []
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    closed_per_dtype: dict[torch.dtype, int] = {}
    for i in reversed(range(len(params))):
        p = params[i]
        members, size = open_.get(p.dtype, ([], 0))
        members.append(i)
        size += p.numel() * p.element_size()
        cap = first_cap_bytes if closed_per_dtype.get(p.dtype, 0) == 0 else cap_bytes
        if size >= cap:
            done.append(members)
            closed_per_dtype[p.dtype] = closed_per_dtype.get(p.dtype, 0) + 1
            open_.pop(p.dtype, None)
        else:
            open_[p.dtype] = (members, size)
    done.extend(members for members, _ in open_.values())
    # reduce in the order backward fills them: by the position of the bucket's
    # latest-registered parameter, descending
    done.sort(key=lambda members: -max(members))
    return done


class Bucket:
    """One flat gradient buffer and the parameters whose gradients live in it.

    The buffer is made on first use: when the group shares memory, gradients are
    reduced where they are and the buffer is never needed.
    """

    __slots__ = ("index", "members", "_shapes", "dtype", "numel", "_buffer", "_views",
                 "pending", "future", "result", "t_launch", "t_done")

    def __init__(self, index: int, members: list[int], params: Sequence[torch.Tensor]) -> None:
        self.index = index
        self.members = members  # parameter indices, in bucket order
        self.dtype = params[members[0]].dtype
        self._shapes = [params[i].shape for i in members]
        self.numel = sum(params[i].numel() for i in members)
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self.pending = len(members)
        self.future: torch.futures.Future[Any] | None = None
        self.result: torch.Tensor | None = None
        self.t_launch = 0.0
        self.t_done = 0.0

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.zeros(self.numel, dtype=self.dtype)
            offset = 0
            for shape in self._shapes:
                n = shape.numel()
                self._views.append(self._buffer[offset:offset + n].view(shape))
                offset += n
        return self._buffer

    @property
    def views(self) -> list[torch.Tensor]:
        self.buffer  # noqa: B018 - made on first use
        return self._views

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    def reset(self) -> None:
        self.pending = len(self.members)
        self.future = None
        self.result = None
        self.t_launch = self.t_done = 0.0


class GradBucket:
    """The bucket a communication hook reduces (same methods as torch's ``GradBucket``).

    ``buffer()`` is the flat gradient tensor; ``gradients()`` are views of it shaped
    like ``parameters()``. A hook returns a future whose value is the reduced flat
    tensor (it may be ``buffer()`` itself, reduced in place).
    """

    def __init__(self, bucket: Bucket, params: Sequence[torch.Tensor], is_last: bool) -> None:
        self._bucket = bucket
        self._params = [params[i] for i in bucket.members]
        self._is_last = is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._bucket.buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor.reshape(-1))

    def gradients(self) -> list[torch.Tensor]:
        return list(self._bucket.views)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last

    def offsets(self) -> list[int]:
        out, offset = [], 0
        for v in self._bucket.views:
            out.append(offset)
            offset += v.numel()
        return out

    def lengths(self) -> list[int]:
        return [v.numel() for v in self._bucket.views]

    def __repr__(self) -> str:
        b = self._bucket
        return (f"<GradBucket {b.index}: {len(b.members)} tensors, {b.buffer.numel()} x "
                f"{b.buffer.dtype}>")
