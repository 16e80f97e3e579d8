"""PowerSGD gradient compression at torch's module path (``tandem.parallel.comm_hooks``).

torch's ``batched_powerSGD_hook`` (one low-rank approximation of a whole bucket) is not
here: ``powerSGD_hook`` compresses each matrix-shaped gradient on its own.
"""

from tandem.algorithms._refused import refusing_getattr
from tandem.parallel.comm_hooks import PowerSGDState, powerSGD_hook

__all__ = ["PowerSGDState", "powerSGD_hook"]

__getattr__ = refusing_getattr(
    "tandem.algorithms.ddp_comm_hooks.powerSGD_hook",
    "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook",
    {"batched_powerSGD_hook": "use powerSGD_hook, which compresses each matrix-shaped "
                              "gradient of the bucket on its own"})
