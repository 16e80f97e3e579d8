"""The methods through which ``hook_with_zero_step`` and ``shard_gradients`` drive a
ZeroRedundancyOptimizer: ``param_owners``, ``repartition``, ``use_sharded_gradients``,
``end_step`` and the properties they read.

Threads over the loopback transport (two ranks, in milliseconds).

Run: ``python -m pytest tests/optim/test_zero_owners.py -q``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from tandem.collectives.group import ProcessGroup
from tandem.errors import ArgumentError, StateError
from tandem.optim import ZeroRedundancyOptimizer
from tandem.testing import run_threads


def _params() -> list[nn.Parameter]:
    # the same parameters on every rank: a generator of its own, as the ranks are threads
    # of one process and would race on torch's global one (seeded by one, drawn by both)
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(n, generator=gen)) for n in (40, 30, 20, 10)]


def _on_two_ranks(fn: Callable[[ZeroRedundancyOptimizer], Any]) -> list[Any]:
    def body(group: ProcessGroup) -> Any:
        torch.set_num_threads(1)
        zero = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, process_group=group, lr=0.1,
                                       momentum=0.9)  # momentum: state to consolidate
        return fn(zero)
    return run_threads(2, body, timeout=60)


def _step(zero: ZeroRedundancyOptimizer) -> None:
    for p, _ in zero.param_owners():
        p.grad = torch.ones_like(p)
    zero.step()


def test_param_owners_lists_every_parameter_with_the_rank_that_updates_it() -> None:
    def fn(zero: ZeroRedundancyOptimizer) -> list[tuple[int, int]]:
        pairs = zero.param_owners()
        assert [p for p, _ in pairs] == zero.param_groups[0]["params"]
        assert all(zero.owner_of(p) == o for p, o in pairs)
        mine = {id(p) for p, o in pairs if o == zero.rank}
        assert mine == {id(p) for g in zero.optim.param_groups for p in g["params"]}
        return [(p.numel(), o) for p, o in pairs]
    first, second = _on_two_ranks(fn)
    assert first == second == [(40, 0), (30, 1), (20, 1), (10, 0)]  # largest first, to the lightest


def test_repartition_moves_the_local_optimizer_to_the_new_shard() -> None:
    def fn(zero: ZeroRedundancyOptimizer) -> list[float]:
        version = zero.layout_version
        zero.repartition([1, 1, 0, 0])
        assert zero.layout_version > version, "the exchange plan was not rebuilt"
        assert [o for _, o in zero.param_owners()] == [1, 1, 0, 0]
        local = [p for g in zero.optim.param_groups for p in g["params"]]
        assert [p.numel() for p in local] == ([20, 10] if zero.rank == 0 else [40, 30])
        before = [p.detach().clone() for p, _ in zero.param_owners()]
        _step(zero)  # every rank receives every update from its new owner
        return [(b - p.detach()).abs().max().item() for b, (p, _) in
                zip(before, zero.param_owners())]
    for moved in _on_two_ranks(fn):
        assert moved == pytest.approx([0.1] * 4), moved


@pytest.mark.parametrize("owners,message", [
    ([0, 1, 0], r"3 owner\(s\) for 4 parameter\(s\)"),
    ([0, 1, 2, 0], "owner 2 is not a group rank in"),
    ([0, 1, True, 0], "owner True is not a group rank"),
])
def test_repartition_refuses_owners_that_do_not_fit(owners: list[Any], message: str) -> None:
    def fn(zero: ZeroRedundancyOptimizer) -> None:
        before = zero.param_owners()
        with pytest.raises(ArgumentError, match=message):
            zero.repartition(owners)
        assert [o for _, o in zero.param_owners()] == [o for _, o in before]
    _on_two_ranks(fn)


def test_repartition_after_a_step_is_refused_as_the_state_stays_with_the_old_owners() -> None:
    def fn(zero: ZeroRedundancyOptimizer) -> None:
        assert not zero.has_stepped
        _step(zero)
        assert zero.has_stepped
        with pytest.raises(StateError, match="repartition before the first step"):
            zero.repartition([0, 0, 0, 0])
    _on_two_ranks(fn)


def test_sharded_gradients_make_clipping_take_the_norm_over_every_rank() -> None:
    def fn(zero: ZeroRedundancyOptimizer) -> float:
        assert not zero.gradients_sharded
        zero.use_sharded_gradients()
        assert zero.gradients_sharded
        for p, o in zero.param_owners():  # as DDP leaves them: only this rank's
            p.grad = torch.full_like(p, 2.0) if o == zero.rank else None
        return float(zero.clip_grad_norm_(1.0))
    norms = _on_two_ranks(fn)
    assert norms == pytest.approx([2.0 * 100 ** 0.5] * 2), norms  # all 100 elements


def test_end_step_makes_an_earlier_consolidation_stale() -> None:
    def fn(zero: ZeroRedundancyOptimizer) -> None:
        _step(zero)
        zero.consolidate_state_dict(to=0)
        if zero.rank == 0:
            assert set(zero.state_dict()["state"]) == {0, 1, 2, 3}
        zero.end_step()  # a step that ran inside DDP's backward
        if zero.rank == 0:
            with pytest.raises(StateError, match="consolidated 1 step"):
                zero.state_dict()
    _on_two_ranks(fn)


def test_overlap_with_ddp_is_readable() -> None:
    def body(group: ProcessGroup) -> tuple[bool, bool]:
        plain = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, process_group=group, lr=0.1)
        overlapped = ZeroRedundancyOptimizer(_params(), torch.optim.SGD, process_group=group,
                                             overlap_with_ddp=True, lr=0.1)
        return plain.overlap_with_ddp, overlapped.overlap_with_ddp
    assert run_threads(1, body, timeout=60) == [(False, True)]
