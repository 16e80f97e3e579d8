"""How the ranks keep their models together (``--sync``): every step, or every H steps.

* ``ddp``: ``DistributedDataParallel`` averages the gradients in every backward pass.
* ``local-sgd``: each rank steps its own AdamW; after every ``inner_steps``-th step a
  ``PeriodicModelAverager`` averages the parameters (torch's ``PostLocalSGDOptimizer``).
* ``diloco``: each rank steps its own AdamW (the inner optimizer); every ``inner_steps``
  steps ``tandem.algorithms.diloco.DiLoCo`` averages the change since the last sync and
  an outer SGD with Nesterov momentum applies it; ``fragments`` > 1 syncs the model in
  parts in turn, each overlapped with the following steps (streaming DiLoCo).

Only ``ddp`` talks in every step. The others exchange nothing between syncs, so the
trainer averages the logged loss (a collective) at sync steps only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

import tandem as dist
from tandem.algorithms.diloco import DiLoCo
from tandem.algorithms.model_averaging.averagers import PeriodicModelAverager
from tandem.algorithms.model_averaging.utils import average_parameters
from tandem.optim import PostLocalSGDOptimizer
from tandem.parallel import DistributedDataParallel
from train_chars.cli import DEFAULT_OUTER_LR as OUTER_LR  # --outer-lr's default
from train_chars.cli import DEFAULT_OUTER_MOMENTUM as OUTER_MOMENTUM

__all__ = ["Sync", "make_sync", "OUTER_LR", "OUTER_MOMENTUM"]



@dataclasses.dataclass
class Sync:
    """What the training loop calls: ``forward`` for the loss, ``optimizer`` to step, then
    ``after_step(step)`` (True when the ranks synced at this step)."""

    method: str
    forward: torch.nn.Module
    optimizer: torch.optim.Optimizer
    after_step: Callable[[int], bool]
    finish: Callable[[], None]  # after the last step: end what is in flight, or sync
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[dict[str, Any]], None]
    counters: Callable[[], dict[str, Any]]  # what the method measured of its exchanges


def _ddp(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Sync:
    ddp = DistributedDataParallel(model)
    return Sync("ddp", ddp, optimizer, lambda step: True, lambda: None, dict,
                lambda state: None, dict)


def _local_sgd(model: torch.nn.Module, optimizer: torch.optim.Optimizer, every: int) -> Sync:
    # the averager counts its calls from 0 and averages when (count - warmup) % period
    # == 0: a warm-up of H - 1 makes it average after steps H, 2H, ... like DiLoCo's syncs
    averager = PeriodicModelAverager(period=every, warmup_steps=every - 1)
    local = PostLocalSGDOptimizer(optimizer, averager)

    def finish() -> None:
        if averager.step % every:  # the run did not end on an averaging step
            average_parameters(iter(model.parameters()), None)

    # the averager's step count travels in the optimizer's state dict ("step")
    return Sync("local-sgd", model, local, lambda step: step % every == 0, finish, dict,
                lambda state: None, dict)


def _diloco(model: torch.nn.Module, optimizer: torch.optim.Optimizer, every: int,
            fragments: int, outer_lr: float, outer_momentum: float) -> Sync:
    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=outer_lr, momentum=outer_momentum,
                               nesterov=outer_momentum > 0)

    # a group's collectives complete in issue order: on the default group the loss and
    # evaluation all-reduces would wait behind a streamed exchange still in flight
    exchanges = dist.new_group(list(range(dist.get_world_size())))
    diloco = DiLoCo(model, optimizer, outer_optimizer=outer, sync_every=every,
                    fragments=fragments, group=exchanges)

    def after_step(step: int) -> bool:
        diloco.step()
        return step % every == 0

    def counters() -> dict[str, Any]:
        return {"sync_bytes_sent": diloco.bytes_sent, "sync_comm_s": diloco.comm_seconds,
                "sync_exposed_s": diloco.exposed_seconds,
                "sync_hidden_fraction": diloco.hidden_fraction}

    return Sync("diloco", model, optimizer, after_step, diloco.sync, diloco.state_dict,
                diloco.load_state_dict, counters)


def make_sync(method: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              inner_steps: int, fragments: int, outer_lr: float = OUTER_LR,
              outer_momentum: float = OUTER_MOMENTUM) -> Sync:
    """The ``--sync`` method around ``model`` (already loaded) and its AdamW."""
    if method == "ddp":
        return _ddp(model, optimizer)
    if method == "local-sgd":
        return _local_sgd(model, optimizer, inner_steps)
    if method == "diloco":
        return _diloco(model, optimizer, inner_steps, fragments, outer_lr, outer_momentum)
    raise ValueError(f"--sync {method!r}: use ddp, local-sgd or diloco")
