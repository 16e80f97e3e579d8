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
from typing import Any, Iterator

import pytest

from tandem.collectives.algorithms.shm_checks import arena_check
from tandem.errors import PeerLostError
from tandem.transport import LoopbackHub


class _Ranks(list):  # type: ignore[type-arg]
    """A group's ranks that count how often a check walks them."""

    walked = 0

    def __iter__(self) -> Iterator[int]:
        self.walked += 1
        return super().__iter__()


def _check(dead: tuple[int, ...]) -> tuple[Any, _Ranks]:
    transport = LoopbackHub(2).transports[0]
    for peer in dead:
        transport.mailbox.peer_lost(peer, PeerLostError(f"rank {peer} closed its connection", peer))
    ranks = _Ranks(range(64))
    group = SimpleNamespace(transport=transport, ranks=ranks, group_id=1)
    op = SimpleNamespace(group=group, deadline=time.monotonic() + 60, seq=0, sig=b"",
                         describe=lambda: "broadcast #0")
    arena = SimpleNamespace(lagging=lambda target: [], target=1, index=0)
    return arena_check(op, arena, list(range(8))), ranks  # type: ignore[arg-type]


def test_no_rank_died_no_rank_is_looked_up() -> None:
    check, ranks = _check(())
    for _ in range(10):
        check()
    assert ranks.walked == 0, ranks.walked


def test_a_dead_rank_is_still_named() -> None:
    check, _ = _check((37,))
    with pytest.raises(PeerLostError, match="rank 37") as info:
        check()
    assert info.value.rank == 37
