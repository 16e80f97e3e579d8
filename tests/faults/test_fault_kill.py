"""A rank killed with SIGKILL is noticed by its sockets closing, not by the op timeout.

Every job here runs with a 60 s op timeout; the survivors must raise ``PeerLostError``
naming the dead rank within a few seconds of the kill.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, kill_self_at, read_stamp, values
from tandem.testing import launch, stay_until_reported

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]

OP_TIMEOUT = 60.0
NOTICED_WITHIN = 5.0  # seconds from the kill to the error; far below OP_TIMEOUT


def _killed_during_all_reduce(rank: int, world_size: int, mode: str, stamp: str) -> Any:
    t = torch.ones(1 << 20)  # 4 MiB: the pipelined ring, several chunks in flight
    dist.barrier()  # set-up is over on every rank before anyone dies
    if rank == 2:
        if mode == "before":
            kill_self_at(stamp)
        dist.all_reduce(t)  # one full round, so the mesh is busy when the kill lands
        timer = threading.Timer(0.2, kill_self_at, (stamp,))
        timer.daemon = True
        timer.start()
        while True:
            t.fill_(1.0)
            dist.all_reduce(t)
    done = 0

    def loop() -> None:
        nonlocal done
        for _ in range(100_000):
            t.fill_(1.0)
            dist.all_reduce(t)
            done += 1

    failure = attempt(loop)
    later = attempt(dist.all_reduce, torch.ones(4))  # the group is aborted: fails at once
    # stay up, so the other survivor's error is about rank 2, not about us
    stay_until_reported(os.path.dirname(stamp), rank, [0, 1])
    return {"failure": failure, "later": later, "done": done}


@pytest.fixture(scope="module", params=["before", "mid-loop"])
def killed_in_all_reduce(request: Any, tmp_path_factory: Any) -> tuple[Any, float, list[Any]]:
    stamp = str(tmp_path_factory.mktemp("kill") / "stamp")
    outcomes = launch(3, _killed_during_all_reduce, (request.param, stamp), timeout=40,
                      op_timeout=OP_TIMEOUT)
    return values(outcomes, [0, 1]), read_stamp(stamp), outcomes


def test_survivors_raise_peer_lost_naming_the_killed_rank(killed_in_all_reduce: Any) -> None:
    results, _, _ = killed_in_all_reduce
    for rank, r in results.items():
        f = r["failure"]
        assert not f["ok"], f"rank {rank} finished 100000 all_reduces with a dead peer"
        assert f["type"] == "PeerLostError", (rank, f)
        assert "rank 2" in f["msg"], (rank, f["msg"])


def test_death_is_noticed_within_seconds_not_at_the_op_timeout(killed_in_all_reduce: Any) -> None:
    results, killed_at, _ = killed_in_all_reduce
    for rank, r in results.items():
        latency = r["failure"]["at"] - killed_at
        assert latency < NOTICED_WITHIN, f"rank {rank} noticed the kill after {latency:.1f}s"


def test_group_fails_fast_after_a_peer_is_lost(killed_in_all_reduce: Any) -> None:
    results, _, _ = killed_in_all_reduce
    for rank, r in results.items():
        later = r["later"]
        assert not later["ok"] and later["type"] == "StateError", (rank, later)
        assert later["elapsed"] < NOTICED_WITHIN, (rank, later)
        assert "rank 2" in later["msg"], (rank, later["msg"])


def test_the_killed_rank_is_reported_as_dead_by_the_harness(killed_in_all_reduce: Any) -> None:
    _, _, outcomes = killed_in_all_reduce
    assert not outcomes[2].ok and outcomes[2].exitcode == -9, outcomes[2]


def _blocked_when_a_peer_dies(rank: int, world_size: int, stamp: str) -> Any:
    pair = dist.new_group([0, 2])  # rank 0's receive lives outside the default group
    t = torch.zeros(4)
    if rank == 2:
        time.sleep(1.0)  # ranks 0 and 1 are blocked by now
        kill_self_at(stamp)
    if rank == 0:
        result = attempt(dist.recv, t, src=2, group=pair)  # waits on the rank that dies
    else:  # rank 1 waits on rank 0 (alive, never in the all_reduce) while rank 2 dies
        result = attempt(dist.all_reduce, t)
    # rank 0 stays up: rank 1 must learn about rank 2, not about rank 0 leaving
    stay_until_reported(os.path.dirname(stamp), rank, [0, 1])
    return result


@pytest.fixture(scope="module")
def blocked(tmp_path_factory: Any) -> tuple[dict[int, Any], float]:
    stamp = str(tmp_path_factory.mktemp("blocked") / "stamp")
    outcomes = launch(3, _blocked_when_a_peer_dies, (stamp,), timeout=40, op_timeout=OP_TIMEOUT)
    return values(outcomes, [0, 1]), read_stamp(stamp)


def test_recv_from_a_killed_rank_raises_peer_lost(blocked: Any) -> None:
    results, killed_at = blocked
    r = results[0]
    assert not r["ok"] and r["type"] == "PeerLostError", r
    assert r["rank"] == 2 and "rank 2" in r["msg"], r
    assert r["at"] - killed_at < NOTICED_WITHIN, r


def test_rank_waiting_on_a_live_rank_notices_a_third_rank_dying(blocked: Any) -> None:
    results, killed_at = blocked
    r = results[1]
    assert not r["ok"] and r["type"] == "PeerLostError", r
    assert r["rank"] == 2 and "rank 2" in r["msg"] and "all_reduce" in r["msg"], r
    assert r["at"] - killed_at < NOTICED_WITHIN, r


def test_peer_lost_error_names_the_interrupted_operation(blocked: Any) -> None:
    results, _ = blocked
    assert "recv" in results[0]["msg"], results[0]["msg"]
