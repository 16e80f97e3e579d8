"""Module ``__getattr__`` for the torch names a tandem twin module does not have.

A ported ``from torch.distributed.optim import apply_optimizer_in_backward`` then meets an
``AttributeError`` (a :class:`~tandem.collectives.porting.RefusedName`) that says what to
use instead; ``hasattr`` stays False. (``from m import x`` turns it into a bare
``ImportError``; under tandemrun the worker adds the message back as a note.)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from tandem.collectives.porting import RefusedName

__all__ = ["refusing_getattr"]

PASS_A_HOOK = ("pass the hook itself to DistributedDataParallel.register_comm_hook "
               "(tandem.parallel.comm_hooks)")


def refusing_getattr(module: str, torch_module: str,
                     refused: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` refusing the names of ``refused`` (name -> what to do)."""

    def __getattr__(name: str) -> Any:
        why = refused.get(name)
        if why is not None:
            raise RefusedName(f"tandem has no {name} ({torch_module}.{name}): {why}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
