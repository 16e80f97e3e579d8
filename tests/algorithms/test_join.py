"""``Join`` with a user-written Joinable: the classic counter of inputs seen by all ranks.

Each rank calls the counter once per input; a rank that runs out shadows the others'
all-reduces with zeros, and the post-hook copies the last joiner's count everywhere,
so every rank ends knowing the total number of inputs. The same counter shows the
error paths: throw_on_early_termination raising on every rank, an unshadowed
collective raising a mismatch instead of hanging, and misused arguments.

Run: ``python -m pytest tests/algorithms/test_join.py -q``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tandem
from tandem.algorithms.join import Join, Joinable, JoinHook
from tandem.errors import ArgumentError, StateError
from tandem.testing import launch, spawn

pytestmark = pytest.mark.procs


class CounterJoinHook(JoinHook):
    def __init__(self, counter: "Counter", sync_max_count: bool) -> None:
        self.counter = counter
        self.sync_max_count = sync_max_count

    def main_hook(self) -> None:
        tandem.all_reduce(torch.zeros(1))  # the counter's all-reduce, with nothing to add

    def post_hook(self, is_last_joiner: bool) -> None:
        if not self.sync_max_count:
            return
        rank = tandem.get_rank()
        common = torch.tensor([rank if is_last_joiner else -1])
        tandem.all_reduce(common, op=tandem.ReduceOp.MAX)
        if rank == int(common):
            self.counter.max_count = self.counter.count.clone()
        tandem.broadcast(self.counter.max_count, src=int(common))


class Counter(Joinable):
    """Counts, on every rank, the inputs processed by all ranks so far."""

    def __init__(self) -> None:
        super().__init__()
        self.count = torch.zeros(1)
        self.max_count = torch.zeros(1)

    def __call__(self) -> None:
        Join.notify_join_context(self)
        t = torch.ones(1)
        tandem.all_reduce(t)
        self.count += t

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return CounterJoinHook(self, kwargs.get("sync_max_count", False))

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return None  # the default group


INPUTS = [5, 6, 9]  # rank r processes INPUTS[r] inputs


def count_uneven(rank: int, world: int) -> dict[str, Any]:
    counter = Counter()
    with Join([counter], sync_max_count=True):
        for _ in range(INPUTS[rank]):
            counter()
    return {"count": counter.count.item(), "max": counter.max_count.item(),
            "reset": counter._join_config.enable}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_counter_ends_with_the_total_number_of_inputs_on_every_rank(world: int) -> None:
    results = spawn(world, count_uneven, timeout=90)
    total = sum(INPUTS[:world])
    for rank, r in enumerate(results):
        assert r["max"] == total, f"rank {rank}: max_count {r['max']}, expected {total}"
        assert r["reset"] is False, f"rank {rank}: the counter is still in join mode"
    # the last rank to join counted everything itself
    assert results[world - 1]["count"] == total


def throw_early(rank: int, world: int) -> str:
    counter = Counter()
    try:
        with Join([counter], throw_on_early_termination=True):
            for _ in range(INPUTS[rank]):
                counter()
    except StateError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(120)
def test_throw_on_early_termination_raises_on_every_rank() -> None:
    messages = spawn(3, throw_early, timeout=90)
    for rank, msg in enumerate(messages):
        assert "throw_on_early_termination" in msg, f"rank {rank}: {msg}"
    assert "rank 0 exhausted" in messages[0]
    assert "[0]" in messages[1] and "[0]" in messages[2], messages


def unshadowed_collective(rank: int, world: int) -> None:
    counter = Counter()
    with Join([counter]):
        for _ in range(INPUTS[rank]):
            counter()
            tandem.all_reduce(torch.ones(3))  # no hook shadows this one


@pytest.mark.timeout(120)
def test_a_collective_no_hook_shadows_raises_a_mismatch_instead_of_hanging() -> None:
    outcomes = launch(2, unshadowed_collective, timeout=90, op_timeout=30)
    assert not any(o.ok for o in outcomes), outcomes
    assert any(o.error_type == "CollectiveMismatchError" for o in outcomes), \
        [o.error for o in outcomes]
    assert all(o.error != "deadline" for o in outcomes), "a rank hung until the deadline"


class Strict(Counter):
    join_kwargs = frozenset({"sync_max_count"})


def bad_arguments(rank: int, world: int) -> list[str]:
    errors = []
    for make in (lambda: Join([]), lambda: Join([object()]),  # type: ignore[list-item]
                 lambda: Join([Strict()], sync_max_cuont=True)):
        try:
            make()
            errors.append("no error")
        except ArgumentError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.smoke("tandem.algorithms")
def test_bad_arguments_are_refused_with_their_name() -> None:
    errors = spawn(1, bad_arguments, timeout=60)[0]
    assert "at least one" in errors[0]
    assert "got object" in errors[1]
    assert "sync_max_cuont" in errors[2] and "sync_max_count" in errors[2]

