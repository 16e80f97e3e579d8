"""``SyncBatchNorm``: batch normalisation over the whole global batch, not each rank's slice.

A drop-in for ``nn.BatchNorm1d/2d/3d`` with the signature of ``torch.nn.SyncBatchNorm``::

    model = tandem.parallel.SyncBatchNorm.convert_sync_batchnorm(model)   # every BatchNorm*
    model = tandem.parallel.DistributedDataParallel(model)

In training each rank all-reduces one small tensor per layer and forward pass —
per-channel sum, sum of squares and the row count — so mean and variance are
those of the concatenated batch, even when ranks hold different batch sizes
(zero included). The backward pass all-reduces the two per-channel gradient sums
the input gradient needs; weight and bias gradients stay local, like any
parameter gradient under DDP. In eval mode (running statistics) nothing is
communicated, and without an initialised group or with one rank it is plain
batch norm.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from tandem.collectives.api import all_reduce
from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.collectives.world import get_world_size, is_initialized
from tandem.errors import ArgumentError

__all__ = ["SyncBatchNorm"]

AnyGroup = ProcessGroup | NonMemberGroup


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm whose statistics and input gradient are summed over ``group``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                eps: float, momentum: float, group: AnyGroup | None) -> torch.Tensor:
        x = x.contiguous()
        channels = x.shape[1]
        count = x.numel() // channels if channels else 0
        # local mean and centred variance (stable), turned into sums in float64 so the
        # global E[x^2] - mean^2 below loses nothing to cancellation at float32 precision
        stats = torch.zeros(2 * channels + 1, dtype=torch.float64)
        if count:
            var, mean = torch.var_mean(x, dim=_reduce_dims(x), correction=0)
            mean64 = mean.double()
            stats[:channels] = mean64 * count
            stats[channels:-1] = (var.double() + mean64 * mean64) * count
            stats[-1] = count
        all_reduce(stats, group=group)
        total = float(stats[-1])
        if total <= 1:
            raise ArgumentError(
                f"SyncBatchNorm: expected more than 1 value per channel when training, got "
                f"{int(total)} over the whole group (input of this rank: {list(x.shape)})")
        g_mean = stats[:channels] / total
        g_var = (stats[channels:-1] / total - g_mean * g_mean).clamp_(min=0.0)
        g_invstd = torch.rsqrt(g_var + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = g_var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = _channel_shape(x)
        mean_c = g_mean.to(x.dtype).view(shape)
        invstd_c = g_invstd.to(x.dtype).view(shape)
        y = (x - mean_c) * invstd_c
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_c, invstd_c)
        ctx.group = group
        ctx.total = total
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean_c, invstd_c = ctx.saved_tensors
        dy = grad_out.contiguous()
        dims = _reduce_dims(x)
        xmu = x - mean_c
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            channels = x.shape[1]
            sums = torch.cat([sum_dy, sum_dy_xmu]).double()
            all_reduce(sums, group=ctx.group)
            shape = _channel_shape(x)
            mean_dy = (sums[:channels] / ctx.total).to(x.dtype).view(shape)
            mean_dy_xmu = (sums[channels:] / ctx.total).to(x.dtype).view(shape)
            scale = invstd_c if weight is None else invstd_c * weight.view(shape)
            grad_input = (dy - mean_dy - xmu * invstd_c * invstd_c * mean_dy_xmu) * scale
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xmu * invstd_c.view(-1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the global batch of ``process_group`` (default: the whole job).

    Arguments and buffers are those of ``torch.nn.SyncBatchNorm``; inputs are
    ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: AnyGroup | None = None, device: Any = None,
                 dtype: Any = None) -> None:
        if process_group is not None and not isinstance(process_group,
                                                        (ProcessGroup, NonMemberGroup)):
            # it was kept, and failed only in the first forward
            raise ArgumentError(f"SyncBatchNorm: process_group must be a tandem ProcessGroup "
                                f"(tandem.new_group) or None, got {process_group!r}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ArgumentError(f"SyncBatchNorm: expected at least 2D input, got {input.dim()}D")
        if input.shape[1] != self.num_features:
            raise ArgumentError(f"SyncBatchNorm: input has {input.shape[1]} channels, "
                                f"the layer was built for {self.num_features}")

    def _sync_world(self) -> int:
        """Ranks to synchronise with; 1 means compute locally."""
        if not is_initialized():
            return 1
        return get_world_size(self.process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if not (batch_stats and self.training) or self._sync_world() == 1:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                batch_stats, factor, self.eps)
        out = _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor,
            self.process_group)
        return cast(torch.Tensor, out)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module,
                               process_group: AnyGroup | None = None) -> nn.Module:
        """Return ``module`` with every ``BatchNorm*d`` (recursively) replaced by SyncBatchNorm.

        Parameters, running statistics and the training flag carry over (the same
        Parameter and buffer tensors, as torch does); other modules are kept as they are.
        """
        converted = module
        if isinstance(module, _BatchNorm):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
            converted.training = module.training
            if hasattr(module, "qconfig"):
                converted.qconfig = module.qconfig
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return converted
