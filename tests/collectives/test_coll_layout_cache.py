"""A group's host layout is worked out once, not on every call.

``host_layout`` and ``spans_hosts`` are asked on every call across hosts, on every rank,
and each asks the transport for the host of every rank of the group: O(group size) per
call and rank, O(world^2) CPU per call over the job (at 64 ranks on 2 cores, a share of
a 4 KB broadcast's time). A rank's host never changes once the group exists, so each
group's answer is kept, and two groups never share one.
"""

from __future__ import annotations

from typing import Any

from tandem.collectives.algorithms._phases import host_layout
from tandem.collectives.group import spans_hosts


class _Transport:
    def __init__(self, hosts: str) -> None:
        self.hosts = hosts
        self.asked = 0

    def host_of(self, rank: int) -> str:
        self.asked += 1
        return "" if self.hosts[rank] == "?" else self.hosts[rank]


class _Group:
    def __init__(self, hosts: str) -> None:
        self.transport = _Transport(hosts)
        self.ranks = list(range(len(hosts)))


class _Unreferable:
    """A group-like object that cannot be weakly referenced (no cache: still right)."""

    __slots__ = ("transport", "ranks")

    def __init__(self, hosts: str) -> None:
        self.transport = _Transport(hosts)
        self.ranks = list(range(len(hosts)))


def test_the_layout_is_asked_of_the_transport_once_per_group() -> None:
    g: Any = _Group("aaaabbbb")
    for _ in range(100):
        assert host_layout(g) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert spans_hosts(g)
    # once for host_layout, once for spans_hosts: not once per call
    assert g.transport.asked == 2 * len(g.ranks), g.transport.asked


def test_each_group_keeps_its_own_answer() -> None:
    layouts = {"aabb": [[0, 1], [2, 3]], "abab": [[0, 2], [1, 3]], "aaaa": None,
               "abcd": None, "aa?b": None}
    groups: list[Any] = [_Group(h) for h in layouts]
    for _ in range(3):
        for g, (hosts, want) in zip(groups, layouts.items()):
            assert host_layout(g) == want, hosts
            assert spans_hosts(g) == (hosts in ("aabb", "abab", "abcd")), hosts


def test_a_group_that_cannot_be_weakly_referenced_is_answered_each_time() -> None:
    g: Any = _Unreferable("aabb")
    assert host_layout(g) == [[0, 1], [2, 3]] and spans_hosts(g)
    assert host_layout(g) == [[0, 1], [2, 3]] and spans_hosts(g)
    assert g.transport.asked == 4 * len(g.ranks)
