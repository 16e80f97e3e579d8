"""Subgroups on 4 processes: new_group, new_subgroups, rank translation, non-members, and
several groups used concurrently. One spawn; each behaviour is its own test."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.testing import spawn

import _coll_ranks

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

WORLD = 4


@pytest.fixture(scope="module")
def seen() -> list[dict[str, Any]]:
    return spawn(WORLD, _coll_ranks.groups_behaviour, timeout=100, op_timeout=20)


@pytest.mark.smoke("tandem.collectives")
def test_new_group_sorts_ranks_like_torch(seen) -> None:
    for rank, s in enumerate(seen):
        assert s["odd_ranks"] == [1, 3], f"rank {rank}: get_process_group_ranks {s['odd_ranks']}"


def test_get_rank_and_world_size_of_a_group(seen) -> None:
    expected = {0: (-1, -1), 1: (0, 2), 2: (-1, -1), 3: (1, 2)}  # -1 outside, as torch
    for rank, s in enumerate(seen):
        assert s["odd_rank_and_size"] == expected[rank], (
            f"rank {rank}: (get_rank, get_world_size) of group [1, 3] is {s['odd_rank_and_size']}")


def test_group_and_global_ranks_translate_both_ways(seen) -> None:
    for rank, s in enumerate(seen):
        assert s["odd_group_rank_of_3"] == 1, f"rank {rank}: get_group_rank(odd, 3)"
        assert s["odd_global_rank_of_0"] == 1, f"rank {rank}: get_global_rank(odd, 0)"


def test_get_group_rank_of_a_non_member_raises_argument_error(seen) -> None:
    for rank, s in enumerate(seen):
        kind, message = s["odd_group_rank_of_2"]
        assert kind == "ArgumentError" and "2" in message, f"rank {rank}: {kind}: {message}"


def test_collectives_on_a_subgroup_use_its_members_and_global_src(seen) -> None:
    for rank in (1, 3):
        assert seen[rank]["odd_all_reduce"] == [4.0, 4.0], f"rank {rank}: all_reduce on [1, 3]"
        assert seen[rank]["odd_broadcast_from_3"] == [3.0], f"rank {rank}: broadcast(src=3)"


@pytest.mark.parametrize("call", ["all_reduce", "broadcast", "barrier", "all_gather_object",
                                  "send", "irecv"])
def test_non_member_calling_gets_state_error_naming_rank_and_group(seen, call: str) -> None:
    for rank in (0, 2):
        error = seen[rank]["nonmember_calls"][call]
        assert error is not None, f"rank {rank}: {call} on a group it is not in returned silently"
        kind, message = error
        assert kind == "StateError", f"rank {rank}: {call} raised {kind}: {message}"
        assert f"rank {rank}" in message and "'odd'" in message, (
            f"rank {rank}: {call}: message does not name the rank and the group: {message}")


def test_new_subgroups_splits_the_world_into_consecutive_groups(seen) -> None:
    for rank, s in enumerate(seen):
        assert s["all_subgroup_ranks"] == [[0, 1], [2, 3]], f"rank {rank}: {s['all_subgroup_ranks']}"
        mine = [0, 1] if rank < 2 else [2, 3]
        assert s["subgroup_ranks"] == mine, f"rank {rank}: its subgroup is {s['subgroup_ranks']}"
        assert s["subgroup_all_reduce"] == float(sum(mine)), (
            f"rank {rank}: all_reduce on its subgroup gave {s['subgroup_all_reduce']}")


def test_overlapping_groups_used_concurrently_do_not_interfere(seen) -> None:
    members = {"A": [0, 1, 2], "B": [1, 2, 3], "W": [0, 1, 2, 3]}
    for rank, s in enumerate(seen):
        for key, value in s["concurrent"].items():
            name, i = key[0], int(key[1:])
            expected = float(sum(r + 10 * i for r in members[name]))
            assert value == expected, (
                f"rank {rank}: async all_reduce #{i} on group {name} gave {value}, "
                f"expected {expected}")


def test_destroyed_subgroup_refuses_further_calls(seen) -> None:
    for rank, s in enumerate(seen):
        kind, message = s["after_destroy"] or ("no error", "")
        assert kind == "StateError" and "destroyed" in message, f"rank {rank}: {kind}: {message}"
