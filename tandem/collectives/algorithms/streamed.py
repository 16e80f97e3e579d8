"""Hierarchical collectives for large buffers, streamed through one leader per host.

A group spanning hosts, some holding several of its ranks, runs a ring among the
hosts' *leaders* (the lowest group rank of each host), so that every host's link
carries the least bytes: one stream per host, as if each host were one rank. The
other ranks of a host talk to their leader only, and never wait for a whole-buffer
phase: the leaders' ring (:func:`ring` with its ``ready``/``done`` hooks) pulls each
chunk from them just before it first reads it and hands each chunk back the moment
it is final. So the link between hosts, the copies within a host and the reductions
overlap chunk by chunk.

* all-reduce: every rank sends its whole buffer up; the leader reduces it into its
  own, chunk by chunk; everyone gets the whole result back;
* reduce-scatter: the same going up; each rank gets back only its own piece, which
  lies in its host's block; from the two-level size on (``hierarchical.two_level_fits``)
  each host reduces in a ring among its own ranks first and each rank sends up only its
  reduced share (:func:`two_level_reduce_scatter`), as the two-level all-reduce does;
* all-gather: each rank sends its own piece up, into place; everyone gets the whole
  result back.

A rank sends everything up at once and posts every receive for what comes back, in
place (a chunk's result can only come back after its leader read the chunk). A
leader keeps one receive area per other rank of its host for the reductions (kept
for the next call up to ``_INBOX_KEEP`` bytes, else made for the call alone); when
that would exceed ``_STREAM_SCRATCH``, or a host's ranks are not consecutive (so its
block is not contiguous), ``select.py`` picks the flat ring instead. Reductions
combine in group-rank order within a host, the leaders' ring does the rest, and every
rank ends with the bytes the ring produced: bit-identical everywhere, and exact
inputs agree with the naive oracle bit for bit.
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.collectives.algorithms._phases import PHASE, Phase, host_of_rank
from tandem.collectives.algorithms.ring import Bounds, even_bounds, link_chunk, ring, ring_pieces
from tandem.collectives.group import Op, as_bytes
from tandem.collectives.reduce_op import ReduceOp, combine, finish
from tandem.transport.base import Slot

__all__ = ["streamed_all_reduce", "two_level_all_reduce", "streamed_fits", "host_blocks", "leaders_all_gather",
           "leaders_reduce_scatter", "two_level_reduce_scatter", "two_level_reduce"]

# the most memory a leader sets aside for its host's other ranks' contributions
_STREAM_SCRATCH = 1 << 30
# the most of those receive areas a leader keeps for its next call (larger ones are
# made per call), about what its host's other ranks keep: at 2 hosts x 8, 1 MB
# all-reduce, keeping 7 MB was no faster than making it per call (8.3 ms vs 8.2 ms)
_INBOX_KEEP = 2 << 20
Range = tuple[int, int]


def streamed_fits(layout: list[list[int]], nbytes: int) -> bool:
    """Whether a reduction of ``nbytes`` may stream (the leaders' receive areas fit)."""
    busiest = max(len(ranks) for ranks in layout)
    return (busiest - 1) * nbytes <= _STREAM_SCRATCH


def _inter(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _first_read(segments: list[list[Range]],
                leader: int) -> Callable[[tuple[int, Range]], tuple[int, int]]:
    """Sort key of ``(i, range)`` for piece ``i`` (numbered across ``segments``): when the
    leaders' ring, run by leader number ``leader``, first reads that piece.

    A reduction's ring reads segment ``leader - 1`` first (it sends it at once), then the
    segments it receives in turn: ``leader - 2``, ``leader - 3``, ... The host's other ranks
    send their pieces up in that order, so the leader's first send waits for one piece of
    theirs, not for every piece before it (at 2x2 hosts, 64 MB, the first host's leader
    waited for 32 MB of its neighbour's pieces, 13-18 ms, before anything crossed its link).
    An all-gather reads only the leader's own segment, which holds every piece sent up.
    """
    p = len(segments)
    when = [(leader - 1 - s) % p for s, segment in enumerate(segments) for _ in segment]
    return lambda item: (when[item[0]], item[0])


def _through_leaders(op: Op, buf: torch.Tensor, layout: list[list[int]], blocks: Bounds,
                     redop: ReduceOp | None, divide: ReduceOp | None, gather: bool,
                     up: Callable[[int], Range], down: Callable[[int], list[Range]],
                     reduce_up: bool = True, head: int = 0,
                     onward: Callable[[int, int], None] | None = None) -> None:
    """The leaders ring over ``blocks`` (one per host, in leader order) on flat ``buf``.

    Group rank ``m`` hands its leader ``buf[up(m)]`` (reduced into the leader's
    ``buf`` with ``redop``, or copied into place when ``redop`` is None) and gets
    ``buf[r]`` back once final, for each of the (at most two) ranges ``r`` in
    ``down(m)``. ``gather``: the ring's all-gather phase runs (every leader ends with
    every block); ``divide``: AVG's division by the group size, on the chunks a
    leader finishes. ``reduce_up=False``: the ranges sent up are disjoint and are copied
    into place; ``redop`` then serves the leaders' ring alone. ``head``: bytes at the
    start of the group's scratch that stay the caller's. ``onward(a, b)``: called on a
    leader for each chunk of its own block once final, after it was handed down.
    """
    g = op.group
    me = g.group_rank
    local = host_of_rank(layout, me)
    leaders = [ranks[0] for ranks in layout]
    size, n = buf.element_size(), buf.numel()
    # link-sized pieces, as the flat ring across hosts (at most eight per segment): at
    # 2x2 hosts, 1 Gbit/s, 1 MB, three runs alternating with 1 MiB pieces, all-reduce
    # took 10.2-11.0 ms against 10.5-11.7 and all-gather 19.9-20.9 against 20.9-21.8:
    # the first piece crosses sooner and the last one is handed down sooner
    chunk = link_chunk(g)
    segments = ring_pieces(g.settings, blocks, size, chunk)
    pieces = [piece for segment in segments for piece in segment]
    whole = as_bytes(buf)
    lift = Phase(op, local, 0)  # the host's other ranks -> its leader
    drop = Phase(op, local, 2 * PHASE)  # the leader -> the others

    def cut(rng: Range) -> list[tuple[int, Range]]:
        return [(i, part) for i, piece in enumerate(pieces) if (part := _inter(piece, rng))]

    def cuts(ranges: list[Range]) -> list[tuple[int, Range]]:
        # a piece may meet both ranges: each part is its own message, step 2 i + k
        return [(2 * i + k, part) for k, rng in enumerate(ranges) for i, part in cut(rng)]

    if me != local[0]:
        back = [drop.recv(0, i, whole[a * size:b * size]) for i, (a, b) in cuts(down(me))]
        ups = sorted(cut(up(me)), key=_first_read(segments, leaders.index(local[0])))
        lift.wait(*[lift.send(0, i, whole[a * size:b * size]) for i, (a, b) in ups], *back)
        return
    others = local[1:]
    reserved = head
    inbox = torch.empty(0, dtype=buf.dtype)
    lifted = redop if reduce_up else None  # what combines the pieces sent up
    if lifted is not None:  # one receive area per other rank, then the ring's scratch
        areas = len(others) * n * size
        if areas > _INBOX_KEEP:
            # (ranks per host - 1) x the message: a buffer of this call alone, so the
            # leader does not keep that much more than its host's other ranks
            inbox = torch.empty(len(others) * n, dtype=buf.dtype)
        else:
            reserved = head + -(-areas // 64) * 64
            longest = max(b - a for a, b in blocks)
            g.scratch(reserved + longest * size * (len(leaders) - 1), torch.uint8)  # sized once
            inbox = g.scratch(reserved, torch.uint8)[head:head + areas].view(buf.dtype)
    into = as_bytes(inbox) if lifted is not None else whole
    arrivals: list[list[tuple[int, Slot, Range]]] = [[] for _ in pieces]
    for j, m in enumerate(others):
        shift = j * n if lifted is not None else 0
        for i, (a, b) in cut(up(m)):
            slot = lift.recv(j + 1, i, into[(shift + a) * size:(shift + b) * size])
            arrivals[i].append((j, slot, (a, b)))
    index = {piece: i for i, piece in enumerate(pieces)}
    mine = blocks[leaders.index(me)]
    sends: list[Slot] = []

    def ready(a: int, b: int) -> None:
        for j, slot, (x, y) in arrivals[index[(a, b)]]:
            lift.wait(slot)
            if lifted is not None:  # lower group rank first
                combine(lifted, buf[x:y], inbox[j * n + x:j * n + y], buf[x:y])

    def done(a: int, b: int) -> None:
        if divide is not None and mine[0] <= a < mine[1]:  # the others get it divided
            finish(divide, buf[a:b], g.group_size)
        i = index[(a, b)]
        for j, m in enumerate(others, 1):
            for k, rng in enumerate(down(m)):
                part = _inter((a, b), rng)
                if part:
                    sends.append(drop.send(j, 2 * i + k, whole[part[0] * size:part[1] * size]))
        if onward is not None:
            onward(a, b)

    ring(Phase(op, leaders, PHASE, reserved), buf, blocks, redop, redop is not None, gather,
         ready, done, chunk)
    lift.wait(*sends)


def _sum_for(redop: ReduceOp) -> tuple[ReduceOp, ReduceOp | None]:
    """The op to combine with and the op that finishes (AVG sums, then divides once)."""
    if redop.name == "AVG" and redop.fn is None:
        return ReduceOp.SUM, redop
    return redop, None


def streamed_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp,
                        layout: list[list[int]]) -> None:
    """All-reduce flat ``buf`` in place through the leaders (needs :func:`streamed_fits`)."""
    whole = (0, buf.numel())
    inner, divide = _sum_for(redop)
    _through_leaders(op, buf, layout, even_bounds(buf.numel(), len(layout)), inner, divide,
                     True, lambda m: whole, lambda m: [whole])


# step ranges of the two-level all-reduce's phases within a host, past _through_leaders'
_SCATTER, _GATHER = 3 * PHASE, 4 * PHASE


def _reduce_within_host(op: Op, buf: torch.Tensor, layout: list[list[int]],
                        inner: ReduceOp, head: int = 0,
                        src: torch.Tensor | None = None) -> dict[int, Range]:
    """Ring reduce-scatter of flat ``buf`` among this rank's host; returns each group
    rank's piece (an even share of its host's), which that rank now holds reduced.
    ``head``: bytes at the start of the group's scratch that the ring leaves alone;
    ``src``: this rank's input, when not ``buf`` (see :func:`ring`)."""
    n = buf.numel()
    local = host_of_rank(layout, op.group.group_rank)
    own: dict[int, Range] = {}
    for ranks in layout:
        own.update(zip(ranks, even_bounds(n, len(ranks))))
    if len(local) > 1:
        ring(Phase(op, local, _SCATTER, head), buf, even_bounds(n, len(local)), inner, True,
             False, src=src)
    elif src is not None and src is not buf:
        buf.copy_(src)
    return own


def two_level_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp,
                         layout: list[list[int]]) -> None:
    """All-reduce flat ``buf`` in place: a ring reduce-scatter within each host, each
    rank's reduced piece up to its leader, the leaders' ring on the whole buffer (pulling
    those pieces as it reads them and handing each back once final), then a ring
    all-gather within each host.

    The leaders' link carries what :func:`streamed_all_reduce` sends, but a host's
    reductions and copies are spread over all its ranks instead of falling on its leader
    alone: at 2 hosts x 8 ranks, 16 MB, the leader waited 257 of its 368 ms for its
    host's pieces, with 7 x 16 MB to take in, reduce and hand back by itself.
    """
    n = buf.numel()
    local = host_of_rank(layout, op.group.group_rank)
    inner, divide = _sum_for(redop)
    own = _reduce_within_host(op, buf, layout, inner)
    mine = even_bounds(n, len(local))
    _through_leaders(op, buf, layout, even_bounds(n, len(layout)), inner, divide, True,
                     lambda m: own[m], lambda m: [own[m]], reduce_up=False)
    if len(local) > 1:
        ring(Phase(op, local, _GATHER), buf, mine, None, False, True)


def host_blocks(layout: list[list[int]] | None, bounds: Bounds) -> Bounds | None:
    """Each host's block of ``bounds`` (per group rank), if every block is contiguous."""
    if layout is None:
        return None
    blocks = []
    for ranks in layout:
        if ranks != list(range(ranks[0], ranks[-1] + 1)):
            return None
        blocks.append((bounds[ranks[0]][0], bounds[ranks[-1]][1]))
    return blocks


def leaders_all_gather(op: Op, flat: torch.Tensor, bounds: Bounds, layout: list[list[int]],
                       blocks: Bounds) -> None:
    """All-gather in place through the hosts' leaders (``blocks``: :func:`host_blocks`)."""
    end = flat.numel()
    # a rank gets back everything but its own piece (at 2x2 hosts, 64 MB each: a quarter
    # of the copies within a host)
    _through_leaders(op, flat, layout, blocks, None, None, True, lambda m: bounds[m],
                     lambda m: [(0, bounds[m][0]), (bounds[m][1], end)])


def leaders_reduce_scatter(op: Op, flat: torch.Tensor, bounds: Bounds, redop: ReduceOp,
                           layout: list[list[int]], blocks: Bounds) -> None:
    """Reduce-scatter in place through the hosts' leaders (needs :func:`streamed_fits`)."""
    everything = (0, flat.numel())
    inner, divide = _sum_for(redop)
    _through_leaders(op, flat, layout, blocks, inner, divide, False, lambda m: everything,
                     lambda m: [bounds[m]])


def two_level_reduce_scatter(op: Op, flat: torch.Tensor, bounds: Bounds, redop: ReduceOp,
                             layout: list[list[int]], blocks: Bounds) -> None:
    """Reduce-scatter in place: a ring reduce-scatter within each host, each rank's reduced
    piece copied up to its leader, the leaders' ring reduce-scatter over the hosts'
    ``blocks``, each rank's own piece handed back once final.

    A leader takes in one piece per rank (copied into place) instead of one whole buffer
    per other rank of its host to reduce by itself: no receive areas beyond the rings'
    scratch, and the host's reductions spread over all its ranks.
    """
    inner, divide = _sum_for(redop)
    own = _reduce_within_host(op, flat, layout, inner)
    _through_leaders(op, flat, layout, blocks, inner, divide, False, lambda m: own[m],
                     lambda m: [bounds[m]], reduce_up=False)


# step ranges of the two-level reduce: each leader's final block to the root's host's
# leader, and that leader's result to the root
_TO_TOP, _TO_ROOT = 5 * PHASE, 6 * PHASE


def two_level_reduce(op: Op, buf: torch.Tensor, root: int, redop: ReduceOp,
                     layout: list[list[int]]) -> None:
    """Reduce flat ``buf`` onto group rank ``root`` (other ranks' ``buf`` unchanged): a ring
    reduce-scatter within each host, each rank's reduced piece up to its leader, the
    leaders' ring reduce-scatter over one block per host, each leader's final block, chunk
    by chunk, to the leader of the root's host (``top``), and from it to the root.

    Every link carries about the message once (a binomial tree over all ranks sends it
    whole log2(ranks) times in a row), only leaders cross hosts, and every rank of a host
    shares its reductions. A rank other than the root reduces into the head of the
    group's scratch, the rings' scratch after it: under twice the message.
    """
    g = op.group
    me = g.group_rank
    n, size = buf.numel(), buf.element_size()
    local = host_of_rank(layout, me)
    leaders = [ranks[0] for ranks in layout]
    top = host_of_rank(layout, root)[0]
    inner, divide = _sum_for(redop)
    blocks = even_bounds(n, len(layout))
    # the leaders' ring cuts its blocks as _through_leaders does; piece i's owner: owners[i]
    segments = ring_pieces(g.settings, blocks, size, link_chunk(g))
    pieces = [piece for segment in segments for piece in segment]
    owners = [leaders[h] for h, segment in enumerate(segments) for _ in segment]
    index = {piece: i for i, piece in enumerate(pieces)}
    head = 0 if me == root else -(-n * size // 64) * 64
    rings = (len(local) - 1) * -(-n // len(local))
    if me == local[0]:
        rings = max(rings, (len(leaders) - 1) * -(-n // len(leaders)))
    space = g.scratch(head + rings * size, torch.uint8)  # sized once, for both rings
    # the rings write into what they reduce, never a non-root caller's tensor; the host's
    # ring reads the input and writes its reductions there, with no copy of it first
    acc = buf if me == root else space[:n * size].view(buf.dtype)
    own = _reduce_within_host(op, acc, layout, inner, head, src=buf)
    whole = as_bytes(acc)

    def part(i: int) -> memoryview:
        a, b = pieces[i]
        return whole[a * size:b * size]

    takes: list[tuple[int, Slot]] = []
    if me == root and me != top:
        takes = [(i, op.recv(top, _TO_ROOT + i, part(i))) for i in range(len(pieces))]
    elif me == top:  # the other leaders' blocks, into place
        takes = [(i, op.recv(owner, _TO_TOP + i, part(i)))
                 for i, owner in enumerate(owners) if owner != me]
    sends: list[Slot] = []

    def onward(a: int, b: int) -> None:
        i = index[(a, b)]
        if me != top:
            sends.append(op.send(top, _TO_TOP + i, part(i)))
        elif root != top:
            sends.append(op.send(root, _TO_ROOT + i, part(i)))

    _through_leaders(op, acc, layout, blocks, inner, divide, False, lambda m: own[m],
                     lambda m: [], reduce_up=False, head=head, onward=onward)
    if me == top and root != top:  # pass each block on as it arrives
        for i, slot in takes:
            op.wait(slot)
            sends.append(op.send(root, _TO_ROOT + i, part(i)))
    op.wait(*[slot for _, slot in takes], *sends)
