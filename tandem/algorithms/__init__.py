"""Training algorithms built on tandem's collectives: the ``torch.distributed.algorithms`` names.

``tandem.algorithms.join`` has ``Join``, ``Joinable`` and ``JoinHook`` (training on uneven
inputs), also importable from this package as from torch's;
``tandem.algorithms.ddp_comm_hooks`` has torch's hook modules (``default_hooks``,
``powerSGD_hook``, ``ddp_zero_hook``: the ZeroRedundancyOptimizer step run inside DDP's
gradient synchronisation, ``post_localSGD_hook``);
``tandem.algorithms.model_averaging`` has torch's model averagers (post-local SGD and
hierarchical SGD: parameters averaged every few steps);
``tandem.algorithms.diloco`` has ``DiLoCo`` (beyond torch: an outer optimizer step on the
averaged change every H inner steps, streaming, compressed, hierarchical, elastic).
"""

from typing import Any as _Any

__all__ = ["join", "model_averaging", "diloco", "Join", "JoinHook", "Joinable"]


def __getattr__(name: str) -> _Any:  # loaded on first use: importing the package stays cheap
    if name in ("Join", "JoinHook", "Joinable"):
        from tandem.algorithms import join

        return getattr(join, name)
    if name in ("model_averaging", "diloco"):
        import importlib

        return importlib.import_module(f"tandem.algorithms.{name}")
    raise AttributeError(f"module 'tandem.algorithms' has no attribute {name!r}")
