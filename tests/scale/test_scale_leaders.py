"""Across simulated hosts, every collective crosses hosts between host leaders only.

At 2x4 and 3x4 (``tandem.testing.netns``), one launch per layout runs each collective
(``_leader_ranks.battery``): against the oracle for every op x dtype it takes, and after
each the TCP connections to other hosts. The target: H-1 per host (its leader to the
other leaders); a collective that makes any other cross-host connection is named. Two
non-leaders' own send/recv across hosts still works (a direct connection).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

import _leader_ranks
from tandem.testing import launch
from tandem.testing.netns import Unavailable, netns_lab

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]

# elements: tiny, small, and one whose gather at 3x4 in float64 stays well below
# select.LEADERS_BELOW_BYTES; then LARGE, past it, where the pieces go straight
SIZES = [5, 1000, 9000]
LARGE = [70_000]
_runs: dict[str, list[dict[str, Any]]] = {}


def run(layout: str) -> list[dict[str, Any]]:
    if layout not in _runs:
        count, per_host = (int(x) for x in layout.split("x"))
        with tempfile.TemporaryDirectory(prefix="tandem-leaders-") as tmp:
            try:
                with netns_lab(count, Path(tmp)) as lab:
                    outcomes = launch(count * per_host, _leader_ranks.battery,
                                      (f"{tmp}/store", lab.names, lab.addrs, per_host, SIZES, LARGE),
                                      init=False, timeout=200)
            except Unavailable as exc:
                pytest.skip(f"simulated hosts are unavailable here: {exc}")
        bad = [o for o in outcomes if not o.ok]
        assert not bad, "\n".join(f"--- rank {o.rank} ({o.error_type}) ---\n{o.error[-3000:]}"
                                  for o in bad[:3])
        _runs[layout] = [o.value for o in outcomes]
    return _runs[layout]


LAYOUTS = ["2x4", "3x4"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_collective_matches_the_oracle_across_hosts(layout: str) -> None:
    wrong = {r: v["wrong"] for r, v in enumerate(run(layout)) if v["wrong"]}
    assert not wrong, wrong


@pytest.mark.parametrize("layout", LAYOUTS)
def test_collectives_connect_host_leaders_only(layout: str) -> None:
    count, per_host = (int(x) for x in layout.split("x"))
    values = run(layout)
    seen: set[tuple[int, int]] = set()
    blamed: dict[str, list[tuple[int, int]]] = {}
    for name in values[0]["links"]:
        if name == "large":  # straight to the peers by choice (select.LEADERS_BELOW_BYTES)
            break
        pairs = {(min(r, q), max(r, q)) for r, v in enumerate(values) for q in v["links"][name]}
        new = pairs - seen
        seen |= pairs
        off = sorted((a, b) for a, b in new if a % per_host or b % per_host)
        if off:
            blamed[name] = off
    assert not blamed, (f"{layout}: cross-host connections not between host leaders "
                        f"(ranks {per_host}k), by the collective that made them: {blamed}")
    per_host_count = [sum(1 for a, b in seen if h in (a // per_host, b // per_host))
                      for h in range(count)]
    assert max(per_host_count) <= count - 1, per_host_count
    assert min(per_host_count) == count - 1, per_host_count  # the count sees them
