"""What a rank waiting in shared memory checks costs O(group size) only once a rank died.

``shm_checks.arena_check`` runs before every sleep in an arena wait, on every rank of a
host: it asked the transport about every rank of the group each time (64 lookups per
wait per rank at 64 ranks, so O(world^2) per call over the job), though no rank had
died. It now asks once whether any rank died, and scans the group only then; a
dead rank is still named.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from tandem.collectives.algorithms.shm_checks import arena_check
from tandem.errors import PeerLostError


class _Transport:
    def __init__(self, dead: dict[int, PeerLostError]) -> None:
        self.dead = dead
        self.asked = 0

    def aborted(self, group: int) -> None:
        return None

    def lost(self, peer: int) -> PeerLostError | None:
        self.asked += 1
        return self.dead.get(peer)

    def lost_peers(self) -> dict[int, PeerLostError]:
        return dict(self.dead)

    def left(self, peer: int) -> None:
        return None

    def parked_call(self, group: int, seq: int) -> None:
        return None


def _check(dead: dict[int, PeerLostError]) -> tuple[Any, _Transport]:
    transport = _Transport(dead)
    group = SimpleNamespace(transport=transport, ranks=list(range(64)), group_id=1)
    op = SimpleNamespace(group=group, deadline=time.monotonic() + 60, seq=0,
                         describe=lambda: "broadcast #0")
    arena = SimpleNamespace(lagging=lambda target: [], target=1, index=0)
    return arena_check(op, arena, list(range(8))), transport  # type: ignore[arg-type]


def test_no_rank_died_no_rank_is_looked_up() -> None:
    check, transport = _check({})
    for _ in range(10):
        check()
    assert transport.asked == 0, transport.asked


def test_a_dead_rank_is_still_named() -> None:
    check, _ = _check({37: PeerLostError("rank 37 closed its connection", 37)})
    with pytest.raises(PeerLostError, match="rank 37") as info:
        check()
    assert info.value.rank == 37
