"""A barrier across hosts: each host checks in with its leader, the leaders meet, each
leader releases its host.

Every other rank of a host sends its leader (its lowest group rank) an empty message
and waits for an empty one back; the leaders run a dissemination barrier among
themselves (in round ``k`` leader ``i`` tells leader ``i + 2^k`` and hears from
``i - 2^k``, modulo their count: ``ceil(log2 hosts)`` rounds for any count) once their
host has checked in, then release their host. Only leaders send across hosts. Each
message carries the call's signature, so a rank that called something else meets a
receive of another call and the group fails with a mismatch, as with any message.

One hop each way within a host, where the hierarchical all-reduce of one byte took
three with 8 ranks a host, each a wake-up and a reduction (4 hosts x 8: 0.6x its time).

Where a host's ranks share memory they check in through the group's arena for that
host (:meth:`ProcessGroup.host_arena`, made at init for the default group) instead:
each other rank posts once, the leader waits for every post, checks the announcements
(the group announces every call there, so a mate in another call, one moving messages
only, is named at once), meets the other leaders and posts once, which releases them.
No message moves within the host, so the first barrier makes no ring and starts no
reader thread there.
"""

from __future__ import annotations

import torch

from tandem.collectives.algorithms._phases import host_layout, host_of_rank
from tandem.collectives.algorithms.shm_checks import prepare, verify
from tandem.collectives.algorithms.shm_spanning import host_shares_memory
from tandem.collectives.algorithms.doubling import doubling_all_reduce
from tandem.collectives.group import Op
from tandem.collectives.reduce_op import ReduceOp

__all__ = ["leaders_barrier"]

_CHECK_IN, _RELEASE = 0, 1  # the leaders' rounds are the steps after these


def leaders_barrier(op: Op, token: torch.Tensor, redop: ReduceOp) -> None:
    """Return once every rank of ``op``'s group has entered; ``token`` and ``redop``
    (a barrier's one byte and MAX) are unused: only the messages' arrival matters."""
    g = op.group
    layout = host_layout(g)
    if layout is None:  # chosen on a group where no two ranks share a host, or one host
        doubling_all_reduce(op, token, redop)
        return
    me = g.group_rank
    local = host_of_rank(layout, me)
    empty = memoryview(bytearray(0))
    leader = me == local[0]
    if host_shares_memory(g, local):
        ranks = [g.ranks[i] for i in local]
        # a leader may hold another leader's message of this call: its own, not a clash
        arena, check = prepare(op, g.host_arena(op, local), ranks, messages=leader)
        if not leader:
            arena.post()
            arena.wait_member(0, arena.posted, check)
            verify(op, arena, [0], ranks)
            return
        arena.wait_all(arena.posted + 1, check)  # every other rank of the host is in
        verify(op, arena, ranks=ranks)
        _leaders_meet(op, layout, me)
        arena.post()  # one post per rank per call, as every arena call keeps
        return
    if not leader:
        released = op.recv(local[0], _RELEASE, empty)
        op.wait(op.send(local[0], _CHECK_IN, empty), released)
        return
    op.wait(*[op.recv(r, _CHECK_IN, empty) for r in local[1:]])
    _leaders_meet(op, layout, me)
    op.wait(*[op.send(r, _RELEASE, empty) for r in local[1:]])


def _leaders_meet(op: Op, layout: list[list[int]], me: int) -> None:
    """The leaders' dissemination barrier (the module doc); ``me`` is one of them."""
    empty = memoryview(bytearray(0))
    leaders = [ranks[0] for ranks in layout]
    n, i = len(leaders), leaders.index(me)
    distance, step = 1, _RELEASE + 1
    while distance < n:
        heard = op.recv(leaders[(i - distance) % n], step, empty)
        op.wait(op.send(leaders[(i + distance) % n], step, empty), heard)
        distance <<= 1
        step += 1
