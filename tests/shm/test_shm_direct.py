"""all_reduce of large tensors straight between the members' tensors (``shm_direct``).

Results are compared bit for bit with the reduction computed locally in member
order, for every dtype family and reduce op and odd sizes (chunks forced down to
4 KiB so slices end mid-chunk). The phases a call posts tell the paths apart: the
direct path posts twice per call, the staging path at least once per round. Pairs of
ranks take it only when told to (``MIN_MEMBERS``), as the bodies here do.
"""

from __future__ import annotations

from typing import Any

import pytest

from _shm_direct_ranks import every_dtype_and_op, large_default, mismatched_sizes, one_rank_may_not
from tandem.testing import launch
from tandem.transport import _cma

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180),
              pytest.mark.skipif(not _cma.available(), reason="no process_vm_readv here")]


def _values(outcomes: Any) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_dtype_and_op_matches_the_member_order_reduction(p: int) -> None:
    for rank, r in enumerate(_values(launch(p, every_dtype_and_op, backend="shm", timeout=170))):
        assert r["direct"] is True, f"rank {rank} of {p}: the members did not agree on it"
        assert r["posts"] == [2], f"rank {rank} of {p}: calls posted {r['posts']} phases"
        assert not r["wrong"], f"rank {rank} of {p}: wrong results for {r['wrong']}"


@pytest.mark.parametrize("p", [3, 4])
def test_a_large_tensor_takes_the_direct_path_with_the_shipped_settings(p: int) -> None:
    # 12 MB through staging rounds of at most 4 MiB would post at least 6 phases
    for rank, r in enumerate(_values(launch(p, large_default, backend="shm", timeout=120))):
        assert r == {"right": True, "posts": 2, "direct": True}, (rank, p, r)


def test_two_ranks_keep_the_staging_path_with_the_shipped_settings() -> None:
    for rank, r in enumerate(_values(launch(2, large_default, backend="shm", timeout=120))):
        assert r["right"] and r["direct"] is None and r["posts"] >= 6, (rank, r)


def test_one_member_without_cross_memory_access_keeps_everyone_on_the_staging_path() -> None:
    for rank, r in enumerate(_values(launch(3, one_rank_may_not, backend="shm", timeout=120))):
        assert r == {"right": True, "direct": False}, (rank, r)


def test_a_size_mismatch_is_caught_before_any_data_moves() -> None:
    for rank, r in enumerate(_values(launch(2, mismatched_sizes, backend="shm", timeout=120))):
        assert r["error"] is not None, f"rank {rank} did not raise"
        assert "mismatch" in r["error"] and r["untouched"], (rank, r)
