"""Arguments that share memory: an input that is also an output, or one tensor passed twice.

torch scripts do this (``all_to_all_single(t, t)`` to exchange in place, an input that
sits in the output list), and a call that wrote an output before reading the input it
overlaps would return another rank's data without a word. Each case is checked against
the answer computed locally, on threads (ring and pairwise algorithms) and in one spawn
over shared memory (the staging algorithms).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tandem
from tandem.testing import run_threads, spawn

import _coll_ranks

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

WORLD = 3


def _expected(rank: int, ws: int) -> dict[str, Any]:
    slots = [[float(r + 1)] for r in range(ws)]
    return {
        "all_to_all_single_in_place": [float(10 * r + 2 * rank + k) for r in range(ws)
                                       for k in range(2)],
        "all_gather_input_in_other_slot": slots,
        "all_gather_input_in_other_slot_big": slots,
        "all_gather_into_tensor_input_in_other_chunk": slots,
        "all_to_all_outputs_are_other_inputs": [[float(10 * r + rank)] for r in range(ws)],
        "all_reduce_coalesced_same_tensor_twice": [float(ws)] * 4,  # each listed tensor once
        "reduce_scatter_output_is_an_input": [float(sum(10 * r + rank for r in range(ws)))] * 3,
    }


@pytest.fixture(scope="module")
def over_shm() -> list[dict[str, Any]]:
    return spawn(WORLD, _coll_ranks.aliased_arguments, backend="shm", timeout=100, op_timeout=20)


@pytest.mark.parametrize("name", list(_expected(0, WORLD)))
def test_aliased_arguments_over_shared_memory(over_shm, name: str) -> None:
    for rank, got in enumerate(over_shm):
        assert got[name] == _expected(rank, WORLD)[name], f"rank {rank}: {name} gave {got[name]}"


@pytest.mark.parametrize("ws", [2, 3])
def test_all_to_all_single_in_place_on_threads(ws: int) -> None:
    def body(g):
        t = torch.arange(ws * 2.0) + 10 * g.rank()
        tandem.all_to_all_single(t, t, group=g)
        return t.tolist()

    for rank, got in enumerate(run_threads(ws, body)):
        assert got == _expected(rank, ws)["all_to_all_single_in_place"], f"rank {rank}: {got}"


@pytest.mark.parametrize("ws", [2, 3])
def test_all_gather_input_in_another_slot_on_threads(ws: int) -> None:
    def body(g):
        mine = torch.full((5,), float(g.rank() + 1))
        slots = [torch.zeros(5) for _ in range(ws)]
        slots[(g.rank() + 1) % ws] = mine
        tandem.all_gather(slots, mine, group=g)
        return [s.unique().tolist() for s in slots]

    for rank, got in enumerate(run_threads(ws, body)):
        assert got == _expected(rank, ws)["all_gather_input_in_other_slot"], f"rank {rank}: {got}"
