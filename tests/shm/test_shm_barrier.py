"""barrier on a group whose ranks share memory: a post of each member in the arena.

It stages nothing, combines nothing and makes no tensor, not even a view of the members'
staging (a forked rank's first tensor copies ~70 pages of torch's state; it was
an all-reduce of one byte: ``p - 1`` combines, a page of staging per half, and two views
of every member's staging made with the arena), still waits for the last member, and keeps
the staging halves' turns with the all-reduces around it.
"""

from __future__ import annotations

from typing import Any

import pytest

from _shm_one_round_ranks import barriers_between_calls
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]


@pytest.mark.parametrize("p", [2, 3])
def test_a_barrier_through_the_arena_stages_nothing_and_still_waits(p: int) -> None:
    outcomes: Any = launch(p, barriers_between_calls, backend="shm", timeout=150)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    got = [o.value for o in outcomes]
    for rank, r in enumerate(got):
        assert r["reserved"] == 0, f"rank {rank}: barriers reserved {r['reserved']} bytes"
        assert r["combined"] == 0, f"rank {rank}: barriers ran {r['combined']} combines"
        assert not r["viewed"], f"rank {rank}: barriers made views of every member's staging"
        assert r["tensors"] == 0, f"rank {rank}: barriers and init made {r['tensors']} tensors"
        assert not r["wrong"], f"rank {rank}: wrong all_reduce results in calls {r['wrong']}"
    for i in range(3):  # every rank left barrier i after its late member entered it
        late = got[i % p]["entered"][i // p]
        for rank, r in enumerate(got):
            assert r["left"][i] >= late, (
                f"rank {rank} left barrier {i} {late - r['left'][i]:.3f}s before rank "
                f"{i % p} entered it")
