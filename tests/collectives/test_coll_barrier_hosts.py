"""Barrier across hosts: nobody leaves before the last rank arrives, each host's ranks
talk to their leader only, and a rank that called something else is a mismatch."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.testing import RankFailed, run_threads

from _coll_util import watch_collective_sends

pytestmark = pytest.mark.timeout(300)

LAYOUTS = ["aaaabbbb", "aaabbbcc", "aabbccddeeffgghh", "abab", "aaab"]


@pytest.mark.parametrize("hosts", LAYOUTS)
def test_no_rank_leaves_before_the_last_one_arrives(hosts: str) -> None:
    p = len(hosts)
    arrived = [0.0] * p
    late_entered = threading.Event()

    def body(group: ProcessGroup) -> list[bool]:
        r = group.rank()
        ok = []
        for late in (p - 1, 1, 0):  # a non-leader, a rank of the first host, a leader
            if r == late:
                # the others are inside by now (or soon): the barrier must hold them
                time.sleep(0.3)
                arrived[r] = time.monotonic()
                late_entered.set()
            tandem.barrier(group=group)
            ok.append(r == late or (late_entered.is_set() and time.monotonic() >= arrived[late]))
            tandem.barrier(group=group)  # the next round starts with the flag cleared
            if r == late:
                late_entered.clear()
            tandem.barrier(group=group)
        return ok

    results = run_threads(p, body, hosts=list(hosts), timeout=250, op_timeout=60)
    assert results == [[True] * 3] * p, results


def test_each_rank_talks_to_its_leader_and_only_leaders_cross_hosts() -> None:
    hosts = list("aaaabbbbcccc")

    def body(group: ProcessGroup) -> list[int]:
        peers: list[int] = []
        watch_collective_sends(group.transport, lambda peer, _h, _p: peers.append(peer))
        tandem.barrier(group=group)
        return peers

    sent = run_threads(len(hosts), body, hosts=hosts)
    leaders = {0, 4, 8}
    for rank, peers in enumerate(sent):
        if rank in leaders:
            # its host's 3 other ranks, and 2 rounds among 3 leaders
            assert sorted(peers) == sorted([rank + 1, rank + 2, rank + 3,
                                            (rank + 4) % 12, (rank + 8) % 12]), (rank, peers)
        else:
            assert peers == [rank - rank % 4], (rank, peers)  # one check-in, to its leader


def test_a_rank_in_another_collective_is_a_mismatch() -> None:
    hosts = list("aaabbb")

    def body(group: ProcessGroup) -> None:
        if group.rank() == 4:
            tandem.all_reduce(torch.ones(4), group=group)
        else:
            tandem.barrier(group=group)
        tandem.barrier(group=group)  # a rank whose own call completed fails here

    # found only by the deadline, the threads would run past 60 s
    with pytest.raises(RankFailed) as failed:
        run_threads(len(hosts), body, hosts=hosts, timeout=50, op_timeout=60)
    assert "CollectiveMismatchError" in str(failed.value)
