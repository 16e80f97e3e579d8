"""A rank that finished and closed its group is not a crashed rank.

Rank 1 is the root of a broadcast over 4 ranks: it only sends, so it finishes first,
calls ``destroy_process_group`` and exits, while rank 0 still waits for the relay
from rank 3 (which joins 1 s late). Closing says goodbye first, so rank 0 finishes its
broadcast instead of reporting rank 1 as lost; a later call that needs rank 1 fails at
once, naming it as having left.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]


def _leave_early(rank: int, p: int) -> dict[str, Any]:
    t = torch.full((1000,), float(rank))
    if rank == 3:
        time.sleep(1.0)  # the relay for rank 0 in a binomial tree rooted at rank 1
    first = attempt(dist.broadcast, t, src=1)
    if rank == 1:
        dist.destroy_process_group()
        return {"first": first}
    later = attempt(dist.all_reduce, torch.ones(4))
    return {"first": first, "got": t[0].item(), "later": later}


@pytest.fixture(scope="module", params=["tcp", "shm"])
def leaving(request: Any) -> dict[int, Any]:
    return values(launch(4, _leave_early, timeout=60, op_timeout=20.0, backend=request.param),
                  [0, 1, 2, 3])


def test_a_rank_that_finished_and_left_does_not_fail_the_others(leaving: Any) -> None:
    for rank in (0, 2, 3):
        r = leaving[rank]
        assert r["first"]["ok"], f"rank {rank}: {r['first']}"
        assert r["got"] == 1.0, (rank, r["got"])


def test_a_later_call_that_needs_the_leaver_fails_at_once_naming_it(leaving: Any) -> None:
    for rank in (0, 2, 3):
        later = leaving[rank]["later"]
        assert not later["ok"] and later["type"] in ("PeerLostError", "StateError"), (rank, later)
        assert "rank 1" in later["msg"] and "left" in later["msg"], (rank, later["msg"])
        assert later["elapsed"] < 5.0, (rank, later)
