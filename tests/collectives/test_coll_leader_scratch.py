"""A host leader does not keep (ranks per host - 1) x the largest message after a
streamed all-reduce: its receive areas are kept only up to ``streamed._INBOX_KEEP``.

Before, the leader kept one receive area per other rank of its host in the group's
working memory for the group's lifetime (2 hosts x 8 ranks, 1 MB all-reduce: 7.9 MB on
each leader against 0.5 MB after).
"""

from __future__ import annotations

import importlib

import pytest
import torch

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.testing import run_threads

streamed = importlib.import_module("tandem.collectives.algorithms.streamed")

pytestmark = pytest.mark.timeout(300)

HOSTS = list("aaaabbbb")  # leaders: ranks 0 and 4
# every call here streams through the leaders: at least the ring threshold, and under the
# 16 of them from which a host of 4 ranks reduces among its own ranks first
STREAM = Settings(ring_threshold=256 << 10)


def _kept_after(numel: int) -> list[tuple[int, bool]]:
    def body(group: ProcessGroup) -> tuple[int, bool]:
        x = torch.full((numel,), float(group.rank() + 1))
        tandem.all_reduce(x, group=group)
        return group.scratch_kept(), bool(torch.all(x == sum(range(1, 9))))
    return run_threads(len(HOSTS), body, settings=STREAM, hosts=HOSTS, timeout=250,
                       op_timeout=200)


def test_a_leader_keeps_no_receive_areas_beyond_the_cap() -> None:
    numel = streamed._INBOX_KEEP // 4  # 3 other ranks x this message: 3 x the cap
    kept = _kept_after(numel)
    assert all(ok for _, ok in kept), "the all-reduce itself went wrong"
    for leader in (0, 4):
        # what stays is the leaders' ring's scratch: one other host's block, half the buffer
        assert kept[leader][0] <= numel * 4 // 2, f"leader {leader} kept {kept[leader][0]} B"


def test_small_receive_areas_are_still_kept() -> None:
    numel = 1 << 16  # 3 x 256 KB: under the cap, kept for the next call
    kept = _kept_after(numel)
    assert all(ok for _, ok in kept)
    assert kept[0][0] >= 3 * numel * 4
