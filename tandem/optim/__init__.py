"""Distributed optimizers: the ``torch.distributed.optim`` names.

``ZeroRedundancyOptimizer`` (ZeRO stage 1: each rank keeps the optimizer state of
1/N of the parameters) with torch's signature and semantics, plus what tandem's DDP
makes possible: ``hook_with_zero_step`` (the step inside DDP's backward, with
``overlap_with_ddp=True``) and ``shard_gradients`` (ZeRO stage 2: each rank keeps
only its shard's gradients)::

    from tandem.optim import ZeroRedundancyOptimizer, shard_gradients
    model = DistributedDataParallel(net)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    shard_gradients(model, opt)             # optional: gradients reduce-scattered

``DistributedOptimizer`` steps the optimizers of parameters that live on other RPC
workers (``tandem.rpc``), from the gradients of a distributed autograd context.

``PostLocalSGDOptimizer`` wraps a local optimizer and a model averager
(``tandem.algorithms.model_averaging``): post-local SGD.
"""

from tandem.algorithms._refused import refusing_getattr
from tandem.optim._zero_ddp import hook_with_zero_step, hook_with_zero_step_interleaved, shard_gradients
from tandem.optim.distributed import DistributedOptimizer
from tandem.optim.post_localSGD_optimizer import PostLocalSGDOptimizer
from tandem.optim.zero import ZeroRedundancyOptimizer

__all__ = ["DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer", "hook_with_zero_step",
           "hook_with_zero_step_interleaved", "shard_gradients"]

__getattr__ = refusing_getattr("tandem.optim", "torch.distributed.optim", {
    "apply_optimizer_in_backward": ("to step while backward runs, use ZeroRedundancyOptimizer("
                                    "..., overlap_with_ddp=True) with DDP's hook "
                                    "hook_with_zero_step, or step after backward"),
})
