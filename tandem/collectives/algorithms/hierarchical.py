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
rank, and it runs over ``log2(hosts)`` rounds instead of ``log2(ranks)``. From
``TANDEM_RING_THRESHOLD`` bytes on, the three phases overlap instead, chunk by chunk
(``streamed.py``); from 16 times that, on a layout with three or more ranks on some
host, each host first reduces in a ring among its own ranks, so that its leader takes
in one piece per rank instead of every rank's whole buffer (:func:`two_level_pays`,
``streamed.two_level_all_reduce``). A broadcast goes root -> one rank per host -> the
rest of each host (``spanning.py``; within a host whose ranks share memory, through
that host's own arena, ``shm_spanning.py``).

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

from typing import Callable

import torch

from tandem.collectives.algorithms._phases import PHASE, Phase, host_layout, host_of_rank
from tandem.collectives.algorithms.doubling import doubling_all_reduce
from tandem.collectives.algorithms.ring import ring_all_reduce, ring_pays
from tandem.collectives.algorithms.shm_spanning import arena_broadcast, host_shares_memory
from tandem.collectives.algorithms.spanning import broadcast_tree, confirmed_broadcast
from tandem.collectives.algorithms.streamed import (streamed_all_reduce, streamed_fits,
                                                    two_level_all_reduce)
from tandem.collectives.algorithms.tree import tree_broadcast, tree_reduce
from tandem.collectives.group import Op
from tandem.collectives.reduce_op import ReduceOp, finish
from tandem.config import Settings

# a host of this many ranks or more reduces in a ring before its leader sends across,
# for buffers of at least this many ring thresholds (8 MiB by default): at 2 hosts x 4,
# 1 Gbit/s, 16 MB took 0.7x the time of the leader alone, and 1 MB took twice it
TWO_LEVEL_RANKS = 3
TWO_LEVEL_THRESHOLDS = 16

__all__ = ["host_layout", "hierarchical_all_reduce", "two_level_pays", "two_level_fits",
           "hierarchical_broadcast"]


def flat_all_reduce(settings: Settings, size: int,
                    buf: torch.Tensor) -> Callable[[Op, torch.Tensor, ReduceOp], None]:
    """Doubling or ring for ``size`` ranks, by the rule of ``select_all_reduce``."""
    return ring_all_reduce if ring_pays(settings, size, buf) else doubling_all_reduce


def two_level_pays(settings: Settings, layout: list[list[int]], buf: torch.Tensor) -> bool:
    """Whether an all-reduce of ``buf`` over ``layout`` takes :func:`two_level_all_reduce`."""
    return two_level_fits(settings, layout, buf.numel(), buf.numel() * buf.element_size())


def two_level_fits(settings: Settings, layout: list[list[int]], numel: int, nbytes: int) -> bool:
    """Whether a reduction of ``numel`` elements (``nbytes``) over ``layout`` reduces
    within each host in a ring first (all_reduce and reduce_scatter alike)."""
    busiest = max(len(ranks) for ranks in layout)
    return (busiest >= TWO_LEVEL_RANKS and numel >= busiest * len(layout)
            and nbytes >= TWO_LEVEL_THRESHOLDS * settings.ring_threshold)


def hierarchical_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp) -> None:
    """All-reduce flat ``buf`` in place: within hosts, across host leaders, back within hosts."""
    g = op.group
    layout = host_layout(g)
    if layout is None:  # chosen by name on a flat topology
        flat_all_reduce(g.settings, g.group_size, buf)(op, buf, redop)
        return
    nbytes = buf.numel() * buf.element_size()
    if two_level_pays(g.settings, layout, buf):
        two_level_all_reduce(op, buf, redop, layout)
        return
    if (nbytes >= g.settings.ring_threshold and buf.numel() >= len(layout)
            and streamed_fits(layout, nbytes)):
        # even with two leaders, whose flat all-reduce would still use doubling here:
        # streaming overlaps the phases (2x2 hosts at 1 Gbit/s, 1 and 4 MB: 11-15 ms
        # and 40-42 ms streamed, 14-18 ms and 46-51 ms in a row)
        streamed_all_reduce(op, buf, redop, layout)
        return
    # AVG sums throughout and divides once, by the whole group, on the leaders
    inner = ReduceOp.SUM if redop.name == "AVG" and redop.fn is None else redop
    local = host_of_rank(layout, g.group_rank)
    leaders = [ranks[0] for ranks in layout]
    if len(local) > 1:
        tree_reduce(Phase(op, local, 0), buf, 0, inner)
    if g.group_rank == local[0]:
        across = Phase(op, leaders, PHASE)
        flat_all_reduce(g.settings, len(leaders), buf)(across, buf, inner)
        finish(redop, buf, g.group_size)
    if len(local) > 1:
        tree_broadcast(Phase(op, local, 2 * PHASE), buf, 0)


def hierarchical_broadcast(op: Op, buf: torch.Tensor, root: int) -> None:
    """Broadcast flat ``buf`` from group rank ``root``: to its host's leader (its lowest
    rank), among the hosts' leaders, then from each leader to its host's other ranks,
    each rank confirming to its parent (:mod:`~.spanning`; a host whose ranks share
    memory does its part in its own arena, :mod:`~.shm_spanning`); a binomial tree when
    the hierarchical path does not apply.

    Only leaders send across hosts, whichever rank the root is, so a host needs
    connections to the other hosts' leaders only (a root that is not its host's leader
    costs one hop within its host).
    """
    g = op.group
    layout = host_layout(g)
    if layout is not None and host_shares_memory(g, host_of_rank(layout, g.group_rank)):
        # within hosts through shared memory: no message, nor reader thread, per rank
        arena_broadcast(op, buf, root, layout)
        return
    parent, children = broadcast_tree(layout, g.group_size, root, g.group_rank)
    confirmed_broadcast(op, buf, parent, children)
