"""Broadcast across hosts through ``tandem.broadcast``: the naive oracle's bytes at 16
and 32 ranks, a root check that reaches the root once per host, and roots that
disagree still caught in the call.

A broadcast root waits for every other rank to confirm it (``algorithms.roots``).
Across hosts those confirmations go through each host's entry rank, so the root hears
from its own host's other ranks and one rank per other host: 14 at 8 hosts x 8, not
63 (2 hosts x 8 ranks on 2 cores: the root's CPU per 4 KB call 280-760 us before,
380-470 us after).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tandem
from tandem.collectives.algorithms import roots
from tandem.collectives.group import Op, ProcessGroup
from tandem.testing import RankFailed, run_threads

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {"2x8": "a" * 8 + "b" * 8, "4x8": "aaaaaaaabbbbbbbbccccccccdddddddd",
           "uneven": "aaabbbbbbbbbbbbc", "interleaved": "ab" * 8}


def _value(call: int, root: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 7 + call * 100 + root


@pytest.mark.parametrize("layout", LAYOUTS)
def test_broadcast_across_hosts_matches_the_naive_oracle(layout: str) -> None:
    hosts = list(LAYOUTS[layout])
    p = len(hosts)
    calls = [(1, 0), (1024, p - 1), (1024, 9), (70_001, 3), (1, 8)]

    def body(group: ProcessGroup) -> list[bool]:
        same = []
        for call, (n, root) in enumerate(calls):
            t = _value(call, root, n) if group.rank() == root else torch.zeros(n)
            tandem.broadcast(t, src=root, group=group)
            same.append(torch.equal(t, _value(call, root, n)))  # naive: the root's bytes
        return same

    results = run_threads(p, body, hosts=hosts, timeout=250, op_timeout=120)
    assert results == [[True] * len(calls)] * p


def test_the_root_hears_one_confirmation_per_other_host() -> None:
    hosts = list(LAYOUTS["4x8"])
    heard: dict[int, int] = {}
    recv = Op.recv

    def counting(self: Op, frm: int, step: int, view: memoryview) -> Any:
        if step == roots.ROOT_STEP:
            heard[self.group.group_rank] = heard.get(self.group.group_rank, 0) + 1
        return recv(self, frm, step, view)

    def body(group: ProcessGroup) -> None:
        tandem.broadcast(torch.ones(16), src=10, group=group)

    Op.recv = counting  # type: ignore[method-assign]
    try:
        run_threads(len(hosts), body, hosts=hosts, timeout=250, op_timeout=120)
    finally:
        Op.recv = recv  # type: ignore[method-assign]
    # the root (host b): its host's 7 others and the entries of hosts a, c, d
    assert heard[10] == 7 + 3
    # each other host's entry (its lowest rank) hears its host's 7 others
    assert {r: heard.get(r) for r in (0, 16, 24)} == {0: 7, 16: 7, 24: 7}
    assert sum(heard.values()) == len(hosts) - 1


@pytest.mark.parametrize("roots_of", ["each-its-own", "two-camps", "one-host-disagrees"])
def test_roots_that_disagree_across_hosts_fail_fast(roots_of: str) -> None:
    hosts = list("aaabbbcc")

    def body(group: ProcessGroup) -> None:
        r = group.rank()
        src = {"each-its-own": r, "two-camps": 0 if r < 4 else 4,
               "one-host-disagrees": 6 if hosts[r] == "c" else 0}[roots_of]
        tandem.broadcast(torch.full((4,), float(r)), src=src, group=group)
        tandem.barrier(group=group)  # a rank whose own call completed fails here

    # a disagreement found only by the deadline would leave the threads running 60 s
    with pytest.raises(RankFailed) as failed:
        run_threads(len(hosts), body, hosts=hosts, timeout=50, op_timeout=60)
    assert "CollectiveMismatchError" in str(failed.value)
