"""``hook_with_zero_step``: the ZeroRedundancyOptimizer step inside DDP's backward.

The torch module path; the implementation is ``tandem.optim._zero_ddp``.
"""

from tandem.optim._zero_ddp import hook_with_zero_step, hook_with_zero_step_interleaved

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]
