"""``async_execution``: a served function that replies when its Future completes.

    @tandem.rpc.functions.async_execution
    def add_later(x):
        fut = torch.futures.Future()
        pending.append((fut, x))         # completed later, e.g. by another call's batch
        return fut

    tandem.rpc.rpc_sync("server", add_later, args=(t,))   # waits for the Future's value

The server thread returns as soon as the function has returned its Future; the reply is
sent when the Future completes (from whichever thread completes it), so thousands of
such calls can wait without holding a thread each. Works for functions, static methods
and methods called through RRef proxies (``rref.rpc_sync().method(...)``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

__all__ = ["async_execution", "ASYNC_ATTR"]

ASYNC_ATTR = "_tandem_async_execution"
F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` (which must return a ``torch.futures.Future``) for deferred replies."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, ASYNC_ATTR, True)
    return wrapper  # type: ignore[return-value]
