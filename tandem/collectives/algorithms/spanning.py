"""Broadcast down a spanning tree, each rank confirming to its parent instead of the root.

:func:`broadcast_tree` gives each rank its parent and children: a binomial tree over a
flat group; across hosts, the root to its host's leader (its lowest rank), a binomial
tree among the hosts' leaders, then each leader straight to the other ranks of its
host (one hop: a large payload is read by each receiver from the leader's memory, in
parallel). Only leaders send across hosts, whichever rank the root is.

:func:`confirmed_broadcast` moves the data down that tree. The root check rides on the
tree too: every rank confirms to its parent with an empty message carrying its
signature (which names the root), a leaf when it enters the call, any other rank once
its children have confirmed to it (and it has passed the data on), so the root still
completes only when every rank named it. Each confirmation crosses one edge of the
tree: only leaders confirm across hosts, and a host's leader takes its host's ranks'
confirmations.

Within a host whose ranks share memory, :mod:`~.shm_spanning` replaces the messages
between a leader and its host's ranks with the host's own arena.

Ranks that disagree on the root meet a message with another signature: two ranks that
each believe they are the root, or that name each other, send each other data or a
confirmation that the other's receives clash with; a rank that names another root
than its parent's gets data it does not expect, or sends its confirmation to a rank
that expects none from it, or expects another call. A clash raises there and aborts
the group on every member, so the ranks waiting on it (the root waits on everyone,
through its children) fail in the call too. Across hosts the root returns once its
data is sent and its children's confirmations complete by the end of its next call
(:func:`~.roots.root_returns`).
"""

from __future__ import annotations

import torch

from tandem.collectives.algorithms._phases import host_of_rank
from tandem.collectives.algorithms.ring import link_chunk
from tandem.collectives.algorithms.roots import ROOT_STEP, confirm_up, root_returns
from tandem.collectives.algorithms.tree import binomial
from tandem.collectives.group import Op, as_bytes, spans_hosts
from tandem.transport.base import Slot

__all__ = ["broadcast_tree", "confirmed_broadcast", "cut"]


def broadcast_tree(layout: list[list[int]] | None, size: int, root: int,
                   rank: int) -> tuple[int | None, list[int]]:
    """``rank``'s parent (None on the root) and children in a broadcast from ``root``
    over a group of ``size`` ranks, on hosts as ``layout`` says (None: flat)."""
    if layout is None:
        return binomial(list(range(size)), root, rank)
    top = host_of_rank(layout, root)[0]  # the leader of the root's host
    if rank == root and root != top:
        return None, [top]
    local = host_of_rank(layout, rank)
    if rank != local[0]:
        return local[0], []
    parent, children = binomial([ranks[0] for ranks in layout], top, rank)
    if rank == top and root != top:
        parent = root
    # across hosts first, so the other hosts start while this one is served
    return parent, children + [r for r in local[1:] if r != root]


_MAX_PIECES = 8  # as the ring's: more posted messages per call set off long GC passes


def cut(view: memoryview, chunk: int | None) -> list[tuple[int, int]]:
    """The byte ranges ``view`` crosses a link in: pieces of ``chunk`` (at most eight),
    or whole when ``chunk`` is None (within a host)."""
    n = len(view)
    if chunk is None or n <= chunk:
        return [(0, n)]
    size = max(chunk, -(-n // _MAX_PIECES))
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def confirmed_broadcast(op: Op, buf: torch.Tensor, parent: int | None,
                        children: list[int]) -> None:
    """Broadcast flat ``buf`` down the tree given by this rank's ``parent`` (None on the
    root) and ``children``, with the confirmations of the module doc.

    Across hosts the data goes in link-sized pieces (``ring.link_chunk``), each passed on
    as it arrives, so the hops of the leaders' tree overlap; within a host in one message
    (a receiver reads it from the sender's memory, and one message is one wake-up)."""
    g = op.group
    empty = memoryview(bytearray(0))
    view = as_bytes(buf)
    chunk = link_chunk(g)
    host_of, ranks = g.transport.host_of, g.ranks
    mine = host_of(ranks[g.group_rank])

    def pieces_to(peer: int) -> list[tuple[int, int]]:
        return cut(view, None if host_of(ranks[peer]) == mine else chunk)

    if parent is not None and not children:  # a leaf: it names the root on entering
        got = [op.recv(parent, i, view[a:b]) for i, (a, b) in enumerate(pieces_to(parent))]
        op.wait(*got, op.send(parent, ROOT_STEP, empty))
        return
    told = [op.recv(c, ROOT_STEP, empty) for c in children]
    arriving = [(len(view), None)] if parent is None else [
        (b, op.recv(parent, i, view[a:b])) for i, (a, b) in enumerate(pieces_to(parent))]
    plans = [(c, pieces_to(c)) for c in children]
    sent: list[Slot] = []
    done = [0] * len(plans)  # pieces sent to each child so far
    for have, slot in arriving:
        if slot is not None:
            op.wait(slot)
        for k, (c, pieces) in enumerate(plans):
            while done[k] < len(pieces) and pieces[done[k]][1] <= have:
                a, b = pieces[done[k]]
                sent.append(op.send(c, done[k], view[a:b]))
                done[k] += 1
    if parent is not None:
        # for its whole subtree, once the data is on its way down
        told = confirm_up(op, parent, told)
    elif spans_hosts(g):  # the root's check across hosts: a round trip no later call overlaps
        root_returns(op, sent, told)
        return
    op.wait(*sent, *told)
