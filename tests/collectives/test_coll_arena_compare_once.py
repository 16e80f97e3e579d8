"""A rank waiting in shared memory compares each member with its call once per call.

``shm_checks.arena_check`` runs before every sleep and at every wake of an arena wait,
and ``verify`` after the call's first wait: each compared every member still lagging
with this call, at every wake (at 16 ranks a first barrier made 50 comparisons in 7
checks). A member found in this very call cannot be in another one later in it, so it
is compared once; one not there yet is compared at every wake, and a mismatch is found
at the first wake after the member announced it, as before. Here the arena is a stand-in
that counts its comparisons (``holds`` and ``announcement``) per member.
"""

from __future__ import annotations

import collections
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.collectives.algorithms.shm_checks import arena_check, verify
from tandem.errors import CollectiveMismatchError
from tandem.transport import LoopbackHub

SEQ, SIG, SITE = 5, b"barrier()", b"train.py:10"


class _Arena:
    """Four members (this rank is 0); ``calls[q]``: what member q announced for SEQ
    (None: nothing yet, it is in call SEQ - 1); ``posted``: members done waiting."""

    size, index, target = 4, 0, 1

    def __init__(self) -> None:
        self.calls: dict[int, bytes | None] = {1: SIG, 2: None, 3: SIG}
        self.seq = SEQ  # the call the entries are of
        self.posted: set[int] = set()
        self.compared: collections.Counter[int] = collections.Counter()
        self.matched_call: tuple[int, bytes] = (-1, b"")
        self.matched: set[int] = set()

    def lagging(self, target: int) -> list[int]:
        return [q for q in range(self.size) if q not in self.posted]

    def holds(self, member: int, seq: int, sig: bytes) -> bool:
        self.compared[member] += 1
        return seq == self.seq and self.calls[member] == sig

    def announcement(self, member: int, seq: int) -> tuple[int, bytes, bytes]:
        self.compared[member] += 1
        sig = self.calls[member]
        return (self.seq - 1, b"all_reduce()", SITE) if sig is None else (self.seq, sig, SITE)

    def latest(self, member: int) -> tuple[int, bytes, bytes]:
        return self.announcement(member, self.seq)


def _op() -> Any:
    transport = LoopbackHub(2).transports[0]
    group = SimpleNamespace(transport=transport, ranks=[0, 1, 2, 3], group_id=1,
                            group_rank=0, compare_previous=lambda op, members: None)
    return SimpleNamespace(group=group, deadline=time.monotonic() + 60, seq=SEQ, sig=SIG,
                           site=SITE, describe=lambda: f"barrier #{SEQ}")


def test_a_member_found_in_the_call_is_not_compared_again() -> None:
    op, arena = _op(), _Arena()
    check = arena_check(op, arena)  # type: ignore[arg-type]
    for _ in range(5):  # five wakes, member 2 not there yet
        check()
    assert arena.compared == {1: 1, 2: 10, 3: 1}, arena.compared  # 2: holds + announcement
    arena.calls[2] = SIG
    for _ in range(5):
        check()
    assert arena.compared == {1: 1, 2: 11, 3: 1}, arena.compared
    arena.posted = {1, 2, 3}
    verify(op, arena)  # type: ignore[arg-type]
    assert arena.compared == {1: 1, 2: 11, 3: 1}, arena.compared


def test_the_next_call_compares_afresh() -> None:
    op, arena = _op(), _Arena()
    arena_check(op, arena)()  # type: ignore[arg-type]
    arena.calls[1] = b"broadcast()"  # the members' entries for the next call
    op.seq = arena.seq = SEQ + 1
    with pytest.raises(CollectiveMismatchError, match="rank 1 called broadcast"):
        arena_check(op, arena)()  # type: ignore[arg-type]


def test_a_mismatch_is_found_at_the_first_wake_after_it_is_announced() -> None:
    op, arena = _op(), _Arena()
    check = arena_check(op, arena)  # type: ignore[arg-type]
    for _ in range(3):
        check()
    arena.calls[2] = b"all_gather()"
    with pytest.raises(CollectiveMismatchError, match="rank 2 called all_gather"):
        check()


def test_verify_finds_a_member_that_posted_from_another_call() -> None:
    op, arena = _op(), _Arena()
    check = arena_check(op, arena)  # type: ignore[arg-type]
    check()
    arena.posted = {1, 2, 3}  # member 2 posted, yet never announced this call
    with pytest.raises(CollectiveMismatchError, match="rank 2 called all_reduce"):
        verify(op, arena)  # type: ignore[arg-type]
