"""Every error names the rank that actually died or stalled, never a live bystander.

Four ranks over tcp (and shm). A SIGKILLed rank is named by every survivor, also by those that
learn of it from another survivor ("rank 0 died (reported by rank 1)"), even while
the survivors tear down and exit; a SIGSTOPped rank is the only one in the ``missing``
list of the ring's timeout, on every live rank.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, kill_self_at, values, warm_up
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(150)]

WORLD = 4


def _rank_0_killed(rank: int, world_size: int, stamp: str) -> Any:
    t = torch.ones(1 << 18)
    dist.barrier()
    if rank == 0:
        dist.all_reduce(t)
        kill_self_at(stamp)
    failure = attempt(lambda: [dist.all_reduce(t) for _ in range(100_000)])
    dist.destroy_process_group()  # survivors leave at once: their goodbyes race the news
    return failure


@pytest.mark.parametrize("backend,run", [("tcp", 0), ("tcp", 1), ("tcp", 2), ("shm", 0)])
def test_every_survivor_names_the_killed_rank_never_a_live_one(backend: str, run: int,
                                                               tmp_path: Any) -> None:
    stamp = str(tmp_path / "stamp")
    outcomes = launch(WORLD, _rank_0_killed, (stamp,), backend=backend, timeout=60,
                      op_timeout=60.0)
    for rank, r in values(outcomes, [1, 2, 3]).items():
        assert not r["ok"] and r["type"] == "PeerLostError", (rank, r)
        assert r["rank"] == 0, (rank, r)
        msg = r["msg"]
        for live in (1, 2, 3):
            # "rank 3 could not send to rank 0" blames rank 0: the subject is the sender
            assert not re.search(rf"rank {live} (closed|left|died)|could not send to rank {live}\b",
                                 msg), (rank, msg)
        if "reported by" in msg:
            assert re.search(r"rank 0 died \(reported by rank [123]\)", msg), (rank, msg)


def _ring_with_a_stopped_rank(rank: int, world_size: int) -> Any:
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    return attempt(dist.all_reduce, torch.ones(1 << 16))


def test_a_stopped_rank_is_the_only_one_missing_from_a_ring_timeout() -> None:
    warm_up()
    outcomes = launch(WORLD, _ring_with_a_stopped_rank, timeout=20, op_timeout=3.0,
                      env={"TANDEM_ALGORITHM": "ring"})
    for rank, r in values(outcomes, [0, 1, 3]).items():
        assert not r["ok"] and r["type"] == "CollectiveTimeoutError", (rank, r)
        assert r["missing"] == (2,), (rank, r["missing"], r["msg"])
