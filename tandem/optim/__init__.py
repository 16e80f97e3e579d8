"""Optimizers for distributed training, with the names of ``torch.distributed.optim``."""

from tandem.optim.distributed import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
