"""Ranks that disagree on a root or on a custom reduce op are stopped before combining.

A gather or reduce root only receives: two ranks that each believe they are the root
would both wait for data nobody sends. A rank whose own part can complete (it only
sends) may return, but the group is aborted and its next call fails. Two custom reduce ops with the same name (two
lambdas) would combine into different results per rank. Each case must end on every
rank with ``CollectiveMismatchError`` within seconds, far below the group's deadline,
on tcp and on shm. Each case runs on a fresh group, so one case's abort stays there.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch

import tandem
from tandem.testing import RankFailed, launch, run_threads

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]

BACKENDS = ["tcp", "shm", "auto"]
OP_TIMEOUT = 40.0  # an undetected disagreement ends with this


def _gather_each_its_own_dst(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    out = [torch.empty(4) for _ in range(tandem.get_world_size(g))]
    tandem.gather(t, out, dst=rank, group=g)
    return [x.tolist() for x in out]


def _reduce_each_its_own_dst(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    tandem.reduce(t, dst=rank, group=g)
    return t.tolist()


# Rank 0 says the root is 0, ranks 1 and 2 say 1. Rank 2 agrees with its root and may
# finish its part before rank 0's claim reaches it; then its next call on the group fails.
def _gather_two_camps(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    dst = 0 if rank == 0 else 1
    out = [torch.empty(4) for _ in range(3)] if rank == dst else None
    tandem.gather(t, out, dst=dst, group=g)
    tandem.barrier(group=g)
    return None


def _reduce_two_camps(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    tandem.reduce(t, dst=0 if rank == 0 else 1, group=g)
    tandem.barrier(group=g)
    return t.tolist()


# Each names the other as the root: neither waits for data, so both may finish their
# part; the group is aborted all the same and the next call on it fails.
def _reduce_each_names_the_other(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    tandem.reduce(t, dst=1 - rank, group=g)
    tandem.barrier(group=g)
    return t.tolist()


# broadcast and scatter roots only send: two ranks that each believe they are the root
# would both return, each with its own data, unless the call itself catches it
def _broadcast_each_its_own_src(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    tandem.broadcast(t, src=rank, group=g)
    return t.tolist()


def _scatter_each_its_own_src(rank: int, g: Any) -> Any:
    t = torch.empty(4)
    tandem.scatter(t, [torch.full((4,), float(rank))] * 2, src=rank, group=g)
    return t.tolist()


def _broadcast_each_names_the_other(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    tandem.broadcast(t, src=1 - rank, group=g)
    return t.tolist()


def _scatter_each_names_the_other(rank: int, g: Any) -> Any:
    t = torch.empty(4)
    tandem.scatter(t, None, src=1 - rank, group=g)
    return t.tolist()


def _broadcast_two_camps(rank: int, g: Any) -> Any:
    t = torch.full((4,), float(rank))
    tandem.broadcast(t, src=0 if rank == 0 else 1, group=g)
    tandem.barrier(group=g)
    return t.tolist()


def _scatter_two_camps(rank: int, g: Any) -> Any:
    src = 0 if rank == 0 else 1
    t = torch.empty(4)
    tandem.scatter(t, [torch.full((4,), float(rank))] * 3 if rank == src else None, src=src,
                   group=g)
    tandem.barrier(group=g)
    return t.tolist()


def _broadcast_object_list_each_its_own_src(rank: int, g: Any) -> Any:
    objects = [{"from": rank}]
    tandem.broadcast_object_list(objects, src=rank, group=g)
    return objects


def _scatter_object_list_each_its_own_src(rank: int, g: Any) -> Any:
    out: list[Any] = [None]
    tandem.scatter_object_list(out, [rank, rank], src=rank, group=g)
    return out


def _gather_object_each_its_own_dst(rank: int, g: Any) -> Any:
    out: list[Any] = [None, None]
    tandem.gather_object(rank, out, dst=rank, group=g)
    return out


def _two_lambdas(rank: int, g: Any) -> Any:
    if rank == 0:
        op = tandem.ReduceOp.custom(lambda a, b: torch.maximum(a, b))
    else:
        op = tandem.ReduceOp.custom(lambda a, b: torch.minimum(a, b))
    t = torch.arange(4.0) * (1 if rank else -1)
    tandem.all_reduce(t, op=op, group=g)
    return t.tolist()


def _same_name_different_function(rank: int, g: Any) -> Any:
    fn = torch.maximum if rank == 0 else torch.minimum
    t = torch.arange(4.0) * (1 if rank else -1)
    tandem.all_reduce(t, op=tandem.ReduceOp.custom(fn, name="PICK"), group=g)
    return t.tolist()


CASES: dict[str, tuple[int, Callable[[int, Any], Any]]] = {
    "gather-each-its-own-dst": (2, _gather_each_its_own_dst),
    "reduce-each-its-own-dst": (2, _reduce_each_its_own_dst),
    "gather-two-camps": (3, _gather_two_camps),
    "reduce-two-camps": (3, _reduce_two_camps),
    "reduce-each-names-the-other": (2, _reduce_each_names_the_other),
    "broadcast-each-its-own-src": (2, _broadcast_each_its_own_src),
    "scatter-each-its-own-src": (2, _scatter_each_its_own_src),
    "broadcast-each-names-the-other": (2, _broadcast_each_names_the_other),
    "scatter-each-names-the-other": (2, _scatter_each_names_the_other),
    "broadcast-two-camps": (3, _broadcast_two_camps),
    "scatter-two-camps": (3, _scatter_two_camps),
    "broadcast_object_list-each-its-own-src": (2, _broadcast_object_list_each_its_own_src),
    "scatter_object_list-each-its-own-src": (2, _scatter_object_list_each_its_own_src),
    "gather_object-each-its-own-dst": (2, _gather_object_each_its_own_dst),
    "two-lambdas": (2, _two_lambdas),
    "same-name-different-function": (2, _same_name_different_function),
}


def _run(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        size, body = CASES[name]
        g = tandem.new_group(list(range(size)))
        if rank < size:
            start = time.monotonic()
            try:
                out[name] = {"ok": True, "value": body(rank, g)}
            except Exception as exc:  # noqa: BLE001 - described for the test
                out[name] = {"ok": False, "type": type(exc).__name__, "msg": str(exc)}
            out[name]["elapsed"] = time.monotonic() - start
        tandem.barrier()  # the next case starts together on every rank
    return out


@pytest.fixture(scope="module", params=BACKENDS)
def seen(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, dict[str, Any]]]]:
    outcomes = launch(3, _run, (list(CASES),), backend=request.param, timeout=200,
                      op_timeout=OP_TIMEOUT)
    bad = [f"--- rank {o.rank} ({o.error_type}) ---\n{o.error}" for o in outcomes if not o.ok]
    assert not bad, "\n".join(bad)
    return request.param, [o.value for o in outcomes]


# ranks whose own call may complete (they combine nothing); their next call fails
BYSTANDERS = {"gather-two-camps": {2}, "reduce-two-camps": {2},
              "reduce-each-names-the-other": {0, 1}, "broadcast-two-camps": {2},
              "scatter-two-camps": {2}}


@pytest.mark.parametrize("case", list(CASES))
def test_disagreement_is_a_mismatch_on_every_rank_within_seconds(seen, case: str) -> None:
    backend, results = seen
    size = CASES[case][0]
    for rank in range(size):
        r = results[rank][case]
        assert not r["ok"], f"{backend}: rank {rank} completed {case}: {r['value']}"
        expected = ["CollectiveMismatchError"]
        if rank in BYSTANDERS.get(case, ()):
            expected.append("StateError")  # told by the others: the group was aborted
        elif r["type"] == "StateError" and "was aborted earlier" in r["msg"]:
            # the others found the mismatch and aborted the group before this rank's call
            # started: the call fails at once with their finding, naming the mismatch
            assert "collective mismatch" in r["msg"], (backend, rank, r["msg"])
            expected.append("StateError")
        assert r["type"] in expected, f"{backend}: rank {rank} raised {r['type']}: {r['msg']}"
        assert r["elapsed"] < OP_TIMEOUT / 4, (
            f"{backend}: rank {rank} took {r['elapsed']:.1f}s to find out: {r['msg']}")


def test_the_message_names_both_roots(seen) -> None:
    backend, results = seen
    messages = " | ".join(results[r]["gather-each-its-own-dst"]["msg"] for r in range(2))
    assert "root=0" in messages and "root=1" in messages, f"{backend}: {messages}"


def test_the_message_names_both_functions(seen) -> None:
    backend, results = seen
    messages = " | ".join(results[r]["two-lambdas"]["msg"] for r in range(2))
    assert messages.count("custom:<lambda>#") >= 2, f"{backend}: {messages}"


def _same_lambda(rank: int, world_size: int) -> list[float]:
    op = tandem.ReduceOp.custom(lambda a, b: torch.maximum(a, b))
    t = torch.arange(4.0) * (1 if rank else -1)
    tandem.all_reduce(t, op=op)
    g = tandem.new_group([0, 1])
    u = torch.full((2,), float(rank + 1))
    tandem.reduce(u, dst=1, group=g)
    return t.tolist() + (u.tolist() if rank == 1 else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_custom_op_and_the_same_root_still_work(backend: str) -> None:
    outcomes = launch(2, _same_lambda, backend=backend, timeout=90, op_timeout=OP_TIMEOUT)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes if not o.ok]
    assert outcomes[0].value == [0.0, 1.0, 2.0, 3.0]
    assert outcomes[1].value == [0.0, 1.0, 2.0, 3.0, 3.0, 3.0]


ROOT_ONLY_SENDS = {
    "broadcast": lambda g, src: tandem.broadcast(torch.full((4,), float(g.rank())), group=g,
                                                 group_src=src),
    "scatter": lambda g, src: tandem.scatter(
        torch.empty(4), [torch.ones(4)] * 2 if src == g.rank() else None, group=g, group_src=src),
}


@pytest.mark.parametrize("name", list(ROOT_ONLY_SENDS))
@pytest.mark.parametrize("roots", ["each-its-own", "each-names-the-other"])
def test_roots_that_disagree_fail_in_the_call_on_threads(name: str, roots: str) -> None:
    call = ROOT_ONLY_SENDS[name]

    def body(g: Any) -> None:
        call(g, g.rank() if roots == "each-its-own" else 1 - g.rank())

    # a disagreement found only by the deadline would leave the threads running past 20 s
    with pytest.raises(RankFailed) as failed:
        run_threads(2, body, timeout=20, op_timeout=OP_TIMEOUT)
    text = str(failed.value)
    for rank in range(2):
        part = text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "CollectiveMismatchError" in part and "root=" in part, (name, roots, rank, part)
