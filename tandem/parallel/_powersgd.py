"""PowerSGD gradient compression (Vogels et al., 2019) as a DDP communication hook.

Each matrix-shaped gradient ``M`` (n x m, higher-rank tensors flattened to
``shape[0] x rest``) is replaced by a rank-``r`` approximation ``P Q^T`` found with one
step of power iteration, so a bucket sends ``(n + m) r`` numbers per matrix instead
of ``n m``::

    P = M Q;  all-reduce P;  orthonormalise P
    Q = M^T P;  all-reduce Q;  M ~ P Q^T / world_size

1-D tensors (biases, norms) and matrices too small to gain ``min_compression_rate``
are averaged exactly, in the same message as the P's. With error feedback, what
the approximation dropped on this rank is added back into the next iteration's
gradient, so nothing is lost for good; with warm start, Q of the last iteration
seeds this one. The first ``start_powerSGD_iter`` iterations use plain averaging.

Two collectives per bucket, chained through future callbacks; nothing in here ever
blocks the progress thread that runs those callbacks.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from tandem.collectives.api import all_reduce
from tandem.collectives.reduce_op import ReduceOp
from tandem.collectives.world import AnyGroup, resolve_group
from tandem.config import flag_argument, int_argument, number_argument
from tandem.parallel._buckets import GradBucket

__all__ = ["PowerSGDState", "powerSGD_hook"]

_log = logging.getLogger(__name__)


class PowerSGDState:
    """Configuration and per-bucket memory (errors, P and Q) of :func:`powerSGD_hook`."""

    def __init__(self, process_group: AnyGroup | None, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 10, min_compression_rate: float = 2,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0, random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000,
                 batch_tensors_with_same_shape: bool = False) -> None:
        name = "PowerSGDState"
        if process_group is not None:
            resolve_group(process_group, name)  # a wrong type fails here, not in backward
        self.process_group = process_group
        self.matrix_approximation_rank = int_argument(
            f"{name}: matrix_approximation_rank", matrix_approximation_rank, 1)
        self.start_powerSGD_iter = int_argument(f"{name}: start_powerSGD_iter",
                                                start_powerSGD_iter, 0)
        self.min_compression_rate = number_argument(f"{name}: min_compression_rate",
                                                    min_compression_rate, 0)
        self.use_error_feedback = flag_argument(f"{name}: use_error_feedback",
                                                use_error_feedback)
        self.warm_start = flag_argument(f"{name}: warm_start", warm_start)
        self.orthogonalization_epsilon = number_argument(
            f"{name}: orthogonalization_epsilon", orthogonalization_epsilon, 0)
        self.random_seed = int_argument(f"{name}: random_seed", random_seed, -(1 << 63))
        self.compression_stats_logging_frequency = int_argument(
            f"{name}: compression_stats_logging_frequency",
            compression_stats_logging_frequency, 1)
        self.next_stats_report = 0  # the iteration that logs the compression stats next
        # torch batches same-shaped matrices for speed; the result is the same either way
        self.batch_tensors_with_same_shape = flag_argument(
            f"{name}: batch_tensors_with_same_shape", batch_tensors_with_same_shape)
        # every rank draws the same seeds in the same order, so initial Q's agree
        self.rng = random.Random(random_seed)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}
        self.q_memory_dict: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1
            # a state pickled before this field existed reports at once
            if self.iter >= max(self.start_powerSGD_iter, getattr(self, "next_stats_report", 0)):
                # as torch: the stats every compression_stats_logging_frequency iterations
                rate, before, after = self.compression_stats()
                _log.info("PowerSGD compression stats: iter %d, numbers before compression "
                          "%d, after %d, rate %.3g", self.iter, before, after, rate)
                self.next_stats_report = self.iter + self.compression_stats_logging_frequency

    def compression_stats(self) -> tuple[float, int, int]:
        """(compression rate, numbers before, numbers after) since the state was made."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after else 0.0
        return rate, self.total_numel_before_compression, after

    def __getstate__(self) -> dict[str, Any]:
        # the process group cannot travel; checkpoints restore it with the state
        state = dict(self.__dict__)
        state.pop("process_group", None)
        return state


def _plan(state: PowerSGDState, grads: list[torch.Tensor]
          ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, int, int, int]]]:
    """Split a bucket's gradients into exact ones and (tensor, n, m, rank) to compress."""
    plain: list[torch.Tensor] = []
    low_rank: list[tuple[torch.Tensor, int, int, int]] = []
    for t in grads:
        if t.dim() <= 1:
            plain.append(t)
            continue
        n = t.shape[0]
        m = t.numel() // n if n else 0
        r = min(n, m, state.matrix_approximation_rank)
        if n * m > state.min_compression_rate * (n + m) * r and r > 0:
            low_rank.append((t, n, m, r))
        else:
            plain.append(t)
    return plain, low_rank


def _orthonormalise(p: torch.Tensor, eps: float) -> None:
    q, _ = torch.linalg.qr(p if eps == 0 else p + eps, mode="reduced")
    p.copy_(q)


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future[Any]:
    """Low-rank averaged gradients for ``bucket``; see the module docstring."""
    group = state.process_group
    world = resolve_group(group, "powerSGD_hook").group_size
    buf = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        work = all_reduce(buf, op=ReduceOp.AVG, group=group, async_op=True)
        assert work is not None
        return work.get_future().then(lambda f: f.value()[0])

    index = bucket.index()
    work_dtype = torch.float32 if buf.dtype in (torch.float16, torch.bfloat16) else buf.dtype
    before: torch.Tensor | None = None
    if state.use_error_feedback:
        error = state.error_dict.get(index)
        if error is not None and error.numel() == buf.numel():
            buf.add_(error)
        before = buf.clone()

    plain, low_rank = _plan(state, bucket.gradients())
    plain_numel = sum(t.numel() for t in plain)
    p_numel = sum(n * r for _, n, _, r in low_rank)
    q_numel = sum(m * r for _, _, m, r in low_rank)
    state.total_numel_before_compression += buf.numel()
    state.total_numel_after_compression += plain_numel + p_numel + q_numel

    # one message carries the exact tensors and every P
    first = state.p_memory_dict.get(index)
    if first is None or first.numel() != plain_numel + p_numel:
        first = torch.empty(plain_numel + p_numel, dtype=work_dtype)
        state.p_memory_dict[index] = first
    q_flat = state.q_memory_dict.get(index)
    fresh_q = not state.warm_start or q_flat is None or q_flat.numel() != q_numel
    if q_flat is None or q_flat.numel() != q_numel:
        q_flat = torch.empty(q_numel, dtype=work_dtype)
        state.q_memory_dict[index] = q_flat

    mats, ps, qs = [], [], []
    offset, p_off, q_off = 0, plain_numel, 0
    for t in plain:
        first[offset:offset + t.numel()].copy_(t.reshape(-1)).div_(world)
        offset += t.numel()
    for t, n, m, r in low_rank:
        mats.append(t.reshape(n, m).to(work_dtype))
        ps.append(first[p_off:p_off + n * r].view(n, r))
        qs.append(q_flat[q_off:q_off + m * r].view(m, r))
        p_off += n * r
        q_off += m * r
    if fresh_q:
        gen = torch.Generator().manual_seed(state.rng.randrange(1 << 31))
        for q in qs:
            q.copy_(torch.randn(q.shape, generator=gen, dtype=work_dtype))
            _orthonormalise(q, 0)
    for mat, p, q in zip(mats, ps, qs):
        torch.matmul(mat, q, out=p)

    out: torch.futures.Future[Any] = torch.futures.Future()

    def after_q(f: torch.futures.Future[Any]) -> None:
        try:
            f.value()
            for (t, _, _, _), p, q in zip(low_rank, ps, qs):
                t.copy_((p @ q.t()).div_(world).view(t.shape))
            if before is not None:
                state.error_dict[index] = before.sub_(buf)
            state.maybe_increase_iter(bucket)
            out.set_result(buf)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            out.set_exception(exc)

    def after_p(f: torch.futures.Future[Any]) -> None:
        try:
            f.value()
            offset = 0
            for t in plain:
                t.copy_(first[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()
            if not low_rank:
                after_q(f)
                return
            for mat, p, q in zip(mats, ps, qs):
                _orthonormalise(p, state.orthogonalization_epsilon)
                torch.matmul(mat.t(), p, out=q)
            work = all_reduce(q_flat, op=ReduceOp.SUM, group=group, async_op=True)
            assert work is not None
            work.get_future().add_done_callback(after_q)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            out.set_exception(exc)

    work = all_reduce(first, op=ReduceOp.SUM, group=group, async_op=True)
    assert work is not None
    work.get_future().add_done_callback(after_p)
    return out
