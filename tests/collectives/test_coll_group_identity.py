"""Which group a ``new_group`` call makes, when only its members call it, in any order.

Members agree on a group through the store: its number cannot depend on how many groups
each rank made before, and its rank order is part of it. Every case runs real processes
on tcp and on shm (where a group of one host shares memory, and a wrong order would
never show in a message).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch, spawn

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]

BACKENDS = ["tcp", "shm"]
OP_TIMEOUT = 30.0  # an undetected disagreement ends with this; detection takes far less


def _sum(group: Any, rank: int) -> float:
    t = torch.tensor([float(rank + 1)])
    tandem.all_reduce(t, group=group)
    return t.item()


# -- use_local_synchronization: only members call --------------------------------------------
def _members_only(rank: int, world_size: int) -> dict[str, float]:
    out = {}
    if rank in (0, 1):  # ranks 2 and 3 never hear of A
        a = tandem.new_group([0, 1], use_local_synchronization=True)
        out["A"] = _sum(a, rank)
    if rank in (1, 2):  # rank 1 made a group before this one, rank 2 did not
        c = tandem.new_group([1, 2], use_local_synchronization=True)
        out["C"] = _sum(c, rank)
    if rank in (2, 3):
        b = tandem.new_group([2, 3], use_local_synchronization=True)
        out["B"] = _sum(b, rank)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_created_by_their_members_only_work(backend: str) -> None:
    seen = spawn(4, _members_only, backend=backend, timeout=120, op_timeout=OP_TIMEOUT)
    expected = {"A": 1.0 + 2.0, "C": 2.0 + 3.0, "B": 3.0 + 4.0}
    for rank, got in enumerate(seen):
        for name, value in got.items():
            assert value == expected[name], f"rank {rank}: all_reduce on {name} gave {value}"
    assert [sorted(s) for s in seen] == [["A"], ["A", "C"], ["B", "C"], ["B"]]


def _cyclic(rank: int, world_size: int) -> dict[str, float]:
    # each rank creates its two groups in an order that forms a cycle: 0 waits for 1 on A,
    # 1 for 2 on B, 2 for 0 on C if creating a group waited for the other members
    plans = {0: [("A", [0, 1]), ("C", [0, 2])], 1: [("B", [1, 2]), ("A", [0, 1])],
             2: [("C", [0, 2]), ("B", [1, 2])]}
    groups = {name: tandem.new_group(ranks, use_local_synchronization=True)
              for name, ranks in plans[rank]}
    works, tensors = [], {}
    for name, g in groups.items():  # all at once: the calls need no common order either
        tensors[name] = torch.tensor([float(rank + 1)])
        works.append(tandem.all_reduce(tensors[name], group=g, async_op=True))
    for w in works:
        w.wait()
    return {name: t.item() for name, t in tensors.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_groups_created_in_a_cycle_do_not_deadlock(backend: str) -> None:
    seen = spawn(3, _cyclic, backend=backend, timeout=120, op_timeout=OP_TIMEOUT)
    expected = {"A": 3.0, "B": 5.0, "C": 4.0}
    for rank, got in enumerate(seen):
        assert got == {k: expected[k] for k in got}, f"rank {rank}: {got}"


# -- sort_ranks=False: the order is part of the group ------------------------------------------
def _same_order(rank: int, world_size: int) -> dict[str, Any]:
    g = tandem.new_group([1, 0], sort_ranks=False)
    t = torch.tensor([float(rank + 1)])
    tandem.broadcast(t, group=g, group_src=0)  # group rank 0 is global rank 1
    return {"group_rank": tandem.get_rank(g), "ranks": tandem.get_process_group_ranks(g),
            "from_group_rank_0": t.item(), "sum": _sum(g, rank)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_unsorted_ranks_given_alike_set_the_group_order(backend: str) -> None:
    seen = spawn(2, _same_order, backend=backend, timeout=90, op_timeout=OP_TIMEOUT)
    for rank, s in enumerate(seen):
        assert s["ranks"] == [1, 0] and s["group_rank"] == 1 - rank, f"rank {rank}: {s}"
        assert s["from_group_rank_0"] == 2.0, f"rank {rank}: broadcast from group rank 0: {s}"
        assert s["sum"] == 3.0, f"rank {rank}: {s}"


def _different_orders(rank: int, world_size: int) -> dict[str, Any]:
    start = time.monotonic()
    order = [0, 1, 2] if rank == 0 else [2, 1, 0]
    try:
        g = tandem.new_group(order, sort_ranks=False)
    except Exception as exc:  # noqa: BLE001 - described for the test
        return {"at": "creation", "type": type(exc).__name__, "msg": str(exc),
                "elapsed": time.monotonic() - start}
    try:
        value = _sum(g, rank)
    except Exception as exc:  # noqa: BLE001 - described for the test
        return {"at": "first call", "type": type(exc).__name__, "msg": str(exc),
                "elapsed": time.monotonic() - start}
    return {"at": "nowhere", "value": value, "elapsed": time.monotonic() - start}


@pytest.mark.parametrize("backend", BACKENDS)
def test_members_giving_different_orders_are_stopped_at_creation(backend: str) -> None:
    outcomes = launch(3, _different_orders, backend=backend, timeout=90, op_timeout=OP_TIMEOUT)
    seen = [o.value for o in outcomes]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    for rank, s in enumerate(seen):
        assert s["at"] != "nowhere", f"rank {rank} combined data in a group of two orders: {s}"
        assert s["elapsed"] < OP_TIMEOUT / 3, f"rank {rank} found out only after {s['elapsed']}s"
    at_creation = [s for s in seen if s["at"] == "creation" and
                   s["type"] == "CollectiveMismatchError"]
    assert at_creation, f"no rank was stopped at creation: {seen}"
    assert "[2, 1, 0]" in at_creation[0]["msg"] and "[0, 1, 2]" in at_creation[0]["msg"], (
        f"the message should name both orders: {at_creation[0]['msg']}")


# -- new_subgroups(group=...) and non-members ---------------------------------------------------
def _subgroups_of_a_group(rank: int, world_size: int) -> dict[str, Any]:
    parent = tandem.new_group([0, 2, 1, 3], sort_ranks=False)
    mine, all_groups = tandem.new_subgroups(2, group=parent)
    odd = tandem.new_group([1, 3])
    out: dict[str, Any] = {
        "mine": tandem.get_process_group_ranks(mine),
        "all": [tandem.get_process_group_ranks(g) for g in all_groups],
        "sum": _sum(mine, rank),
        "odd_size": tandem.get_world_size(odd),
    }
    if rank in (0, 2):
        try:
            tandem.new_subgroups(1, group=odd)
            out["outsider"] = None
        except Exception as exc:  # noqa: BLE001 - described for the test
            out["outsider"] = (type(exc).__name__, str(exc))
    return out


def test_new_subgroups_splits_the_given_group_in_its_rank_order() -> None:
    seen = spawn(4, _subgroups_of_a_group, backend="tcp", timeout=120, op_timeout=OP_TIMEOUT)
    for rank, s in enumerate(seen):
        assert s["all"] == [[0, 2], [1, 3]], f"rank {rank}: subgroups {s['all']}"
        mine = [0, 2] if rank in (0, 2) else [1, 3]
        assert s["mine"] == mine and s["sum"] == float(sum(r + 1 for r in mine)), (
            f"rank {rank}: {s}")
        assert s["odd_size"] == (2 if rank in (1, 3) else -1), (
            f"rank {rank}: get_world_size of a group it is {'in' if rank % 2 else 'not in'}: "
            f"{s['odd_size']}")
    for rank in (0, 2):
        kind, message = seen[rank]["outsider"]
        assert kind == "StateError" and f"rank {rank}" in message, (
            f"rank {rank}: new_subgroups on a group it is not in: {kind}: {message}")
