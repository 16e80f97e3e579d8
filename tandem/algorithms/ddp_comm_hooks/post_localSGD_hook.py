"""Post-local SGD's DDP hook (torch's module path): gradients are averaged over the whole
group for ``start_localSGD_iter`` steps, then only within a subgroup (or not at all),
while a model averager averages the parameters every few steps::

    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=100)
    ddp.register_comm_hook(state, post_localSGD_hook)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tandem.algorithms.model_averaging.averagers import check_count
from tandem.collectives.subgroups import new_subgroups
from tandem.collectives.world import AnyGroup
from tandem.errors import ArgumentError
from tandem.parallel.comm_hooks import GradBucket, allreduce_hook

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

log = logging.getLogger(__name__)


class PostLocalSGDState:
    """What ``post_localSGD_hook`` needs: ``process_group`` (None: the default group)
    averages the gradients until ``start_localSGD_iter`` steps have run; after that
    ``subgroup`` does, when ``post_local_gradient_allreduce`` is True (else each rank keeps
    its own gradients). ``iter`` counts the steps.

    ``subgroup=None`` means the ranks of this node: groups of ``LOCAL_WORLD_SIZE``
    consecutive ranks, made here (torch makes them inside the hook, but a tandem hook
    may run on a progress thread, where making a group must not wait), so every rank
    constructs the state.
    """

    __slots__ = ["process_group", "subgroup", "start_localSGD_iter",
                 "post_local_gradient_allreduce", "iter"]

    def __init__(self, process_group: AnyGroup | None, subgroup: AnyGroup | None,
                 start_localSGD_iter: int, post_local_gradient_allreduce: bool = True) -> None:
        start_localSGD_iter = check_count("PostLocalSGDState", "start_localSGD_iter",
                                          start_localSGD_iter, 0)
        if not isinstance(post_local_gradient_allreduce, bool):
            raise ArgumentError(f"PostLocalSGDState: post_local_gradient_allreduce must be a "
                                f"bool, got {post_local_gradient_allreduce!r}")
        if subgroup is None and post_local_gradient_allreduce:
            try:
                subgroup, _ = new_subgroups()
            except ArgumentError as exc:
                raise ArgumentError(f"PostLocalSGDState: subgroup=None means the ranks of "
                                    f"this node, which needs LOCAL_WORLD_SIZE (set by "
                                    f"tandemrun); pass subgroup, e.g. "
                                    f"tandem.new_subgroups(group_size=...)[0] ({exc})") from exc
        self.process_group = process_group
        self.subgroup = subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0
        log.info("post-local SGD: local SGD starts after %s iterations", start_localSGD_iter)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count a step when its last bucket is reduced."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            log.info("post-local SGD: local SGD starts now, after %s iterations", self.iter)


def post_localSGD_hook(state: PostLocalSGDState,
                       bucket: GradBucket) -> torch.futures.Future[Any]:
    """Average the bucket over ``state.process_group`` for the first
    ``state.start_localSGD_iter`` steps, then over ``state.subgroup`` (or leave it as it
    is, with ``post_local_gradient_allreduce=False``). Run a model averager after each
    optimizer step: this hook only decides how gradients are reduced."""
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(state.process_group, bucket)
    if not state.post_local_gradient_allreduce:
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut
    return allreduce_hook(state.subgroup, bucket)
