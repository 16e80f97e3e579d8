"""``ElasticState`` and ``ElasticSampler`` on one process: what a commit keeps, what a
rollback restores, and the arguments that are refused."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

import tandem
from tandem.elastic import ElasticSampler, ElasticState, run_elastic
from tandem.elastic._session import Regroup
from tandem.errors import ArgumentError, StateError


@pytest.fixture
def solo() -> Iterator[None]:
    tandem.init_process_group("tcp", store=tandem.HashStore(), rank=0, world_size=1, timeout=10)
    yield
    tandem.destroy_process_group()


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)


def _step(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    net(torch.randn(3, 4)).sum().backward()
    opt.step()


def test_a_rollback_restores_parameters_optimizer_values_and_drops_gradients() -> None:
    net, opt = _trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    state = ElasticState(model=net, optimizer=opt, step=0, history=[], sched=sched)
    _step(net, opt)
    state.step, state.history = 1, [1.0]
    state.commit()
    kept = [p.detach().clone() for p in net.parameters()]
    moments = opt.state_dict()["state"][0]["exp_avg"].clone()
    _step(net, opt)
    sched.step()
    state.step += 1
    state.history.append(2.0)
    state._roll_back(state._snapshot(state._commits))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), kept))
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], moments)
    assert state.step == 1 and state.history == [1.0] and sched.last_epoch == 0
    assert all(p.grad is None for p in net.parameters())
    _step(net, opt)  # the optimizer's updates must not reach the snapshot
    assert torch.equal(state._snapshot(state._commits).optimizer["state"][0]["exp_avg"], moments)


def test_two_commits_are_kept() -> None:
    net, opt = _trained()
    state = ElasticState(model=net, optimizer=opt, step=0)
    for _ in range(3):
        state.commit()
    assert state._commits_held() == [2, 3]


def test_values_are_attributes_and_only_the_named_ones() -> None:
    state = ElasticState(step=3)
    state.step += 1
    assert state.step == 4
    with pytest.raises(AttributeError, match="name every value"):
        state.epoch = 1
    with pytest.raises(AttributeError, match="no value 'epoch'"):
        _ = state.epoch
    with pytest.raises(ArgumentError, match="cannot be the names of values"):
        ElasticState(commit=1)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ArgumentError, match="model must be an nn.Module"):
        ElasticState(model=object())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="optimizer must be a torch.optim.Optimizer"):
        ElasticState(optimizer=object())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="min_ranks must be an int >= 1"):
        ElasticState(min_ranks=0)
    with pytest.raises(ArgumentError, match="run_elastic takes an ElasticState"):
        run_elastic(object())  # type: ignore[arg-type]


def test_a_sharded_optimizer_is_refused(solo: None) -> None:
    from tandem.optim import ZeroRedundancyOptimizer

    net, _ = _trained()
    zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.AdamW, lr=0.1)
    with pytest.raises(ArgumentError, match="ZeroRedundancyOptimizer shards the optimizer"):
        ElasticState(model=net, optimizer=zero)


def test_run_elastic_needs_a_process_group() -> None:
    @run_elastic(ElasticState(step=0))
    def train(state: ElasticState) -> None:
        pass

    with pytest.raises(StateError, match="call tandem.init_process_group"):
        train()


def test_a_regroup_is_not_caught_by_except_exception() -> None:
    assert not issubclass(Regroup, Exception)


def test_the_sampler_splits_each_global_batch_by_rank_and_follows_the_step(solo: None) -> None:
    state = ElasticState(step=0)
    sampler = ElasticSampler(10, state, 3, shuffle=False)
    it = iter(sampler)
    assert [next(it), next(it)] == [[0, 1, 2], [3, 4, 5]]
    state.step = 2
    assert sampler.position_at(2) == 6
    assert sampler.indices(6, rank=1, world_size=2) == [9, 0, 1]  # crosses the epoch
    state.commit()
    assert state._snapshot(1).positions == [6]


def test_reshard_keeps_the_global_batch() -> None:
    sampler = ElasticSampler(100, ElasticState(step=0), 8, mode="reshard", shuffle=False)
    assert sampler.per_rank(2) == 4 and sampler.per_rank(3) == 2
    assert sampler.indices(0, rank=1, world_size=2) == [4, 5, 6, 7]
    with pytest.raises(ArgumentError, match="cannot be split among 9 ranks"):
        sampler.per_rank(9)


def test_sampler_arguments_are_checked() -> None:
    with pytest.raises(ArgumentError, match="counts steps with state.step"):
        ElasticSampler(10, ElasticState(), 2)
    with pytest.raises(ArgumentError, match="mode must be one of"):
        ElasticSampler(10, ElasticState(step=0), 2, mode="grow")
    with pytest.raises(ArgumentError, match="batch_size must be a positive int"):
        ElasticSampler(10, ElasticState(step=0), 0)


def test_the_note_of_a_long_error_is_shortened_between_words() -> None:
    from tandem.elastic._run import _brief
    long = ("rank 1 died " + "while the group waited; did it exit or was it killed? " * 8).strip()
    brief = _brief(RuntimeError(long + "\nsecond line"))
    assert brief.startswith("RuntimeError: rank 1 died while") and brief.endswith(" ...")
    assert len(brief) <= len("RuntimeError: ") + 200
    kept = brief[len("RuntimeError: "):-len(" ...")]
    assert long.startswith(kept) and long[len(kept)] == " "  # cut where a word ended
    assert _brief(ValueError("short")) == "ValueError: short"
