"""Broadcast across hosts through ``tandem.broadcast``: the naive oracle's bytes at 16
and 32 ranks on several host layouts, and roots that disagree caught in the call."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.collectives.group import ProcessGroup
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
