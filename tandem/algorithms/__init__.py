"""Training algorithms built on tandem's collectives: the ``torch.distributed.algorithms`` names.

``tandem.algorithms.join`` has ``Join``, ``Joinable`` and ``JoinHook`` (training on uneven
inputs); ``tandem.algorithms.ddp_comm_hooks.ddp_zero_hook`` has ``hook_with_zero_step``
(the ZeroRedundancyOptimizer step run inside DDP's gradient synchronisation).
"""

__all__ = ["join"]
