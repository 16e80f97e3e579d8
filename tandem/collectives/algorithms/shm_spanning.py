"""Broadcast and scatter across hosts with each host's part in shared memory instead of
messages (scatter: :func:`arena_scatter`).

Across hosts the data takes :mod:`~.spanning`'s tree between the hosts' leaders (in
link-sized pieces, each passed on as it lands) and the root check climbs it as
messages; data that crosses in one piece goes from the root's host's leader straight
to every other leader, which confirms straight back. Within a host the ranks share an arena of their own
(:meth:`ProcessGroup.host_arena`): the host's *source* (the root on its own host, the
leader on the others) stages the data once per round and every other rank of the
host copies it straight out; the root's host's leader is one of those readers, and
passes what it read to the other leaders.

Every rank of the host posts once per round of the arena, whatever its part: a reader
on entering the round (so its first post says it is in this call, whose announcement
names the root, and that it is done reading the round before the previous one), the
source once it has staged the round. A source writes round ``t`` into staging half
``t % 2`` once every rank posted ``t`` times, so nobody still reads round ``t - 2``
there. A reader waits in the kernel for the source's post, one wake-up, where a
message woke a reader thread and then the caller, and its confirmation of the root
took another message to its leader.

The root check: the source waits until every rank of its host has posted round 0 of
this call and checks their announcements; a leader confirms to its parent (one empty
message) only once its host has passed that check and its child leaders confirmed to
it, and the root's host's leader, when it is not the root, confirms to the root. So
the root's check completes only when every rank named it, and a rank naming another
root meets an announcement or a message that clashes with its own in this call,
raises, and aborts the group on every member. The root itself returns once its data
is out (:func:`~.roots.root_returns`): the confirmations it still waits for complete
by the end of its next call on the group.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from tandem.collectives.algorithms._phases import host_of_rank
from tandem.collectives.algorithms.flat import copy_overlap
from tandem.collectives.algorithms.leaders import BLOCK_STEP
from tandem.collectives.algorithms.ring import link_chunk
from tandem.collectives.algorithms.roots import ROOT_STEP, confirm_up, root_returns
from tandem.collectives.algorithms.shm_checks import prepare, verify
from tandem.collectives.algorithms.shm_arrival import arrive_and_stage
from tandem.collectives.algorithms.spanning import cut
from tandem.collectives.algorithms.tree import binomial
from tandem.collectives.group import Op, as_bytes, host_shares_memory
from tandem.transport import Arena
from tandem.transport.base import Slot

__all__ = ["host_shares_memory", "arena_broadcast", "arena_scatter"]


def arena_broadcast(op: Op, buf: torch.Tensor, root: int, layout: list[list[int]]) -> None:
    """Broadcast flat ``buf`` from group rank ``root`` as the module doc says; every rank
    of this rank's host takes this path (:func:`host_shares_memory`)."""
    g = op.group
    me = g.group_rank
    local, ranks, arena, check = _enter_host(op, layout)
    index = local.index(me)
    src = local.index(root) if root in local else 0
    top = host_of_rank(layout, root)[0]
    empty = memoryview(bytearray(0))
    view = as_bytes(buf)
    raw = buf.detach().view(torch.uint8)
    n = len(view)

    parent: int | None = None  # whom this rank confirms to by message
    kids: list[int] = []  # the leaders this rank passes the data to
    pieces = cut(view, link_chunk(g))  # what crosses hosts
    if index == 0:
        leaders = [ranks_[0] for ranks_ in layout]
        if len(pieces) == 1:
            # one piece: straight to every leader, one hop down and one up where the
            # tree took log2(hosts) each, and each hop is two wake-ups
            parent, kids = (None, [q for q in leaders if q != me]) if me == top else (top, [])
        else:
            parent, kids = binomial(leaders, top, me)
        if me == top and root != top:
            parent = root  # it read the root's data in the arena
    told: list[Slot] = [op.recv(c, ROOT_STEP, empty) for c in kids]
    if me == root and root != top:
        told.append(op.recv(top, ROOT_STEP, empty))

    per = arena.chunk
    rounds = [(a, min(a + per, n)) for a in range(0, n, per)] or [(0, 0)]
    base = arena.posted
    sent: list[Slot] = []
    passed = 0  # pieces passed on to each child leader

    def pass_on(have: int) -> None:
        nonlocal passed
        while passed < len(pieces) and pieces[passed][1] <= have:
            a, b = pieces[passed]
            sent.extend(op.send(c, passed, view[a:b]) for c in kids)
            passed += 1

    staged = 0  # rounds staged
    confirmed = False  # this rank's confirmation went out
    received = me == root
    if index == src and me != root and parent is not None and not kids \
            and len(pieces) == 1 and len(rounds) == 1:
        # another host's leader taking one piece: the reader thread that receives it
        # stages it, and confirms when the host is all in, in the same wake-up
        done, confirmation = arrive_and_stage(op, arena, view, raw, parent)
        received = True
        staged = int(done)
        if confirmation is not None:
            told, confirmed = [confirmation], True
    if index == src:  # the root, or another host's leader: it stages every round
        arriving: list[tuple[int, Slot | None]] = [(n, None)] if received else [
            (b, op.recv(parent, i, view[a:b])) for i, (a, b) in enumerate(pieces)
            if parent is not None]
        for have, slot in arriving:
            if slot is not None:
                op.wait(slot)
            pass_on(have)
            while staged < len(rounds) and rounds[staged][1] <= have:
                a, b = rounds[staged]
                t = base + staged
                arena.wait_all(t, check)  # every rank read round t - 2 from this half
                arena.heads(torch.uint8, b - a)[t % 2][index].copy_(raw[a:b])
                arena.post()
                staged += 1
        if not confirmed:
            arena.wait_all(base + 1, check)  # every rank of the host is in this call
            verify(op, arena, ranks=ranks)
    else:
        for k, (a, b) in enumerate(rounds):
            t = base + k
            arena.post()
            arena.wait_member(src, t + 1, check)
            if k == 0:
                verify(op, arena, [src], ranks)
            raw[a:b].copy_(arena.data(src, t % 2)[:b - a])
            pass_on(b)
    if parent is not None and not confirmed:
        # for its whole subtree, once its host passed the check and the data is on its way
        told = confirm_up(op, parent, told)
    if me == root:
        root_returns(op, sent, told)
        return
    op.wait(*sent, *told)


def arena_scatter(op: Op, recv: torch.Tensor, ins: list[torch.Tensor] | None, root: int,
                  layout: list[list[int]]) -> None:
    """Scatter to flat ``recv`` from group rank ``root`` (``ins``: its flat pieces) with
    each host's hand-down in its arena: the host's source (the root on its host, the
    leader elsewhere, having received its host's block in one message) stages the
    host's pieces in rank order and each rank copies its own out. On the root's host,
    when the root is not its leader (top), the root stages every other host's block
    after them, and top reads those out and passes each on whole to its host's leader.
    The root check goes as :func:`arena_broadcast`'s: the source checks its host's
    announcements, another host's leader then confirms to top, and top, once all did,
    to the root; hosts of one rank take :func:`~.leaders.leaders_scatter` beside."""
    g = op.group
    me = g.group_rank
    local, ranks, arena, check = _enter_host(op, layout)
    index = local.index(me)
    home = host_of_rank(layout, root)
    top = home[0]
    away = [h for h in layout if h is not home]
    src = local.index(root) if local is home else 0
    w = recv.numel() * recv.element_size()  # bytes per rank
    mine = recv.detach().view(torch.uint8)
    carry = local is home and root != top  # the other hosts' blocks go through this arena
    n = w * (len(local) + (sum(len(h) for h in away) if carry else 0))
    empty = memoryview(bytearray(0))
    told: list[Slot] = ([op.recv(h[0], ROOT_STEP, empty) for h in away] if me == top
                        else [op.recv(top, ROOT_STEP, empty)] if me == root else [])
    sent: list[Slot] = []
    per = arena.chunk
    rounds = [(a, min(a + per, n)) for a in range(0, n, per)] or [(0, 0)]
    base = arena.posted

    if index == src:
        if me == root:
            assert ins is not None
            if me == top:  # each other host's block straight to its leader
                sent = [op.send(h[0], BLOCK_STEP, as_bytes(torch.cat([ins[r] for r in h])))
                        for h in away]
            staged = [ins[r].view(torch.uint8) for r in local]
            if carry:
                staged += [ins[r].view(torch.uint8) for h in away for r in h]
        else:
            block = torch.empty(n, dtype=torch.uint8)
            op.wait(op.recv(top, BLOCK_STEP, as_bytes(block)))
            staged = [block]
        for k, (a, b) in enumerate(rounds):
            t = base + k
            arena.wait_all(t, check)  # every rank read round t - 2 from this half
            _copy_range(staged, a, arena.heads(torch.uint8, b - a)[t % 2][index])
            arena.post()
        _copy_range(staged, index * w, mine)
        arena.wait_all(base + 1, check)  # every rank of the host is in this call
        verify(op, arena, ranks=ranks)
        if me != root:
            told = [op.send(top, ROOT_STEP, empty)]  # its host named the root
    else:
        # top, when the root is not: the other hosts' blocks, each passed on once read
        out = [(index * w, mine)]
        off = len(local) * w  # where the other hosts' blocks start
        blocks: list[tuple[int, int, int]] = []  # each block's bytes and its leader
        if me == top and carry:
            rest = torch.empty(n - off, dtype=torch.uint8)
            out.append((off, rest))
            at = 0
            for h in away:
                blocks.append((at, at + len(h) * w, h[0]))
                at += len(h) * w
        passed = 0
        for k, (a, b) in enumerate(rounds):
            t = base + k
            arena.post()
            arena.wait_member(src, t + 1, check)
            if k == 0:
                verify(op, arena, [src], ranks)
            data = arena.data(src, t % 2)[:b - a]
            for at, dst in out:
                copy_overlap(dst, at, data, a)
            while passed < len(blocks) and off + blocks[passed][1] <= b:
                lo, hi, leader = blocks[passed]
                sent.append(op.send(leader, BLOCK_STEP, as_bytes(rest[lo:hi])))
                passed += 1
        if me == top and carry:
            told = confirm_up(op, root, told)  # every other host named the root
    op.wait(*sent, *told)


def _enter_host(op: Op, layout: list[list[int]]
                ) -> tuple[list[int], list[int], Arena, Callable[[], None]]:
    """This rank's host: its group ranks, their global ranks, and its arena, set up for
    this call (with the check its waits run; the group announced the call there)."""
    g = op.group
    local = host_of_rank(layout, g.group_rank)
    ranks = [g.ranks[i] for i in local]
    arena, check = prepare(op, g.host_arena(op, local), ranks)
    return local, ranks, arena, check


def _copy_range(parts: list[torch.Tensor], a: int, dst: torch.Tensor) -> None:
    """Bytes ``a`` on of ``parts`` (flat uint8) laid end to end, as many as ``dst`` holds."""
    at = 0
    for t in parts:
        copy_overlap(dst, a, t, at)
        at += t.numel()
