"""Reduce, gather, scatter and all-to-all across hosts through each host's leader.

For a group spanning hosts with several ranks on some host (``host_layout``), only
leaders (each host's lowest group rank) send across hosts, so a host needs connections
to the other hosts' leaders only: H-1 per host instead of one per pair of ranks. Within
a host messages go over shared memory (backend ``auto``).

* **reduce**: a binomial tree within each host onto its leader, a binomial tree among
  the leaders onto the leader of the root's host (``top``), then ``top`` to the root
  when the root is not a leader.
* **gather**: each rank to its leader, each leader its host's pieces to ``top``, ``top``
  everything to the root (when it is not ``top``), one message per piece, each passed
  on as it arrives.
* **scatter**: one message per host: the root sends each other host's pieces, packed
  in rank order, to that host's leader (through ``top`` when the root is not ``top``),
  which hands each of its ranks its piece as a view of that message (through the
  host's arena instead when its ranks share memory, :func:`~.shm_spanning.arena_scatter`).
* **all-to-all**: every rank sends its leader one message of its pieces for all other
  ranks (same host or not); the leader packs one message per other host (every piece
  from its host to that host, by source then destination rank) for that host's leader,
  and hands each of its ranks one message of every piece meant for it (through the
  host's arena instead when its ranks share memory, :func:`~.shm_alltoall.arena_all_to_all`).

The root checks of the rooted ones confirm up a two-level tree (:func:`check_tree`):
each host's ranks to its leader, each leader once its host confirmed, the root once
every rank did.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.collectives.algorithms._phases import PHASE, Phase, host_of_rank
from tandem.collectives.algorithms.roots import ROOT_STEP, confirm_up
from tandem.collectives.algorithms.tree import tree_reduce
from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import ReduceOp, finish

__all__ = ["leaders_reduce", "leaders_gather", "leaders_scatter", "leaders_all_to_all",
           "leaders_table", "rooted", "check_tree", "BLOCK_STEP", "TABLE_STEP"]

Layout = list[list[int]]

# steps of their own: the within-host and across-leaders trees of a reduce use 0 and PHASE
_UP = 2 * PHASE  # a rank to its leader, or top to the root
_ACROSS = 3 * PHASE  # leader to leader
# a scatter's or all-to-all's block to another host's leader (shm_spanning's, shm_alltoall's too)
BLOCK_STEP = _ACROSS
_DOWN = 4 * PHASE  # a leader to its ranks


def check_tree(layout: Layout, root: int, rank: int) -> tuple[int | None, list[int]]:
    """``rank``'s parent and children in a rooted call's root check: each host's other
    ranks confirm to the host's leader (its lowest rank), the other leaders to the
    leader of the root's host, and that one to the root (when it is not the root), so
    only leaders confirm across hosts, and only leaders wait for confirmations."""
    leaders = [ranks[0] for ranks in layout]
    local = host_of_rank(layout, rank)
    top = host_of_rank(layout, root)[0]  # the leader of the root's host
    if rank == root and root != top:
        return None, [top]
    if rank != local[0]:
        return local[0], []
    children = [r for r in local if r != rank and r != root]
    if rank != top:
        return top, children
    children = [e for e in leaders if e != top] + children
    return (root if root != top else None), children


def rooted(o: Op, root: int, layout: Layout, body: Callable[[], None],
           down: bool = False) -> None:
    """Run ``body`` inside the root check through the leaders: a leaf confirms at once;
    a leader confirms up once its children did, before its part of ``body`` (a child
    naming another root is then found before the leader waits for its data); the root
    waits for all at the end. ``down`` (data flows from the root, which sends whatever
    the check says): a leader passes its host's data on first, then waits for its
    children and confirms up, so that its ranks need not all run before it forwards."""
    parent, children = check_tree(layout, root, o.group.group_rank)
    empty = memoryview(bytearray(0))
    if parent is not None and not children:
        told = [o.send(parent, ROOT_STEP, empty)]
    else:
        told = [o.recv(c, ROOT_STEP, empty) for c in children]
        if parent is not None and not down:
            o.wait(*confirm_up(o, parent, told))
            told = []
    body()
    if parent is not None and children and down:
        told = confirm_up(o, parent, told)
    o.wait(*told)


def _order(layout: Layout) -> list[int]:
    """Group ranks host by host: the order of the packed buffers that cross hosts."""
    return [r for ranks in layout for r in ranks]


def leaders_reduce(o: Op, buf: torch.Tensor, root: int, redop: ReduceOp, layout: Layout) -> None:
    """Reduce flat ``buf`` onto ``root``; other ranks' ``buf`` stays unchanged."""
    me = o.group.group_rank
    local = host_of_rank(layout, me)
    leaders = [ranks[0] for ranks in layout]
    top = host_of_rank(layout, root)[0]
    # AVG sums throughout and divides once, by the whole group, on top
    inner = ReduceOp.SUM if redop.name == "AVG" and redop.fn is None else redop
    acc = buf if me == root else buf.clone() if me == local[0] else buf
    if len(local) > 1:
        tree_reduce(Phase(o, local, 0), acc, 0, inner)  # writes only into the leader's acc
    if me == local[0]:
        tree_reduce(Phase(o, leaders, PHASE), acc, leaders.index(top), inner)
        if me == top:
            finish(redop, acc, o.group.group_size)
            if root != top:
                o.wait(o.send(root, _UP, as_bytes(acc)))
    elif me == root:
        o.wait(o.recv(top, _UP, as_bytes(buf)))


def leaders_gather(o: Op, mine: torch.Tensor, outs: list[torch.Tensor] | None, root: int,
                   layout: Layout) -> None:
    """Piece by piece, each forwarded as it arrives (one message per rank, so a leader
    never waits for its whole host before sending, and the root receives straight into
    its list)."""
    me = o.group.group_rank
    local = host_of_rank(layout, me)
    top = host_of_rank(layout, root)[0]
    if me == root:
        assert outs is not None
        outs[me].copy_(mine)
    if me != local[0]:
        # a root too sends its piece up: a leader naming another root then holds a
        # message of this call with another signature, and raises
        sent = o.send(local[0], _UP, as_bytes(mine))
        if me == root:  # every other piece comes from top, straight into the list
            assert outs is not None
            o.wait(sent, *[o.recv(top, _DOWN + r, as_bytes(outs[r]))
                           for r in range(o.group.group_size) if r != me])
        else:
            o.wait(sent)
        return
    if me != top:
        pending = [(r, torch.empty_like(mine)) for r in local if r != me]
        recvs = [o.recv(r, _UP, as_bytes(t)) for r, t in pending]
        sends = [o.send(top, _ACROSS + me, as_bytes(mine))]
        for slot, (r, t) in zip(recvs, pending):
            o.wait(slot)
            sends.append(o.send(top, _ACROSS + r, as_bytes(t)))
        o.wait(*sends)
        return
    p = o.group.group_size
    # top: into the root's list when it is the root, else into pieces it passes on
    dst = outs if me == root else [torch.empty_like(mine) for _ in range(p)]
    assert dst is not None
    dst[me].copy_(mine)
    leader_of = {r: ranks[0] for ranks in layout for r in ranks}
    order = [r for r in _order(layout) if r != me]
    recvs = [o.recv(r, _UP, as_bytes(dst[r])) if leader_of[r] == me
             else o.recv(leader_of[r], _ACROSS + r, as_bytes(dst[r])) for r in order]
    if me == root:
        o.wait(*recvs)
        return
    sends = [o.send(root, _DOWN + me, as_bytes(dst[me]))]
    for slot, r in zip(recvs, order):
        o.wait(slot)
        if r != root:
            sends.append(o.send(root, _DOWN + r, as_bytes(dst[r])))
    o.wait(*sends)


def leaders_scatter(o: Op, recv: torch.Tensor, ins: list[torch.Tensor] | None, root: int,
                    layout: Layout) -> None:
    """One message per host: the root sends its own host's ranks their pieces and each
    other host's pieces, packed in rank order, to that host's leader (through top, its
    own host's leader, when the root is not top); a leader hands its ranks their pieces
    as views of what it received."""
    me = o.group.group_rank
    local = host_of_rank(layout, me)
    home = host_of_rank(layout, root)  # the root's host
    top = home[0]
    away = [ranks for ranks in layout if ranks is not home]
    n = recv.numel()
    if me == root:
        assert ins is not None
        recv.copy_(ins[me])
        sends = [o.send(r, _DOWN, as_bytes(ins[r])) for r in home if r != me]
        for h, ranks in enumerate(away):
            block = torch.cat([ins[r] for r in ranks])
            sends.append(o.send(ranks[0], _ACROSS, as_bytes(block)) if me == top
                         else o.send(top, _UP + h, as_bytes(block)))
        o.wait(*sends)
        return
    if local is home:
        if me != top:
            o.wait(o.recv(root, _DOWN, as_bytes(recv)))
            return
        # top, not the root: its own piece, and each other host's block passed on whole
        slots = [o.recv(root, _DOWN, as_bytes(recv))]
        blocks = [torch.empty(len(ranks) * n, dtype=recv.dtype) for ranks in away]
        recvs = [o.recv(root, _UP + h, as_bytes(b)) for h, b in enumerate(blocks)]
        for slot, ranks, b in zip(recvs, away, blocks):
            o.wait(slot)
            slots.append(o.send(ranks[0], _ACROSS, as_bytes(b)))
        o.wait(*slots)
        return
    if me != local[0]:
        o.wait(o.recv(local[0], _DOWN, as_bytes(recv)))
        return
    # a leader of another host: its host's block, each rank's piece a view of it
    block = torch.empty(len(local) * n, dtype=recv.dtype)
    o.wait(o.recv(top, _ACROSS, as_bytes(block)))
    pieces = block.split(n) if n else [block] * len(local)
    recv.copy_(pieces[0])
    o.wait(*[o.send(r, _DOWN, as_bytes(t)) for r, t in zip(local[1:], pieces[1:])])


# the all-to-all's table of sizes moves in steps of its own, before the data
_T_UP, _T_ACROSS, _T_DOWN = 5 * PHASE, 6 * PHASE, 7 * PHASE
TABLE_STEP = _T_ACROSS  # a host's rows of the table to another host's leader (shm_alltoall's too)


def leaders_table(o: Op, mine: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Every rank's ``mine`` (one small tensor each, all of one size), by group rank:
    to the leader, between every two leaders, back to the host's ranks."""
    g = o.group
    me, p, n = g.group_rank, g.group_size, mine.numel()
    local = host_of_rank(layout, me)
    order = _order(layout)
    full = torch.empty(p * n, dtype=mine.dtype)
    at = {r: i * n for i, r in enumerate(order)}
    rows = [full[at[r]:at[r] + n] for r in range(p)]
    rows[me].copy_(mine)
    if me != local[0]:
        o.wait(o.send(local[0], _T_UP, as_bytes(mine)), o.recv(local[0], _T_DOWN, as_bytes(full)))
        return rows
    o.wait(*[o.recv(r, _T_UP, as_bytes(rows[r])) for r in local if r != me])
    first, last = at[local[0]], at[local[-1]] + n
    block = full[first:last]  # this host's ranks are consecutive in ``order``
    slots = []
    for ranks in layout:
        if ranks is not local:
            a, b = at[ranks[0]], at[ranks[-1]] + n
            slots.append(o.recv(ranks[0], _T_ACROSS, as_bytes(full[a:b])))
            slots.append(o.send(ranks[0], _T_ACROSS, as_bytes(block)))
    o.wait(*slots)
    o.wait(*[o.send(r, _T_DOWN, as_bytes(full)) for r in local if r != me])
    return rows


def leaders_all_to_all(o: Op, outs: list[torch.Tensor], ins: list[torch.Tensor],
                       counts: list[list[int]], layout: Layout) -> None:
    """``outs[j]`` on rank ``i`` receives ``ins[i]`` of rank ``j``; ``counts[a][b]``: the
    elements rank ``a`` sends rank ``b`` (every rank's, as the split check agreed).

    A rank other than its host's leader sends the leader one message (its pieces for
    every other rank, on its host or not) and gets one back (every other rank's pieces
    for it): two messages a call instead of two per rank of its host."""
    me = o.group.group_rank
    local = host_of_rank(layout, me)
    leader = local[0]
    dtype = ins[me].dtype
    order = _order(layout)
    outs[me].copy_(ins[me])
    if me != leader:
        # every piece for another rank up to the leader, in ``order``; theirs back from it
        peers = [r for r in order if r != me]
        in_box = torch.empty(sum(counts[s][me] for s in peers), dtype=dtype)
        got = o.recv(leader, _DOWN, as_bytes(in_box))
        o.wait(o.send(leader, _UP, as_bytes(torch.cat([ins[d] for d in peers]))), got)
        _split_into(in_box, [outs[s] for s in peers])
        return
    away = [ranks for ranks in layout if ranks is not local]
    # from each other host: its ranks' pieces for this host's ranks, by source then destination
    inbound = [torch.empty(sum(counts[s][d] for s in ranks for d in local), dtype=dtype)
               for ranks in away]
    across = [o.recv(ranks[0], _ACROSS, as_bytes(box)) for ranks, box in zip(away, inbound)]
    # what each rank of this host sends every other rank, pieces in ``order``
    boxes = {r: torch.empty(sum(counts[r][d] for d in order if d != r), dtype=dtype)
             for r in local if r != me}
    o.wait(*[o.recv(r, _UP, as_bytes(box)) for r, box in boxes.items()])
    pieces: dict[tuple[int, int], torch.Tensor] = {(me, d): ins[d] for d in order}
    for r, box in boxes.items():
        pieces.update(_cut(box, [(r, d) for d in order if d != r], counts))
    sends = [o.send(ranks[0], _ACROSS, as_bytes(torch.cat([pieces[(s, d)] for s in local
                                                            for d in ranks])))
             for ranks in away]
    for slot, ranks, box in zip(across, away, inbound):
        o.wait(slot)
        pieces.update(_cut(box, [(s, d) for s in ranks for d in local], counts))
    for s in order:
        if s != me:
            outs[s].copy_(pieces[(s, me)])
    sends += [o.send(d, _DOWN, as_bytes(torch.cat([pieces[(s, d)] for s in order if s != d])))
              for d in local if d != me]
    o.wait(*sends)


def _cut(box: torch.Tensor, pairs: list[tuple[int, int]], counts: list[list[int]]
         ) -> dict[tuple[int, int], torch.Tensor]:
    """``box`` read as the pieces of ``pairs`` (source, destination), in that order."""
    at, out = 0, {}
    for s, d in pairs:
        out[(s, d)] = box[at:at + counts[s][d]]
        at += counts[s][d]
    return out


def _split_into(box: torch.Tensor, outs: list[torch.Tensor]) -> None:
    at = 0
    for t in outs:
        k = t.numel()
        t.copy_(box[at:at + k])
        at += k
