"""Barrier across hosts whose ranks share memory: each host checks in with its leader
through the default group's arena for that host, made at init, so the first barrier
makes no ring and no arena hand-over within a host (2 hosts x 8: rings and reader
threads made on first use took 0.36 s after init); it still holds every rank until the
last arrives, and a rank in another call is a mismatch. Real processes, hosts told
apart by ``TANDEM_HOST_ID``."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

import tandem
from tandem.collectives.world import world
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

HOSTS = "aaabbb"
OP_TIMEOUT = 60.0  # what a wait that misses the cause takes


def _init(rank: int, store: str) -> None:
    os.environ["TANDEM_HOST_ID"] = f"host-{HOSTS[rank]}"
    tandem.init_process_group("auto", init_method=f"file://{store}/tandem", rank=rank,
                              world_size=len(HOSTS), timeout=OP_TIMEOUT)


def _entering(key: str, rank: int) -> None:
    """Tell the rank that will come late to the call ``key`` names that this one is about
    to enter it."""
    world().scoped.set(f"{key}/{rank}", b"")


def _last_in(key: str, rank: int) -> None:
    """Return once every other rank said it is entering the call ``key`` names (an event,
    not a guessed sleep): they wait in it when this rank acts."""
    world().scoped.wait([f"{key}/{q}" for q in range(len(HOSTS)) if q != rank])


def _counted(rank: int, p: int, store: str) -> dict[str, Any]:
    from tandem.transport.shm import ShmTransport

    made: dict[str, Any] = {"rings": 0, "offers": 0, "held": []}
    ring, offer = ShmTransport._open_ring, ShmTransport._offer

    def open_ring(self: ShmTransport, *a: Any) -> Any:
        made["rings"] += 1
        return ring(self, *a)

    def offered(self: ShmTransport, *a: Any) -> Any:
        made["offers"] += 1
        return offer(self, *a)

    ShmTransport._open_ring = open_ring  # type: ignore[method-assign]
    ShmTransport._offer = offered  # type: ignore[method-assign]
    _init(rank, store)
    try:
        # the late rank: a non-leader of the first host, the last rank, a leader
        for late in (1, p - 1, 3):
            mark = os.path.join(store, f"late-{late}")
            if rank == late:
                _last_in(f"late-{late}", rank)  # the others are in the barrier: it must hold them
                open(mark, "w").close()
            else:
                _entering(f"late-{late}", rank)
            tandem.barrier()
            made["held"].append(os.path.exists(mark))
        return dict(made)  # before the goodbyes, which close() sends as records
    finally:
        tandem.destroy_process_group()


def test_the_first_barriers_make_no_ring_nor_hand_over_and_hold_every_rank(
        tmp_path: Any) -> None:
    outcomes = launch(len(HOSTS), _counted, (str(tmp_path),), init=False,
                      timeout=OP_TIMEOUT + 60)
    assert all(o.ok for o in outcomes), [o.error[-1500:] for o in outcomes if not o.ok]
    for o in outcomes:
        assert o.value["held"] == [True] * 3, (o.rank, o.value)
        # before: every non-leader made a ring to its leader and the leader one to each
        assert o.value["rings"] == 0 and o.value["offers"] == 0, (o.rank, o.value)


def _other_call(rank: int, p: int, store: str, odd: int) -> None:
    _init(rank, store)
    try:
        if rank == odd:
            tandem.all_reduce(torch.ones(4))
        else:
            tandem.barrier()
        tandem.barrier()  # a rank whose own call completed fails here
    finally:
        tandem.destroy_process_group()


@pytest.mark.parametrize("odd", [4, 3], ids=["non-leader", "leader"])
def test_a_rank_in_another_collective_is_a_mismatch(odd: int, tmp_path: Any) -> None:
    start = time.monotonic()
    outcomes = launch(len(HOSTS), _other_call, (str(tmp_path), odd), init=False,
                      timeout=OP_TIMEOUT + 60)
    assert not any(o.ok for o in outcomes), [o.rank for o in outcomes if o.ok]
    named = [o for o in outcomes if "CollectiveMismatchError" in o.error]
    assert named, [o.error[-800:] for o in outcomes]
    assert time.monotonic() - start < OP_TIMEOUT, "found only by the deadline"


def _killed(rank: int, p: int, store: str, victim: int) -> str:
    _init(rank, store)
    if rank == victim:
        _last_in("killed", rank)  # the others are waiting in the barrier
        os.kill(os.getpid(), 9)
    _entering("killed", rank)
    try:
        tandem.barrier()
    except Exception as exc:  # noqa: BLE001 - the survivor's account is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        tandem.destroy_process_group()
    return "passed"


@pytest.mark.parametrize("victim", [1, 3], ids=["non-leader", "leader"])
def test_a_killed_rank_fails_every_survivor_s_barrier_naming_it(victim: int,
                                                                 tmp_path: Any) -> None:
    """Survivors asleep in their host's arena (on the victim's host and on the other) and
    leaders waiting for each other all fail, naming the victim, well before the deadline."""
    start = time.monotonic()
    outcomes = launch(len(HOSTS), _killed, (str(tmp_path), victim), init=False,
                      timeout=OP_TIMEOUT + 60)
    for o in outcomes:
        if o.rank == victim:
            continue
        assert o.ok and o.value != "passed", (o.rank, o.value, o.error[-800:])
        assert f"rank {victim}" in o.value and "timed out" not in o.value, (o.rank, o.value)
    assert time.monotonic() - start < OP_TIMEOUT, "found only by the deadline"
