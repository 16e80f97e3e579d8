"""Ranks that call different collectives at the same point are stopped before data moves.

One job per backend (tcp; shm, where all_reduce goes through shared memory) runs every case, each on a fresh two-rank group (``new_group`` is local, so
this costs nothing), so one case's abort does not leak into the next. Rank 0 and rank 1
make their calls on different lines of this file, so the expected call sites differ.
Each rank's tensor holds rank-specific values: combining anything would change it.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, line_of, values
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]

GROUP_TIMEOUT = 10.0  # a case that is not detected ends with this timeout instead
FAST = GROUP_TIMEOUT / 2  # a detected one long before it


def _tensor(rank: int, dtype: torch.dtype = torch.float32, n: int = 4) -> torch.Tensor:
    return (torch.arange(n) + 10 * (rank + 1)).to(dtype)


def _op(rank: int, g: Any, t: torch.Tensor) -> None:
    if rank == 0:
        dist.all_reduce(t, group=g)  # site: op/0
    else:
        dist.broadcast(t, src=0, group=g)  # site: op/1


def _dtype(rank: int, g: Any, t: torch.Tensor) -> None:
    if rank == 0:
        dist.all_reduce(t, group=g)  # site: dtype/0
    else:
        dist.all_reduce(t, group=g)  # site: dtype/1


def _shape(rank: int, g: Any, t: torch.Tensor) -> None:
    if rank == 0:
        dist.all_reduce(t, group=g)  # site: shape/0
    else:
        dist.all_reduce(t, group=g)  # site: shape/1


def _size_changes_algorithm(rank: int, g: Any, t: torch.Tensor) -> None:
    if rank == 0:
        dist.all_reduce(t, group=g)  # site: algorithm/0
    else:
        dist.all_reduce(t, group=g)  # site: algorithm/1


def _reduce_op(rank: int, g: Any, t: torch.Tensor) -> None:
    if rank == 0:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)  # site: reduce_op/0
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)  # site: reduce_op/1


def _gather_sizes(rank: int, g: Any, t: torch.Tensor) -> None:
    # each rank gathers tensors of its own size: the ranks disagree on every size
    dist.all_gather([torch.zeros_like(t) for _ in range(2)], t, group=g)  # site: gather


def _root(rank: int, g: Any, t: torch.Tensor) -> None:
    if rank == 0:
        dist.broadcast(t, src=0, group=g)  # site: root/0
    else:
        dist.broadcast(t, src=1, group=g)  # site: root/1


# name: (call, tensor of each rank, the text of each rank's signature)
CASES: dict[str, tuple[Callable[..., None], Callable[[int], torch.Tensor], tuple[str, str]]] = {
    "op": (_op, _tensor, ("all_reduce float32[4]", "broadcast float32[4]")),
    "dtype": (_dtype, lambda r: _tensor(r, torch.float64 if r else torch.float32),
              ("all_reduce float32[4]", "all_reduce float64[4]")),
    "shape": (_shape, lambda r: _tensor(r, n=6 if r else 4),
              ("all_reduce float32[4]", "all_reduce float32[6]")),
    # 16384 float32 = 64 KiB takes the ring, one element less recursive doubling
    "algorithm": (_size_changes_algorithm, lambda r: _tensor(r, n=16384 - r),
                  ("float32[16384]", "float32[16383]")),
    "reduce_op": (_reduce_op, _tensor, ("op=SUM", "op=MAX")),
    "root": (_root, _tensor, ("root=0", "root=1")),
    "gather_sizes": (_gather_sizes, lambda r: _tensor(r, n=4 + r), ("", "")),
}


def _every_mismatch(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for name, (call, make, _) in CASES.items():
        g = dist.new_group([0, 1], timeout=GROUP_TIMEOUT, group_desc=f"mismatch-{name}")
        t = make(rank)
        before = t.clone()
        first = attempt(call, rank, g, t)
        then = attempt(dist.all_reduce, torch.ones(1), group=g)
        out[name] = {"first": first, "then": then, "unchanged": torch.equal(t, before)}
    dist.barrier()  # neither rank leaves while the other may still be told something
    return out


@pytest.fixture(scope="module", params=["tcp", "shm"])
def mismatches(request: Any) -> dict[int, Any]:
    # over shm, all_reduce moves no messages (shared staging memory): the calls are
    # compared through each rank's announcements instead
    out = values(launch(2, _every_mismatch, timeout=60, op_timeout=20.0,
                        backend=request.param), [0, 1])
    return {rank: {**out[rank], "backend": request.param} for rank in out}


def _error(case: dict[str, Any]) -> dict[str, Any]:
    """The error that reported the mismatch: the call itself, or the next call on the group."""
    return case["then"] if case["first"]["ok"] else case["first"]


DETECTED = ["op", "dtype", "shape", "algorithm", "reduce_op"]


@pytest.mark.parametrize("name", [*DETECTED, "root"])
def test_every_rank_raises_collective_mismatch(mismatches: Any, name: str) -> None:
    for rank in (0, 1):
        case = mismatches[rank][name]
        err = _error(case)
        assert not err["ok"], f"rank {rank}: the mismatch went unnoticed: {case}"
        if case["first"]["ok"]:  # a rank that only sent: told at its next call
            assert err["type"] in ("CollectiveMismatchError", "StateError"), (rank, err)
            assert "mismatch" in err["msg"], (rank, err)
        else:
            assert err["type"] == "CollectiveMismatchError", (rank, err)
            assert err["elapsed"] < FAST, (rank, err)  # not by GROUP_TIMEOUT


@pytest.mark.parametrize("name", DETECTED)
def test_mismatch_message_names_both_ranks_signatures_and_call_sites(
        mismatches: Any, name: str) -> None:
    sigs = CASES[name][2]
    sites = [f"test_fault_mismatch.py:{line_of(__file__, f'site: {name}/{r}')}" for r in (0, 1)]
    for rank in (0, 1):
        msg = _error(mismatches[rank][name])["msg"]
        assert "rank 0" in msg and "rank 1" in msg, (rank, msg)
        assert all(s in msg for s in sigs), (rank, sigs, msg)
        assert all(s in msg for s in sites), (rank, sites, msg)


@pytest.mark.parametrize("name", list(CASES))
def test_no_data_is_combined(mismatches: Any, name: str) -> None:
    for rank in (0, 1):
        assert mismatches[rank][name]["unchanged"], f"rank {rank}'s tensor changed in {name}"


@pytest.mark.parametrize("name", [*DETECTED, "root"])
def test_next_collective_on_the_group_fails_fast(mismatches: Any, name: str) -> None:
    for rank in (0, 1):
        then = mismatches[rank][name]["then"]
        assert not then["ok"] and then["elapsed"] < FAST, (rank, then)
        if name == "root":
            # both ranks only sent, so each learns of the other's call from its stray
            # message, which may arrive while the next call is already running
            assert then["type"] in ("StateError", "CollectiveMismatchError"), (rank, then)
            assert "root=0" in then["msg"] and "root=1" in then["msg"], (rank, then)
        else:
            assert then["type"] == "StateError" and "aborted" in then["msg"], (rank, then)


def test_all_gather_of_different_sizes_says_which_sizes(mismatches: Any) -> None:
    # over shm the members compare announced signatures, which list every rank's size;
    # over tcp the receiver finds a message of the wrong length
    for rank in (0, 1):
        err = _error(mismatches[rank]["gather_sizes"])
        assert err["type"] == "CollectiveMismatchError", (rank, err)
        if mismatches[rank]["backend"] == "shm":
            assert "sizes=4,4" in err["msg"] and "sizes=5,5" in err["msg"], (rank, err)
        else:
            assert "sent 20 bytes" in err["msg"] or "sent 16 bytes" in err["msg"], (rank, err)
            assert "expected 16" in err["msg"] or "expected 20" in err["msg"], (rank, err)


# calls that move only messages, even on a group that shares memory
MESSAGE_ONLY: dict[str, Callable[[int, Any], Any]] = {
    "barrier": lambda rank, g: dist.barrier(group=g),
    "monitored_barrier": lambda rank, g: dist.monitored_barrier(group=g),
    "all_to_all": lambda rank, g: dist.all_to_all_single(torch.empty(4), torch.ones(4), group=g),
    "gather": lambda rank, g: dist.gather(
        torch.ones(2), [torch.empty(2), torch.empty(2)] if rank == 0 else None, group_dst=0, group=g),
    "scatter": lambda rank, g: dist.scatter(
        torch.empty(2), [torch.ones(2), torch.ones(2)] if rank == 0 else None, group_src=0, group=g),
}


def _root_then_messages(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for name, call in MESSAGE_ONLY.items():
        g = dist.new_group([0, 1], timeout=GROUP_TIMEOUT, group_desc=f"then-{name}")
        # each rank its own root
        first = attempt(dist.broadcast, _tensor(rank), src=rank, group=g)
        out[name] = [first, attempt(call, rank, g)]
    dist.barrier()
    return out


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_a_root_mismatch_fails_the_broadcast_and_every_call_after_it(backend: str) -> None:
    # a broadcast root waits for every other rank's confirmation of the root (over shm,
    # for their announcements), so the broadcast itself fails; the group is aborted, so
    # the next call fails at once, whatever it moves
    out = values(launch(2, _root_then_messages, timeout=60, op_timeout=20.0,
                        backend=backend), [0, 1])
    for rank in (0, 1):
        for name, (broadcast, then) in out[rank].items():
            for err in (broadcast, then):
                assert not err["ok"], f"rank {rank}: {name} after mismatched roots: {err}"
                assert err["type"] in ("CollectiveMismatchError", "StateError"), (rank, name, err)
                assert "root=0" in err["msg"] and "root=1" in err["msg"], (rank, name, err)
                assert err["elapsed"] < FAST, (rank, name, err)
