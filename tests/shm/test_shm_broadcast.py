"""Broadcast through a host's staging arena at 16 ranks: the naive oracle's bytes, and
non-roots that wait for the root alone.

A non-root only reads the root's slots, after the root posted them, and the root
writes a slot only once every member read what it held before; a non-root that also
waited for every member at the start of each call made every member's post wake the
other readers (16 ranks on 2 cores, 4 KB: 1.3 ms per call before, 0.86 ms after).
"""

from __future__ import annotations

from typing import Any

import pytest

from _shm_bcast_ranks import CALLS, against_oracle, whom_readers_wait
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(600)]


def _values(outcomes: Any) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


def test_broadcast_at_16_ranks_matches_the_naive_oracle() -> None:
    results = _values(launch(16, against_oracle, backend="auto", timeout=500,
                             op_timeout=300))
    assert all(r["shares"] for r in results), "the group must share memory for this test"
    assert [r["wrong"] for r in results] == [[]] * 16, f"calls {CALLS} by index"
    assert all(r["sum"] for r in results)


def test_a_broadcast_non_root_waits_for_the_root_alone() -> None:
    results = _values(launch(4, whom_readers_wait, backend="shm", timeout=300))
    assert all(r["shares"] for r in results), "the group must share memory for this test"
    assert results[0]["asked"] == ["all"]  # the root waits for its readers
    for rank, r in enumerate(results[1:], 1):
        assert r["asked"] == ["0"], f"rank {rank} asked to wait for {r['asked']}"
