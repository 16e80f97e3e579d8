"""``record``, at torch's path ``torch.distributed.elastic.multiprocessing.errors``::

    from tandem.elastic.multiprocessing.errors import record

    @record
    def main(): ...

Under ``tandemrun`` every worker's uncaught exception is already recorded for the
launcher's root-cause summary (the worker bootstrap writes it, with the traceback and
whether it was printed), so ``record`` adds nothing there and leaves the function as it
is (the same function). Under ``torchrun`` (TORCHELASTIC_ERROR_FILE set), it is torch's own decorator, so
torchrun's summary gets the error as it expects.
"""

from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

from tandem.errors import ArgumentError

__all__ = ["record"]

F = TypeVar("F", bound=Callable[..., Any])


def record(fn: F, error_handler: Any = None) -> F:
    """Have the launcher's summary show ``fn``'s uncaught exception (see the module)."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:  # torchrun's; tandemrun never sets it
        from torch.distributed.elastic.multiprocessing.errors import record as torchs

        return torchs(fn, error_handler)  # type: ignore[return-value]
    if error_handler is not None:
        raise ArgumentError("record: error_handler is torchelastic's; under tandemrun the "
                            "worker bootstrap records errors, so pass none")
    return fn  # the bootstrap records what escapes it
