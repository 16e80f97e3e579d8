"""Broadcast across hosts through ``tandem.broadcast``: the naive oracle's bytes at 16
and 32 ranks on several host layouts, roots that disagree caught in the call, and the
root check carried up the data's own tree."""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.testing import RankFailed, run_threads

from _coll_util import watch_collective_sends

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {"2x8": "a" * 8 + "b" * 8, "4x8": "aaaaaaaabbbbbbbbccccccccdddddddd",
           "uneven": "aaabbbbbbbbbbbbc", "interleaved": "ab" * 8}


def _value(call: int, root: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 7 + call * 100 + root


@pytest.mark.parametrize("layout", LAYOUTS)
def test_broadcast_across_hosts_matches_the_naive_oracle(layout: str) -> None:
    hosts = list(LAYOUTS[layout])
    p = len(hosts)
    # 70,001 and 2^20 floats cross hosts in 2 and in 8 pieces (256 KiB links, at most 8)
    calls = [(1, 0), (1024, p - 1), (1024, 9), (70_001, 3), (1, 8), (1 << 20, 5)]

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


def _messages(hosts: list[str], root: int, numel: int = 8) -> list[tuple[int, int]]:
    """(sender, receiver) of every message of one broadcast of ``numel`` floats."""

    def body(group: ProcessGroup) -> list[tuple[int, int]]:
        me = group.transport.rank
        sent: list[tuple[int, int]] = []
        watch_collective_sends(group.transport, lambda peer, _h, _p: sent.append((me, peer)))
        tandem.broadcast(torch.ones(numel), src=root, group=group)
        return sent

    return [pair for sent in run_threads(len(hosts), body, hosts=hosts) for pair in sent]


def _messages_to(hosts: list[str], root: int, to: int) -> list[int]:
    """The ranks that sent rank ``to`` a message during one broadcast from ``root``."""
    return sorted(frm for frm, peer in _messages(hosts, root) if peer == to)


@pytest.mark.parametrize("hosts", ["abcdefgh", "aabbccddeeffgghh"])
def test_a_root_hears_from_its_tree_children_only(hosts: str) -> None:
    # the root check goes up the data's tree: the root no longer takes a confirmation
    # from every rank (flat) or every host's leader (across hosts), which made each
    # broadcast wait for a round trip to all of them
    assert _messages_to(list(hosts), 0, 0) == ([1, 2, 4] if len(hosts) == 8 else [1, 2, 4, 8])


def test_every_rank_sends_one_confirmation_and_the_data_to_its_children() -> None:
    hosts = list("aabbbccd")  # root 3 is not its host's leader: it hands the data to 2
    counts = {r: len(_messages_to(hosts, 3, r)) for r in range(len(hosts))}
    # 2: the root's data and the confirmations of 4 and of the leaders below it
    assert sum(counts.values()) == 2 * (len(hosts) - 1), counts
    assert counts[3] == 1 and counts[2] == 1 + 1 + 2, counts


def test_data_crosses_hosts_in_link_sized_pieces_and_a_host_in_one() -> None:
    pairs = _messages(list("aabb"), 0, numel=1 << 18)  # 1 MiB: four 256 KiB pieces
    # the leaders 0 -> 2 in pieces, each leader to its host's other rank in one message
    assert pairs.count((0, 2)) == 4 and pairs.count((0, 1)) == 1, pairs
    assert pairs.count((2, 3)) == 1, pairs
