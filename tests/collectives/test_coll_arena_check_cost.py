"""What a rank waiting in shared memory checks costs O(group size) only once a rank died.

``shm_checks.arena_check`` runs before every sleep in an arena wait, on every rank of a
host: it asked the transport about every rank of the group each time (64 lookups per
wait per rank at 64 ranks, so O(world^2) per call over the job), though no rank had
died. It now asks once whether any rank died (``Transport.check_group``), and reads the
group's ranks only then; a dead rank is still named. Here on a real (loopback)
transport, the group's ranks a list that counts its reads.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from tandem.collectives.algorithms.shm_checks import arena_check
from tandem.errors import PeerLostError
from tandem.transport import LoopbackHub


class _Counted(list[int]):
    """The group's ranks, counting how often a check reads them."""

    reads = 0

    def __iter__(self) -> Iterator[int]:
        self.reads += 1
        return super().__iter__()

    def __contains__(self, rank: object) -> bool:
        self.reads += 1
        return super().__contains__(rank)


def _check(dead: int | None = None) -> tuple[Any, _Counted]:
    transport = LoopbackHub(2).transports[0]
    if dead is not None:
        transport.mailbox.peer_lost(dead, PeerLostError(f"rank {dead} closed its connection",
                                                        dead))
    ranks = _Counted(range(64))
    group = SimpleNamespace(transport=transport, ranks=ranks, group_id=1)
    op = SimpleNamespace(group=group, deadline=time.monotonic() + 60, seq=0, sig=b"",
                         describe=lambda: "broadcast #0")
    arena = SimpleNamespace(lagging=lambda target: [], target=1, index=0)
    return arena_check(op, arena, list(range(8))), ranks  # type: ignore[arg-type]


def test_no_rank_died_no_rank_is_looked_up() -> None:
    check, ranks = _check()
    for _ in range(10):
        check()
    assert ranks.reads == 0, ranks.reads


def test_a_dead_rank_is_still_named() -> None:
    check, _ = _check(dead=37)
    with pytest.raises(PeerLostError, match="rank 37") as info:
        check()
    assert info.value.rank == 37
