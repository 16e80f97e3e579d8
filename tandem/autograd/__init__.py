"""Distributed autograd, with the names of ``torch.distributed.autograd``.

    import tandem.autograd as dist_autograd   # instead of torch.distributed.autograd

    with dist_autograd.context() as context_id:
        loss = loss_fn(model(x), y)           # model calls other workers through tandem.rpc
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        optimizer.step(context_id)            # tandem.optim.DistributedOptimizer

See ``_context`` (what each worker records) and ``_engine`` (the backward pass).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# resolved on first use: the RPC engine imports tandem.autograd._context, and this
# package's functions import the RPC engine
_EXPORTS = {"context": "tandem.autograd._engine", "backward": "tandem.autograd._engine",
            "get_gradients": "tandem.autograd._engine"}

__all__ = ["context", "backward", "get_gradients", "is_available"]


def is_available() -> bool:
    return True


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tandem.autograd' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from tandem.autograd._engine import backward, context, get_gradients
