"""``DistributedOptimizer``: one optimizer step over parameters that live on many workers.

    params = model_on_ps.remote_parameters() + [RRef(p) for p in local.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    with tandem.autograd.context() as ctx:
        tandem.autograd.backward(ctx, [loss_fn(model(x), y)])
        opt.step(ctx)

The constructor groups the parameter RRefs by owner and creates, on each owner, a local
``optimizer_class(params, *args, **kwargs)`` over the parameters it owns (creation
errors are raised here, not at the first step). ``step(context_id)`` runs every owner's
optimizer at once: each sets its parameters' ``.grad`` to the gradients of the
distributed autograd context on that worker (None where the context has none, so a
parameter the backward pass did not reach is not stepped with a stale gradient) and
steps. Steps on one worker run one at a time, whichever trainer sent them.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import torch

from tandem.autograd import get_gradients
from tandem.errors import ArgumentError
from tandem.rpc import RRef, remote, rpc_async

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """On an owner: the optimizer over the parameters it owns."""

    lock = threading.Lock()  # steps of every DistributedOptimizer on this worker, in turn

    def __init__(self, optimizer_class: type[torch.optim.Optimizer],
                 params: Sequence[RRef[torch.Tensor]], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.params = [r.local_value() for r in params]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = get_gradients(context_id)
        with _LocalOptimizer.lock:
            for p in self.params:
                p.grad = grads.get(p)
            self.optim.step()


def _step(optimizer: RRef[_LocalOptimizer], context_id: int) -> None:
    optimizer.local_value().step(context_id)


class DistributedOptimizer:
    """``optimizer_class`` over ``params_rref`` (RRefs to parameters on any workers)."""

    def __init__(self, optimizer_class: type[torch.optim.Optimizer],
                 params_rref: Sequence[RRef[torch.Tensor]], *args: Any, **kwargs: Any) -> None:
        if not callable(optimizer_class):
            raise ArgumentError(f"DistributedOptimizer: optimizer_class must be an optimizer "
                                f"class, got {optimizer_class!r}")
        params = list(params_rref)
        bad = [p for p in params if not isinstance(p, RRef)]
        if not params or bad:
            raise ArgumentError(f"DistributedOptimizer: params_rref must be a non-empty list of "
                                f"RRefs to parameters (e.g. RemoteModule.remote_parameters() "
                                f"or RRef(p) for local ones), got {bad[:1] or params!r}")
        by_owner: dict[int, list[RRef[torch.Tensor]]] = {}
        for p in params:
            by_owner.setdefault(p.owner().id, []).append(p)
        self.remote_optimizers = [
            remote(owner, _LocalOptimizer, args=(optimizer_class, owned, args, kwargs))
            for owner, owned in by_owner.items()]
        for opt in self.remote_optimizers:
            opt._get_future().wait()  # a bad argument fails here, not at the first step

    def step(self, context_id: int) -> None:
        """Step every owner's optimizer with its gradients of ``context_id``; raise the
        first error after all have finished."""
        futures = [rpc_async(opt.owner(), _step, args=(opt, context_id))
                   for opt in self.remote_optimizers]
        errors = []
        for fut in futures:
            try:
                fut.wait()
            except Exception as exc:  # noqa: BLE001 - every owner finishes first
                errors.append(exc)
        if errors:
            raise errors[0]
