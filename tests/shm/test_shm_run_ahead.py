"""A member that ran ahead with message-only calls is not a mismatch.

A gather's non-roots return without waiting for the root, so a rank can be many calls
further than its peer when the peer checks the shared-memory call before them. Each
member keeps its last few announcements only (``_arena._KEPT``): the peer then finds a
later call where this one was announced. That member passed this call's own check
(which compared the peer's announcement), so the peer must not call it a mismatch.
"""

from __future__ import annotations

from typing import Any

import pytest

from _shm_run_ahead_ranks import AHEAD, run_ahead
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]


def _values(outcomes: Any) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


@pytest.mark.parametrize("collective", ["all_gather_into_tensor", "reduce_scatter_tensor"])
def test_a_peer_many_calls_ahead_after_a_shared_memory_call_is_no_mismatch(
        collective: str) -> None:
    r0, r1 = _values(launch(2, run_ahead, (collective,), backend="shm", timeout=200))
    assert r0["shares"] and r1["shares"], "the group must share memory for this test"
    assert r0["first"] and r1["first"]
    assert r0["gathered"] == [[i, 100 + i] for i in range(AHEAD)]
