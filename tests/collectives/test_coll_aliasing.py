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
from tandem.errors import ArgumentError
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


# -- outputs that overlap each other: refused before any byte moves -------------------------
# Each output of a list is written with another rank's data; two that share memory keep
# only the last writer's, and the other rank's data is lost without a word.
P = 3  # the size of the ``lonely`` group of conftest; the test process is rank 1


def _two_and_a_view() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    base = torch.zeros(8)
    return base[0:3], base[2:5], base[5:8]  # the first two share element 2


OVERLAPPING_OUTPUTS = {
    "all_gather-same-tensor-twice": (
        lambda g: (lambda o: tandem.all_gather([torch.zeros(3), o, o], torch.ones(3), group=g))(
            torch.zeros(3)), r"all_gather: tensor_list\[1\] and tensor_list\[2\] overlap in "
                             r"memory \(the same tensor twice\)"),
    "all_gather-overlapping-views": (
        lambda g: tandem.all_gather(list(_two_and_a_view()), torch.ones(3), group=g),
        r"all_gather: tensor_list\[0\] and tensor_list\[1\] overlap in memory \(views"),
    "all_gather-strided-views-sharing-an-element": (
        lambda g: (lambda b: tandem.all_gather([b[0:6:2], b[4:10:2], b[10:13]], torch.ones(3),
                                               group=g))(torch.zeros(16)),
        r"tensor_list\[0\] and tensor_list\[1\] overlap"),
    "gather-list-on-the-root": (
        lambda g: (lambda o: tandem.gather(torch.ones(3), [o, torch.zeros(3), o], dst=1,
                                           group=g))(torch.zeros(3)),
        r"gather: gather_list\[0\] and gather_list\[2\] overlap in memory"),
    "all_to_all-outputs": (
        lambda g: tandem.all_to_all(list(_two_and_a_view()), [torch.ones(3)] * 3, group=g),
        r"all_to_all: output_tensor_list\[0\] and output_tensor_list\[1\] overlap"),
    "batch-two-receives-into-one-tensor": (
        lambda g: (lambda t: tandem.batch_isend_irecv([
            tandem.P2POp(tandem.irecv, t, 0, g), tandem.P2POp(tandem.isend, torch.ones(2), 2, g),
            tandem.P2POp(tandem.irecv, t[1:], 2, g)]))(torch.zeros(3)),
        r"batch_isend_irecv: the receives p2p_op_list\[0\] and p2p_op_list\[2\] overlap"),
    "batch-receive-into-a-send": (
        lambda g: (lambda t: tandem.batch_isend_irecv([
            tandem.P2POp(tandem.isend, t, 2, g), tandem.P2POp(tandem.irecv, t, 0, g)]))(
            torch.zeros(3)),
        r"the receive p2p_op_list\[1\] overlaps in memory the send p2p_op_list\[0\]"),
}


@pytest.mark.parametrize("case", list(OVERLAPPING_OUTPUTS))
def test_outputs_sharing_memory_are_refused(lonely, case: str) -> None:
    call, message = OVERLAPPING_OUTPUTS[case]
    with pytest.raises(ArgumentError, match=message):
        call(lonely)


def test_overlapping_pair_tells_interleaved_views_from_shared_elements() -> None:
    from tandem.collectives.checks import overlapping_pair

    base = torch.zeros(4, 6)
    assert overlapping_pair([base[:, 0::2], base[:, 1::2]]) is None  # interleaved, disjoint
    assert overlapping_pair([base[0], base[1], base[2:]]) is None
    assert overlapping_pair([base[:, 1], base[1]]) == (0, 1)  # a column and a row meet
    assert overlapping_pair([base[3], base[1, 0:5], base[:, 5]]) == (0, 2)
    assert overlapping_pair([base[0:0], base[0:0]]) is None  # empty tensors share nothing
    raw = torch.zeros(16, dtype=torch.uint8)
    assert overlapping_pair([raw[0:4].view(torch.int32), raw[3:4]]) == (0, 1)  # byte-level


@pytest.mark.parametrize("ws", [2, 3])
def test_interleaved_output_views_still_gather_on_threads(ws: int) -> None:
    def body(g):
        base = torch.zeros(3, ws)
        tandem.all_gather([base[:, i] for i in range(ws)], torch.full((3,), float(g.rank() + 1)),
                          group=g)
        return base.tolist()

    want = [[float(i + 1) for i in range(ws)]] * 3
    for rank, got in enumerate(run_threads(ws, body)):
        assert got == want, f"rank {rank}: {got}"


def _gather_into_one_tensor_twice(rank: int, world_size: int) -> str:
    torch.set_num_threads(1)
    o = torch.zeros(1)
    try:
        tandem.all_gather([o] * world_size, torch.full((1,), float(rank)))
    except ArgumentError as exc:
        return str(exc)
    return f"completed with {o.tolist()}"


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_one_output_twice_is_refused_on_every_rank(backend: str) -> None:
    got = spawn(2, _gather_into_one_tensor_twice, backend=backend, timeout=100, op_timeout=20)
    for rank, message in enumerate(got):
        assert "tensor_list[0] and tensor_list[1] overlap in memory" in message, (
            f"{backend}, rank {rank}: {message}")


def test_views_too_large_to_compare_are_refused_saying_so(lonely) -> None:
    base = torch.zeros(2, 1 << 20)  # interleaved halves: 2M elements to compare
    with pytest.raises(ArgumentError, match=r"tensor_list\[0\] and tensor_list\[1\] may overlap "
                                            r"in memory \(strided views .* more than"):
        tandem.all_gather([base[:, 0::2], base[:, 1::2], torch.zeros(2, 1 << 19)],
                          torch.zeros(2, 1 << 19), group=lonely)
