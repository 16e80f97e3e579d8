"""The ``torch.distributed.algorithms.ddp_comm_hooks`` module paths, for ported imports.

``ddp_zero_hook`` has ``hook_with_zero_step``; ``default_hooks`` has ``allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook`` and the wrappers ``fp16_compress_wrapper``
and ``bf16_compress_wrapper``; ``powerSGD_hook`` has ``PowerSGDState``
and ``powerSGD_hook``; ``post_localSGD_hook`` has ``PostLocalSGDState`` and
``post_localSGD_hook``. The other hooks live in ``tandem.parallel.comm_hooks``;
these modules re-export them.
"""

from tandem.algorithms._refused import PASS_A_HOOK, refusing_getattr

__getattr__ = refusing_getattr("tandem.algorithms.ddp_comm_hooks",
                               "torch.distributed.algorithms.ddp_comm_hooks", {
    "quantization_hooks": ("to send fewer bytes, use fp16_compress_hook or bf16_compress_hook "
                           "(default_hooks) or powerSGD_hook"),
    "debugging_hooks": ("for a hook that communicates nothing (noop_hook), return a completed "
                        "torch.futures.Future holding bucket.buffer()"),
    "register_ddp_comm_hook": PASS_A_HOOK,
    "DDPCommHookType": PASS_A_HOOK,
})
