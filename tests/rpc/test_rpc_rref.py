"""The RRef protocol: owners keep values exactly as long as some worker holds a reference.

* leak: 10,000 RRefs created, forked user -> user, owner -> user and dropped across 3
  workers leave every owner's table empty (after gc, before shutdown);
* premature delete: an RRef passed A -> B -> C, each dropping its own at once, still
  resolves on C (the owner is a fourth worker);
* the rest of RRef's surface: local values, ownership, confirmation, refusals.
"""

from __future__ import annotations

import gc
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem.rpc as rpc
from _rpc_workers import Barrier, attempt, echo, run, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]

HELD: list[Any] = []  # RRefs a worker keeps for a while (module state of the workers)


def make_owned(n: int, base: int) -> list[rpc.RRef[int]]:
    """``n`` RRefs owned by the worker running this: owner -> user forks when returned."""
    return [rpc.RRef(base + i) for i in range(n)]


def hold(rrefs: list[rpc.RRef[Any]]) -> int:
    HELD.extend(rrefs)
    return len(HELD)


def drop_held() -> None:
    HELD.clear()
    gc.collect()


def _settled() -> dict[str, int]:
    info = rpc._get_debug_info()
    return {k: info[k] for k in ("owner_rrefs", "pending_children", "unconfirmed_forks",
                                 "queued_deletes")}


def _leak(rank: int, world: int, per_worker: int) -> dict[str, Any]:
    nxt, other = f"worker{(rank + 1) % 3}", f"worker{(rank + 2) % 3}"
    barrier = rpc.remote("worker0", Barrier, args=(3,)) if rank == 0 else None
    # barrier sharing: worker 0 hands its RRef to the others (owner -> user forks)
    if rank == 0:
        for peer in ("worker1", "worker2"):
            rpc.rpc_sync(peer, hold, args=([barrier],))
    else:
        wait_until(lambda: bool(HELD), 20)
        barrier = HELD.pop()
    third = per_worker // 3
    made = [rpc.remote(nxt, echo, args=(i,)) for i in range(third)]  # creator forks
    made += rpc.rpc_sync(nxt, make_owned, args=(third, 1000))  # owner -> user forks
    for start in range(0, len(made), 500):  # user -> user forks, then dropped there
        rpc.rpc_sync(other, hold, args=(made[start:start + 500],))
    fetched = sum(1 for r in made[:50] if r.to_here() is not None)
    made += [rpc.remote(nxt, echo, args=(i,)) for i in range(per_worker - len(made))]
    created = len(made)
    del made
    assert barrier is not None
    barrier.rpc_sync().arrive()  # everyone has created and forked everything
    drop_held()
    barrier.rpc_sync().arrive()
    del barrier
    gc.collect()
    empty = wait_until(lambda: _settled() == dict.fromkeys(_settled(), 0), 30)
    state = _settled()
    # every table must stay empty until all workers have checked theirs
    rpc.rpc_sync("worker0", _no_op)
    return {"created": created, "fetched": fetched, "empty": empty, "state": state}


def _no_op() -> None:
    return None


def test_ten_thousand_rrefs_leave_no_owner_entry_behind(tmp_path: Path) -> None:
    results = run(3, _leak_then_shutdown, tmp_path, 3334, timeout=150)
    assert sum(r["created"] for r in results) >= 10_000
    for rank, r in enumerate(results):
        assert r["fetched"] == 50
        assert r["empty"], f"worker{rank}: tables not empty after gc: {r['state']}"


def _leak_then_shutdown(rank: int, world: int, per_worker: int) -> dict[str, Any]:
    out = _leak(rank, world, per_worker)
    rpc.shutdown()
    return out


def relay(rref: rpc.RRef[Any], to: str, index: int) -> None:
    """B: pass the RRef on to C and drop it at once (before anyone confirmed anything)."""
    rpc.rpc_async(to, keep, args=(rref, index))


def keep(rref: rpc.RRef[Any], index: int) -> None:
    HELD.append((index, rref))


def make_value(i: int) -> torch.Tensor:
    return torch.full((4,), float(i))


def _chain(rank: int, world: int, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if rank == 0:  # A
        for i in range(rounds):
            rref = rpc.remote("worker3", make_value, args=(i,))
            rpc.rpc_sync("worker1", relay, args=(rref, "worker2", i))
            del rref  # A's own reference goes at once
            if i % 16 == 0:
                gc.collect()
        gc.collect()
    barrier = rpc.remote("worker3", Barrier, args=(4,)) if rank == 3 else None
    if rank == 3:
        for peer in ("worker0", "worker1", "worker2"):
            rpc.rpc_sync(peer, hold_barrier, args=(barrier,))
    else:
        wait_until(lambda: BARRIER, 30)
        barrier = BARRIER.pop()
    assert barrier is not None
    barrier.rpc_sync().arrive()
    if rank == 2:  # C: every value must still be there
        wait_until(lambda: len(HELD) == rounds, 30)
        out["values"] = sorted((i, r.to_here()[0].item()) for i, r in HELD)
        out["confirmed"] = all(r.confirmed_by_owner() for _, r in HELD)
        HELD.clear()
    gc.collect()
    barrier.rpc_sync().arrive()
    del barrier
    gc.collect()
    out["empty"] = wait_until(lambda: _settled() == dict.fromkeys(_settled(), 0), 30)
    out["state"] = _settled()
    rpc.shutdown()
    return out


BARRIER: list[Any] = []


def hold_barrier(rref: rpc.RRef[Any]) -> None:
    BARRIER.append(rref)


def test_an_rref_passed_a_to_b_to_c_survives_a_and_b_dropping_theirs(tmp_path: Path) -> None:
    rounds = 100
    results = run(4, _chain, tmp_path, rounds, timeout=120)
    assert results[2]["values"] == [(i, float(i)) for i in range(rounds)]
    assert results[2]["confirmed"]
    for rank, r in enumerate(results):
        assert r["empty"], f"worker{rank}: {r['state']}"


def _surface(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        mine = rpc.RRef(torch.arange(3.0))
        r["local"] = (mine.is_owner(), mine.local_value().tolist(), mine.to_here().tolist(),
                      mine.owner_name(), mine.confirmed_by_owner())
        r["owner_to_user"] = rpc.rpc_sync("worker1", _fetch, args=(mine,))
        theirs = rpc.remote("worker1", torch.ones, args=(2,))
        r["user_local_value"] = attempt(theirs.local_value)
        theirs.to_here()
        # the owner's confirmation is its own message: it may land just after to_here's
        r["confirmed"] = wait_until(theirs.confirmed_by_owner, 10)
        r["returned"] = rpc.rpc_sync("worker1", echo, args=(theirs,)).to_here().tolist()
        r["pickle"] = attempt(pickle.dumps, theirs)
        r["repr"] = repr(theirs)
    rpc.shutdown()
    return r


def _fetch(rref: rpc.RRef[torch.Tensor]) -> list[float]:
    return rref.to_here().tolist()


@pytest.fixture(scope="module")
def surface(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(2, _surface, tmp_path_factory.mktemp("surface"))[0]


def test_an_owner_rref_gives_its_value_locally(surface: dict[str, Any]) -> None:
    assert surface["local"] == (True, [0.0, 1.0, 2.0], [0.0, 1.0, 2.0], "worker0", True)
    assert surface["owner_to_user"] == [0.0, 1.0, 2.0]


def test_a_user_rref_refuses_local_value_and_names_the_owner(surface: dict[str, Any]) -> None:
    err = surface["user_local_value"]
    assert err["type"] == "StateError" and "'worker1'" in err["msg"] and "to_here" in err["msg"]


def test_rrefs_travel_as_results_and_are_confirmed(surface: dict[str, Any]) -> None:
    assert surface["confirmed"]
    assert surface["returned"] == [1.0, 1.0]
    assert surface["repr"].startswith("UserRRef(owner=worker1")


def test_pickling_an_rref_outside_rpc_is_refused(surface: dict[str, Any]) -> None:
    err = surface["pickle"]
    assert err["type"] == "StateError" and "cannot be pickled" in err["msg"], err
