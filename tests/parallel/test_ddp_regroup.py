"""``DistributedDataParallel.regroup``: after a move, backward averages over the new group.

Threads over the loopback transport: three ranks train on one group, one of them leaves,
and the two left move to a group of their own (as ``tandem.elastic`` does after a lost
rank). A backward that still used the old group would wait for the rank that left and
fail at the old group's deadline.

Run: ``python -m pytest tests/parallel/test_ddp_regroup.py -q``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

from tandem.collectives.group import NonMemberGroup, ProcessGroup
from tandem.config import Settings
from tandem.errors import ArgumentError, StateError
from tandem.optim import ZeroRedundancyOptimizer, shard_gradients
from tandem.parallel import DistributedDataParallel as DDP
from tandem.parallel.comm_hooks import allreduce_hook, fp16_compress_hook
from tandem.testing import run_threads
from tandem.transport.loopback import LoopbackHub

pytestmark = pytest.mark.timeout(300)


def _groups(world: int, name: str) -> list[ProcessGroup]:
    hub = LoopbackHub(world)
    return [ProcessGroup(t, list(range(world)), 1, name, 20.0, Settings(), "loopback")
            for t in hub.transports]


def _model() -> nn.Module:
    torch.manual_seed(0)  # built once, before the threads start
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _grads(model: DDP, rank: int) -> list[torch.Tensor]:
    model.zero_grad()
    model(torch.full((2, 4), float(rank + 1))).sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _local(initial: nn.Module, rank: int) -> list[torch.Tensor]:
    """The gradients rank ``rank`` computes alone (no averaging)."""
    net = copy.deepcopy(initial)
    net(torch.full((2, 4), float(rank + 1))).sum().backward()
    return [p.grad.clone() for p in net.parameters() if p.grad is not None]


def _survive(group: ProcessGroup, initial: nn.Module, moved: list[ProcessGroup],
             hook: Callable[..., Any] | None) -> list[torch.Tensor] | None:
    torch.set_num_threads(1)
    rank = group.group_rank
    model = DDP(copy.deepcopy(initial), process_group=group)
    if hook is not None:  # state: the old group (None would be the default group)
        model.register_comm_hook(group, hook)
    _grads(model, rank)  # one step on the three ranks
    if rank == 2:
        return None  # this rank is lost
    model.regroup(moved[rank])
    assert model.process_group is moved[rank]
    return _grads(model, rank)


@pytest.mark.parametrize("hook", [None, fp16_compress_hook], ids=["builtin", "fp16_compress_hook"])
def test_after_regroup_backward_averages_over_the_new_group(hook: Callable[..., Any] | None) -> None:
    initial = _model()
    moved = _groups(2, "moved")
    got = run_threads(3, _survive, (initial, moved, hook), timeout=120)
    want = [(a + b) / 2 for a, b in zip(_local(initial, 0), _local(initial, 1))]
    tol = 2e-2 if hook is fp16_compress_hook else 1e-6
    for rank in (0, 1):
        for i, (g, w) in enumerate(zip(got[rank], want)):
            assert torch.allclose(g, w, rtol=tol, atol=tol), (
                f"rank {rank} parameter {i}: gradient {g.flatten()[:4].tolist()} is not the "
                f"mean over the two ranks of the new group {w.flatten()[:4].tolist()}")


def _one_rank(fn: Callable[[DDP, ProcessGroup], Any]) -> Any:
    moved = _groups(1, "moved")

    def body(group: ProcessGroup) -> Any:
        torch.set_num_threads(1)
        return fn(DDP(_model(), process_group=group), moved[0])
    return run_threads(1, body, timeout=60)[0]


@pytest.mark.parametrize("bad", ["a string", NonMemberGroup([5], "elsewhere", 0)],
                         ids=["not a group", "non-member group"])
def test_regroup_refuses_what_is_not_a_group_holding_this_rank(bad: Any) -> None:
    def fn(ddp: DDP, moved: ProcessGroup) -> None:
        old = ddp.process_group
        with pytest.raises(ArgumentError, match="regroup: new_group must be a ProcessGroup"):
            ddp.regroup(bad)
        assert ddp.process_group is old
    _one_rank(fn)


def test_regroup_refuses_a_comm_hook_with_a_state_of_its_own() -> None:
    def fn(ddp: DDP, moved: ProcessGroup) -> None:
        ddp.register_comm_hook(object(), allreduce_hook)
        with pytest.raises(StateError, match="a comm hook with a state of its own"):
            ddp.regroup(moved)
    _one_rank(fn)


def test_regroup_refuses_sharded_gradients() -> None:
    def fn(ddp: DDP, moved: ProcessGroup) -> None:
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD,
                                       process_group=ddp.process_group, lr=0.1)
        shard_gradients(ddp, zero)
        with pytest.raises(StateError, match="sharded gradients"):
            ddp.regroup(moved)
    _one_rank(fn)


def test_regroup_after_a_backward_that_failed_half_way_trains_on() -> None:
    """elastic's case: a rank was lost in the middle of a backward on the old group."""
    def fn(ddp: DDP, moved: ProcessGroup) -> None:
        first, failed = next(ddp.parameters()), []

        def lost(_: torch.Tensor) -> None:  # runs after DDP's own hook on this parameter
            if not failed:
                failed.append(True)
                raise RuntimeError("the peer is gone")
        first.register_post_accumulate_grad_hook(lost)
        with pytest.raises(RuntimeError, match="the peer is gone"):
            ddp(torch.ones(2, 4)).sum().backward()
        assert ddp.reducer.reducing, "the failed backward left no reduction half-done"
        with pytest.raises(StateError, match="never finished"):
            ddp(torch.ones(2, 4))
        ddp.regroup(moved)
        ddp.zero_grad()
        ddp(torch.ones(2, 4)).sum().backward()
        assert ddp.process_group is moved and not ddp.reducer.reducing
        assert all(p.grad is not None for p in ddp.parameters())
    _one_rank(fn)


def test_backward_started_turns_true_with_the_first_backward() -> None:
    def fn(ddp: DDP, moved: ProcessGroup) -> None:
        assert not ddp.backward_started
        ddp(torch.ones(2, 4)).sum().backward()
        assert ddp.backward_started
        with pytest.raises(StateError, match="before the first backward"):
            ddp.register_comm_hook(None, allreduce_hook)
    _one_rank(fn)
