"""tandem's errors as the exception types torch code expects.

torch code that drives a process group (DDP's reducer, FSDP, torchelastic, a user's
``except``) catches ``torch.distributed.DistBackendError`` when communication fails.
A failed tandem operation is therefore re-raised as :class:`TandemBackendError`: a
``DistBackendError`` and a :class:`tandem.errors.TandemError` at once, carrying
tandem's message (which names the ranks, the operation and the call site), with the
original error as ``__cause__`` and its ``rank`` / ``missing`` details copied.

Bad arguments stay :class:`tandem.errors.ArgumentError` (a ``ValueError``, which is
what torch raises for bad arguments too): nothing was sent, and the group still works.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from torch.distributed import DistBackendError

from tandem.errors import ArgumentError, TandemError

__all__ = ["TandemBackendError", "translate", "translated"]

T = TypeVar("T")


class TandemBackendError(DistBackendError, TandemError):
    """A tandem operation failed under torch's API.

    ``rank`` is the global rank that was lost (``-1`` if none), ``missing`` the global
    ranks a timed-out operation never heard from; ``__cause__`` is tandem's original
    error (``PeerLostError``, ``CollectiveMismatchError``, ``CollectiveTimeoutError``...).
    """

    def __init__(self, message: str, rank: int = -1, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank = rank
        self.missing = missing


def translate(exc: BaseException, to_global: Callable[[int], int] = lambda r: r) -> BaseException:
    """The exception torch code should see for ``exc`` (``exc`` itself if none is better).

    ``to_global`` maps the transport's rank numbers to global ranks (the identity
    when tandem is the default backend, whose transport numbers ranks globally).
    """
    if isinstance(exc, (TandemBackendError, ArgumentError)) or not isinstance(exc, TandemError):
        return exc
    rank = getattr(exc, "rank", -1)
    missing = tuple(to_global(r) for r in getattr(exc, "missing", ()))
    error = TandemBackendError(f"{type(exc).__name__}: {exc}",
                               to_global(rank) if rank >= 0 else -1, missing)
    error.__cause__ = exc
    return error


def translated(fn: Callable[[], T], to_global: Callable[[int], int] = lambda r: r) -> T:
    """Run ``fn``; re-raise a tandem failure as the exception torch code expects."""
    try:
        return fn()
    except TandemError as exc:
        error = translate(exc, to_global)
        if error is exc:
            raise
        raise error from exc
