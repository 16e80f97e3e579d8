"""What DDP tells an optimizer that works inside its gradient synchronisation.

An observer set with ``DistributedDataParallel._observe(observer)`` hears, in the
thread that finishes ``loss.backward()``, about each bucket once its reduced
gradients are in ``.grad`` (in bucket order), then that backward has ended. The
:class:`~tandem.optim.ZeroRedundancyOptimizer` with ``overlap_with_ddp=True`` steps
its shard of each bucket there and starts sending the updated parameters while later
buckets are still being reduced. A joined rank's shadow backward (see
``tandem.algorithms.join``) calls the observer in the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

__all__ = ["GradObserver", "ObservingHook"]


class GradObserver:
    """Base class: override either method; both do nothing by default."""

    def bucket_reduced(self, index: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Bucket ``index`` (holding ``params``) is reduced and written back."""

    def backward_done(self) -> None:
        """Every bucket of this backward has been reported."""


class ObservingHook(GradObserver):
    """A communication hook that also observes DDP's reduced buckets.

    ``ddp.register_comm_hook(state, obj)`` with such an object calls ``obj.attach(ddp)``,
    makes DDP reduce each bucket with ``obj.hook`` (None, or ``allreduce_hook`` on
    DDP's own group: DDP's built-in average, which keeps the shared-memory in-place
    path) and report every reduced bucket to ``obj``.
    """

    hook: Callable[[Any, Any], torch.futures.Future[Any]] | None = None

    def attach(self, ddp: Any) -> None:
        """Check that this observer fits ``ddp`` (called by ``register_comm_hook``)."""

    def __call__(self, state: Any, bucket: Any) -> torch.futures.Future[Any]:
        from tandem.parallel.comm_hooks import allreduce_hook

        return (self.hook or allreduce_hook)(state, bucket)
