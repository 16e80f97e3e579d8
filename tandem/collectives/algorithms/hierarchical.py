"""Hierarchical all-reduce and broadcast: within each host first, then across hosts.

For a group whose ranks span several hosts with two or more of them on some host,
an all-reduce runs in three phases, each an existing algorithm on a subset of the
group:

1. every host reduces onto its *leader* (its lowest group rank) with a binomial tree
   (:func:`tree_reduce`), over shared memory when the backend is ``auto``;
2. the leaders, one per host, all-reduce among themselves with recursive doubling or
   the ring (the same size rule as the flat case);
3. every leader broadcasts the result within its host (:func:`tree_broadcast`).

Only phase 2 crosses hosts, with one message stream per host instead of one per
rank, and it runs over ``log2(hosts)`` rounds instead of ``log2(ranks)``. A
broadcast goes root -> one rank per host -> the rest of each host.

Host identity is ``group.transport.host_of(rank)``; when any rank's host is unknown
(``""``), or the group is on one host, or every rank is alone on its host, the
hierarchical path does not apply and the flat algorithms run instead.

Every rank ends with the leader's bytes, and the leaders' all-reduce gives every
leader the same bytes, so results are bit-identical on every rank. The order of
combination differs from the naive oracle's rank order, so floating-point sums of
inexact values agree with it only to rounding; exact inputs (and MIN, MAX and the
bitwise ops) agree bit for bit.
"""

from __future__ import annotations

from typing import Callable, cast

import torch

from tandem.collectives.algorithms.doubling import doubling_all_reduce
from tandem.collectives.algorithms.ring import ring_all_reduce
from tandem.collectives.algorithms.tree import tree_broadcast, tree_reduce
from tandem.collectives.group import Op, ProcessGroup
from tandem.collectives.reduce_op import ReduceOp, finish
from tandem.config import Settings
from tandem.transport.base import Slot

__all__ = ["host_layout", "hierarchical_all_reduce", "hierarchical_broadcast"]

# The phases of one call share its sequence number, so their step numbers live in
# disjoint ranges: a message that arrives early for a later phase is never taken for
# one of an earlier phase. Ring steps grow with the buffer (up to two per chunk):
# 2^28 steps need a 512 GiB buffer even at the smallest chunk (TANDEM_CHUNK_BYTES=4096).
_PHASE = 1 << 28


def host_layout(group: ProcessGroup) -> list[list[int]] | None:
    """The group ranks on each host, hosts ordered by their lowest group rank.

    None when the hierarchical path does not apply: some rank's host is unknown, all
    ranks share one host, or no two ranks share a host.
    """
    # runs on every auto-selected all-reduce: the common answers come from one list
    # and one set (2-3 us for 4-8 ranks on a 2-core EPYC, ~1% of a 4 KB all-reduce)
    host_of = group.transport.host_of
    hosts = [host_of(rank) for rank in group.ranks]
    distinct = set(hosts)
    if "" in distinct or len(distinct) == 1 or len(distinct) == len(hosts):
        return None
    by_host: dict[str, list[int]] = {}
    for i, host in enumerate(hosts):
        by_host.setdefault(host, []).append(i)
    return list(by_host.values())


def flat_all_reduce(settings: Settings, size: int,
                    buf: torch.Tensor) -> Callable[[Op, torch.Tensor, ReduceOp], None]:
    """Doubling or ring for ``size`` ranks, by the rule of ``select_all_reduce``."""
    threshold = settings.ring_threshold * (4 if size == 2 else 1)
    big = buf.numel() * buf.element_size() >= threshold and buf.numel() >= size
    return ring_all_reduce if big else doubling_all_reduce


class _Subset:
    """Some ranks of ``outer`` (its group ranks ``members``), numbered from 0 in that order.

    Exactly what :class:`Op` and the tree, doubling and ring algorithms read of a group
    (they address peers by group rank), so that on a :class:`_Phase` of this view they
    run among the members only. It is not a process group of its own (constructing one
    would set up per-group state such as shared staging memory): messages keep the
    outer group's id, and an attribute missing here fails loudly in the tests.
    """

    def __init__(self, outer: ProcessGroup, members: list[int]) -> None:
        self.outer = outer
        self.transport = outer.transport
        self.group_id = outer.group_id
        self.group_name = outer.group_name
        self.settings = outer.settings
        self.ranks = [outer.ranks[m] for m in members]
        self.group_rank = members.index(outer.group_rank)
        self.group_size = len(members)

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.outer.scratch(numel, dtype)  # one working buffer per group, as ever


class _Phase(Op):
    """One phase of ``outer`` among ``members``, its step numbers shifted by ``base``."""

    __slots__ = ("outer", "base")

    def __init__(self, outer: Op, members: list[int], base: int) -> None:
        view = cast(ProcessGroup, _Subset(outer.group, members))
        super().__init__(view, outer.name, outer.seq, outer.sig, outer.site)
        self.deadline = outer.deadline
        self.algorithm = outer.algorithm
        self.outer = outer
        self.base = base

    def send(self, to: int, step: int, view: memoryview) -> Slot:
        return super().send(to, self.base + step, view)

    def recv(self, frm: int, step: int, view: memoryview) -> Slot:
        return super().recv(frm, self.base + step, view)

    def describe(self) -> str:
        return self.outer.describe()  # errors name the user's call and the whole group


def _host_of_me(layout: list[list[int]], me: int) -> list[int]:
    return next(ranks for ranks in layout if me in ranks)


def hierarchical_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp) -> None:
    """All-reduce flat ``buf`` in place: within hosts, across host leaders, back within hosts."""
    g = op.group
    layout = host_layout(g)
    if layout is None:  # chosen by name on a flat topology
        flat_all_reduce(g.settings, g.group_size, buf)(op, buf, redop)
        return
    # AVG sums throughout and divides once, by the whole group, on the leaders
    inner = ReduceOp.SUM if redop.name == "AVG" and redop.fn is None else redop
    local = _host_of_me(layout, g.group_rank)
    leaders = [ranks[0] for ranks in layout]
    if len(local) > 1:
        tree_reduce(_Phase(op, local, 0), buf, 0, inner)
    if g.group_rank == local[0]:
        across = _Phase(op, leaders, _PHASE)
        flat_all_reduce(g.settings, len(leaders), buf)(across, buf, inner)
        finish(redop, buf, g.group_size)
    if len(local) > 1:
        tree_broadcast(_Phase(op, local, 2 * _PHASE), buf, 0)


def hierarchical_broadcast(op: Op, buf: torch.Tensor, root: int) -> None:
    """Broadcast flat ``buf`` from group rank ``root``: to one rank per host, then within hosts.

    The root stands for its own host; every other host is entered at its lowest rank.
    """
    g = op.group
    layout = host_layout(g)
    if layout is None:
        tree_broadcast(op, buf, root)
        return
    entry = [root if root in ranks else ranks[0] for ranks in layout]
    local = _host_of_me(layout, g.group_rank)
    me_entry = entry[layout.index(local)]
    if g.group_rank == me_entry:
        tree_broadcast(_Phase(op, entry, 0), buf, entry.index(root))
    if len(local) > 1:
        tree_broadcast(_Phase(op, local, _PHASE), buf, local.index(me_entry))
