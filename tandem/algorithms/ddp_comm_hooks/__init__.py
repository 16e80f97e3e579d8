"""The ``torch.distributed.algorithms.ddp_comm_hooks`` module paths, for ported imports.

``ddp_zero_hook`` has ``hook_with_zero_step``; ``default_hooks`` has ``allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook`` and the wrappers ``fp16_compress_wrapper``
and ``bf16_compress_wrapper``; ``powerSGD_hook`` has ``PowerSGDState``
and ``powerSGD_hook``. tandem's hooks live in
``tandem.parallel.comm_hooks``; these modules re-export them.
"""
