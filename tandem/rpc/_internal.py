"""Functions that RRef operations run on the owner (they travel by reference like any other).

Each receives the RRef as its owner handle (an RRef sent to its owner arrives as the
owner's own), so the value is at hand. Those that wait for a value that may still be
computing are ``async_execution``: no server thread waits for it.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.errors import StateError
from tandem.rpc.functions import ASYNC_ATTR, async_execution

__all__ = ["rref_value", "rref_method", "rref_backward"]


def _owned(rref: Any, what: str) -> Any:
    entry = rref._entry
    if entry is None:
        raise StateError(f"{what} reached worker {rref._agent.rank}, which does not own "
                         f"RRef {rref._id} (owner: worker {rref._owner})")
    return entry


def _copy_into(target: torch.futures.Future[Any], source: torch.futures.Future[Any]) -> None:
    try:
        target.set_result(source.wait())
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
        target.set_exception(exc)


@async_execution
def rref_value(rref: Any) -> torch.futures.Future[Any]:
    """The value of ``rref`` once it is ready (``to_here``)."""
    entry = _owned(rref, "to_here")
    fut: torch.futures.Future[Any] = torch.futures.Future()

    def ready(e: Any) -> None:
        if e.error is not None:
            fut.set_exception(e.error)
        else:
            fut.set_result(e.value)

    entry.when_ready(ready)
    return fut


@async_execution
def rref_method(rref: Any, name: str, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> torch.futures.Future[Any]:
    """``getattr(value, name)(*args, **kwargs)`` once the value is ready (the proxies)."""
    entry = _owned(rref, f"method {name!r}")
    fut: torch.futures.Future[Any] = torch.futures.Future()

    def ready(e: Any) -> None:
        try:
            if e.error is not None:
                raise e.error
            method = getattr(e.value, name)
            out = method(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)
            return
        if getattr(method, ASYNC_ATTR, False) and isinstance(out, torch._C.Future):
            out.add_done_callback(lambda done: _copy_into(fut, done))
        else:
            fut.set_result(out)

    entry.when_ready(ready)
    return fut


def rref_backward(rref: Any, context_id: int, retain_graph: bool) -> None:
    """``RRef.backward`` from a user: the distributed backward pass starts on the owner."""
    from tandem.autograd import backward  # lazy: autograd's engine runs on the RPC agent

    _owned(rref, "RRef.backward")
    backward(context_id, [rref.local_value()], retain_graph)
