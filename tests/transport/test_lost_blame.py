"""Whom a wait blames when a peer vanishes: the group's cause, if its news comes.

A rank that raised (a mismatch) tells every member why, then leaves. Its leaving may
be seen before its news, which can take another way (a relay through other hosts).
Every wait that finds a peer gone, by messages (``wait_all``) or in shared memory
(``shm_checks.arena_check``), then raises the group's abort when it comes within the
grace, and the loss itself only when nothing comes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tandem.collectives.algorithms.shm_checks import arena_check
from tandem.errors import CollectiveMismatchError, PeerLostError
from tandem.transport import Kind, LoopbackHub
from tandem.transport import wait

GROUP = 5


def _lost(t: Any, peer: int) -> None:
    t.mailbox.peer_lost(peer, PeerLostError(f"rank {peer} closed its connection", peer))


def _abort_later(t: Any, delay: float) -> threading.Thread:
    """The group's abort news, arriving ``delay`` seconds after the loss."""
    def arrive() -> None:
        time.sleep(delay)
        t.mailbox.abort_group(GROUP, CollectiveMismatchError(
            "[reported by rank 2] collective mismatch: rank 2 called broadcast root=2"))

    news = threading.Thread(target=arrive, daemon=True)
    news.start()
    return news


def _wait_on_rank_1(t: Any) -> None:
    slot = t.irecv(1, Kind.COLL, GROUP, 0, 0, memoryview(bytearray(4)))
    t.wait([slot], time.monotonic() + 30, lambda: "broadcast #0", [0, 1, 2])


def test_a_message_wait_reports_the_abort_that_follows_a_peers_exit() -> None:
    t = LoopbackHub(3).transports[0]
    _lost(t, 2)  # rank 2 raised the mismatch and left; its news is still on its way
    news = _abort_later(t, 0.2)
    with pytest.raises(CollectiveMismatchError, match="root=2"):
        _wait_on_rank_1(t)
    news.join(10)


def test_a_message_wait_still_names_a_peer_that_died_without_news() -> None:
    t = LoopbackHub(3).transports[0]
    _lost(t, 2)
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="rank 2 closed"):
        _wait_on_rank_1(t)
    assert time.monotonic() - start < wait.LOST_GRACE + 5  # the grace, not the deadline


class _Group:
    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.group_id = GROUP
        self.ranks = [0, 1, 2]
        self.group_rank = 0


class _Op:
    def __init__(self, transport: Any) -> None:
        self.group = _Group(transport)
        self.deadline = time.monotonic() + 30
        self.seq = 0
        self.sig = b"broadcast"

    def describe(self) -> str:
        return "broadcast #0"


class _Arena:
    """An arena where rank 1 posted and rank 2 did not (only what the check reads before
    it blames rank 2)."""
    index = 0
    target = 1
    matched_call: tuple[int, bytes] | None = None  # the members found in a call (none here)
    matched: set[int] = set()

    def lagging(self, target: int) -> list[int]:
        return [2]


def test_an_arena_wait_reports_the_abort_that_follows_a_peers_exit() -> None:
    t = LoopbackHub(3).transports[0]
    check = arena_check(_Op(t), _Arena())  # type: ignore[arg-type]
    _lost(t, 2)
    news = _abort_later(t, 0.2)
    with pytest.raises(CollectiveMismatchError, match="root=2"):
        check()
    news.join(10)


def test_an_arena_wait_reports_the_abort_that_follows_a_peers_goodbye() -> None:
    t = LoopbackHub(3).transports[0]
    check = arena_check(_Op(t), _Arena())  # type: ignore[arg-type]
    t.mailbox.failures.depart(2)  # its goodbye came, then its connection closed
    _lost(t, 2)
    news = _abort_later(t, 0.2)
    with pytest.raises(CollectiveMismatchError, match="root=2"):
        check()
    news.join(10)


def test_an_arena_wait_still_names_a_peer_that_died_without_news() -> None:
    t = LoopbackHub(3).transports[0]
    check = arena_check(_Op(t), _Arena())  # type: ignore[arg-type]
    _lost(t, 2)
    with pytest.raises(PeerLostError, match="rank 2 closed"):
        check()


class _Link:
    """A connection whose queued sends ``flush`` is asked to wait for."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.given = 0.0

    def flush(self, deadline: float) -> None:
        self.given = deadline - time.monotonic()


def test_a_rank_whose_group_failed_gives_its_news_longer_to_go_out_as_it_leaves() -> None:
    # its abort and goodbye cut off under load, peers would blame its exit instead
    hub = LoopbackHub(2)
    t = hub.transports[0]
    t.mailbox.abort_group(GROUP, CollectiveMismatchError("collective mismatch"))
    link = _Link(1)
    t._take_leave([link])  # type: ignore[list-item]
    assert link.given > 4.0, link.given


def test_a_rank_leaving_a_healthy_job_waits_for_its_sends_briefly() -> None:
    hub = LoopbackHub(2)
    t = hub.transports[0]
    link = _Link(1)
    t._take_leave([link])  # type: ignore[list-item]
    assert 0.0 < link.given <= 1.0, link.given
