"""PowerSGD gradient compression at torch's module path (``tandem.parallel.comm_hooks``).

torch's ``batched_powerSGD_hook`` (one low-rank approximation of a whole bucket) is not
here: ``powerSGD_hook`` compresses each matrix-shaped gradient on its own.
"""

from tandem.parallel.comm_hooks import PowerSGDState, powerSGD_hook

__all__ = ["PowerSGDState", "powerSGD_hook"]
