"""Whom a shared timeout blames (``tandem.transport.wait._verdict``), from the reports.

Every rank that times out tells its peers whom it waited on; a rank that reports is
alive. The verdict is what anyone waited on, less the ranks that reported, and never
nobody: where every rank waited on reported, one came late, and the timeout's names stand.
"""

from __future__ import annotations

from typing import Any

import pytest

from tandem.errors import CollectiveTimeoutError
from tandem.transport import wait
from tandem.transport.failures import Failures

GROUP = 7


class Mailbox:
    """What _verdict uses of a transport's mailbox: its rank, failures, and replies."""

    def __init__(self, rank: int, reports: dict[int, tuple[int, ...]]) -> None:
        self.rank = rank
        self.failures = Failures(rank)
        for reporter, missing in reports.items():
            self.failures.report(GROUP, reporter,
                                 CollectiveTimeoutError(f"rank {reporter} timed out", missing))
        self.sent: list[tuple[int, Any]] = []

    def reply(self, peers: list[int], group: int, error: Any) -> None:
        self.sent.extend((peer, error.missing) for peer in peers)


def verdict(rank: int, mine: set[int], cause: tuple[int, ...],
            reports: dict[int, tuple[int, ...]], peers: tuple[int, ...]) -> tuple[set[int], Any]:
    box = Mailbox(rank, reports)
    cause_error = CollectiveTimeoutError("cause", cause)
    got = wait._verdict(GROUP, mine, cause_error, box, peers,  # type: ignore[arg-type]
                        lambda: "all_reduce")
    return got, box.sent


@pytest.fixture(autouse=True)
def short_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wait, "TIMEOUT_GRACE", 0.05)


def test_a_ring_with_a_stopped_rank_blames_it_alone() -> None:
    # rank 2 stopped: 3 waits on 2, 0 on 3, 1 on 0; ranks 1 and 3 report to rank 0
    got, sent = verdict(0, {3}, (3,), {3: (2,), 1: (0,)}, (1, 2, 3))
    assert got == {2}
    assert sorted(peer for peer, _ in sent) == [1, 2, 3]  # rank 0 told every live peer


def test_a_rank_that_came_late_and_reported_is_still_named() -> None:
    # rank 1 entered the call after rank 0's deadline, before rank 0's report reached it:
    # it reports that it waits on rank 0, which timed out waiting on rank 1
    got, _ = verdict(0, {1}, (1,), {1: (0,)}, (1,))
    assert got == {1}


def test_the_late_rank_learns_it_was_the_one_waited_on() -> None:
    # on rank 1: it waits on rank 0, whose report (the cause) names rank 1
    got, _ = verdict(1, {0}, (1,), {0: (1,)}, (0,))
    assert got == {1}


def test_a_rank_that_never_reports_is_named() -> None:
    got, _ = verdict(0, {1}, (1,), {}, (1, 2))
    assert got == {1}
