"""Two processes started with the same rank (a launcher bug, a copied RANK).

Without a check both wait for the rank nobody took and time out naming it as "never
started", which sends the user looking for a process that does not exist. The second
process to claim a rank is refused at once, and the first, when the job then fails to
form, is told that its rank was claimed twice.
"""

from __future__ import annotations

from typing import Any

import pytest

import tandem as dist
from _fault_helpers import attempt
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]

INIT_TIMEOUT = 6.0


def _join_as_rank_0(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    return attempt(dist.init_process_group, "tcp", init_method=f"file://{tmp}/store",
                   rank=0, world_size=world_size, timeout=INIT_TIMEOUT)


def test_a_rank_claimed_by_two_processes_is_named_on_both(tmp_path: Any) -> None:
    outcomes = launch(2, _join_as_rank_0, (str(tmp_path),), init=False, timeout=60,
                      env={"TANDEM_CONNECT_TIMEOUT": str(INIT_TIMEOUT)})
    results = [o.value for o in outcomes if o.ok]
    assert len(results) == 2, [o.error for o in outcomes]
    assert not any(r["ok"] for r in results), results
    assert all(r["type"] == "ArgumentError" for r in results), results
    second = [r for r in results if "rank 0 was given to two processes" in r["msg"]]
    assert len(second) == 1, results
    assert second[0]["elapsed"] < INIT_TIMEOUT / 2, second[0]  # refused at once
    first = [r for r in results if r is not second[0]][0]
    assert "rank 0 was claimed by 2 processes" in first["msg"], first["msg"]
