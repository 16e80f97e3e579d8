"""all_to_all across hosts with each host's part in its arena instead of messages.

Through the leaders (:func:`~.leaders.leaders_all_to_all`) every rank sent its leader
one message of its row and got one back, the split table the same way before: each
message a wake-up of a reader thread and then of the caller, and the leader copied its
host's rows into and out of messages. Where a host's ranks share memory
(:func:`~.shm_spanning.host_shares_memory`) they use the host's arena
(:meth:`ProcessGroup.host_arena`) instead; between hosts the leaders exchange the very
messages of the leaders' path (table blocks, then one data block per pair of hosts,
pieces by source then destination), so hosts of either kind mix. A call is 1 + k rounds:

* round 0: every rank stages its row of the split table and, when it fits the staging
  half, its pieces for the other ranks (by destination, hosts in layout order; the
  leader only those for its own host) and posts;
* the leader, once its host posted, exchanges its host's table block with the other
  leaders and checks the whole table; then packs each other host's block straight from
  the staged rows and its own input, sends it, copies its own column out of its host's
  rows, and stages the table and the blocks it received in rounds 1..k (what fits round
  1 is received straight into the arena);
* every other rank reads the table in round 1 and checks it alike (the same error on
  every rank), then copies its column out of its host's rows and out of each round the
  leader stages: one kernel wait a round, no message.

Every rank posts once a round: the leader when it staged it, the others once they read
the round before. A half is written for round t only when every member has posted t
times, the arena's rule (:class:`~tandem.transport.Arena`). When some row of the host
does not fit a staging half, the data goes by messages after the table
(:func:`~.leaders.leaders_all_to_all`); when some rank sends other hosts too much,
every rank sends straight to its peers (:func:`~.direct.pairwise_all_to_all`).
"""

from __future__ import annotations

from typing import Callable

import torch

from tandem.collectives.algorithms._phases import host_of_rank
from tandem.collectives.algorithms.direct import pairwise_all_to_all
from tandem.collectives.algorithms.leaders import BLOCK_STEP, TABLE_STEP, leaders_all_to_all
from tandem.collectives.algorithms.shm_checks import prepare, verify
from tandem.collectives.group import Op, as_bytes
from tandem.errors import CollectiveMismatchError
from tandem.transport import Arena
from tandem.transport.base import Slot

__all__ = ["arena_all_to_all"]

Counts = list[list[int]]
_ALIGN = 64  # the pieces start on cache lines, after the table


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return t.detach().reshape(-1).view(torch.uint8)


def arena_all_to_all(op: Op, outs: list[torch.Tensor], ins: list[torch.Tensor],
                     mine: torch.Tensor, check_table: Callable[[list[torch.Tensor]], Counts],
                     leaders_pay: Callable[[Counts], bool], layout: list[list[int]]) -> bool:
    """``outs[j]`` on rank ``i`` receives ``ins[i]`` of rank ``j`` (flat pieces of one
    dtype), as the module doc says. ``mine``: this rank's row of the split table (int64,
    as long on every rank); ``check_table``: every rank's row, by group rank, to the
    elements ``[sender][receiver]``, raising the same error on every rank when they
    disagree; ``leaders_pay``: whether those go through the leaders at all.

    Returns False, having moved nothing, when the whole table does not fit a staging
    half (the host's ranks all find so): the caller then takes the leaders' messages."""
    g = op.group
    me, p, n = g.group_rank, g.group_size, mine.numel()
    local = host_of_rank(layout, me)
    ranks = [g.ranks[i] for i in local]
    # other hosts' ranks may send this call's messages while this rank waits here
    arena, check = prepare(op, g.host_arena(op, local), ranks, messages=True)
    # every rank's row at 0 of its half; the leader's half holds the whole table after it
    row_bytes, table_bytes = _up(n * 8), _up(p * n * 8)
    if row_bytes + table_bytes > arena.chunk:
        return False
    arena.announce(op.seq, op.sig, op.site)
    index, leader = local.index(me), local[0]
    order = [r for h in layout for r in h]
    at = {r: i * n for i, r in enumerate(order)}  # each rank's row in the table
    away = [h for h in layout if h is not local]
    size = ins[me].element_size()
    base, chunk = arena.posted, arena.chunk

    def targets(s: int) -> list[int]:
        """Whose pieces rank ``s`` of this host stages in round 0, in that order."""
        return [d for d in (local if s == leader else order) if d != s]

    def start(s: int) -> int:
        """Where rank ``s``'s pieces start in its half."""
        return row_bytes + (table_bytes if s == leader else 0)

    # round 0: the table row and, when they fit, the pieces
    arena.wait_all(base, check)  # every member is done reading round base - 2
    staged = sum(ins[d].numel() for d in targets(me)) * size
    fits = start(me) + staged <= chunk
    own = _mine(arena, base % 2, start(me) + (staged if fits else 0))
    own[:n * 8].copy_(_raw(mine))
    if fits:
        end = start(me)
        for d in targets(me):
            piece = _raw(ins[d])
            own[end:end + piece.numel()].copy_(piece)
            end += piece.numel()
    arena.post()

    full = torch.empty(p * n, dtype=torch.int64)
    rows = [full[at[r]:at[r] + n] for r in range(p)]
    if me == leader:
        arena.wait_all(base + 1, check)
        verify(op, arena, ranks=ranks)
        first, last = at[local[0]], at[local[-1]] + n  # this host's rows lie together
        rows[me].copy_(mine)
        for q, r in enumerate(local[1:], 1):
            _raw(rows[r]).copy_(arena.data(q, base % 2)[:n * 8])
        slots: list[Slot] = []
        for h in away:
            a, b = at[h[0]], at[h[-1]] + n
            slots += [op.recv(h[0], TABLE_STEP, as_bytes(full[a:b])),
                      op.send(h[0], TABLE_STEP, as_bytes(full[first:last]))]
        op.wait(*slots)
        # for the host's ranks, who read it once round 1 is posted, whatever comes next
        own[row_bytes:row_bytes + p * n * 8].copy_(_raw(full))
        try:
            counts = check_table(rows)
        except CollectiveMismatchError:
            arena.post()  # the host's ranks raise the same error from the same table
            raise
    else:
        arena.wait_member(0, base + 2, check)  # the leader posted the table
        verify(op, arena, ranks=ranks)
        _raw(full).copy_(arena.data(0, base % 2)[row_bytes:row_bytes + p * n * 8])
        counts = check_table(rows)

    offsets = {s: _offsets(targets(s), counts[s], size, start(s)) for s in local}
    together = all(start(s) + sum(counts[s][d] for d in targets(s)) * size <= chunk
                   for s in local)
    if not leaders_pay(counts) or not together:
        arena.post()  # round 1: nothing staged, the table read
        if leaders_pay(counts):
            leaders_all_to_all(op, outs, ins, counts, layout)
        else:
            pairwise_all_to_all(op, outs, ins, {})
        return True

    def staged_piece(s: int, d: int) -> torch.Tensor:
        """Rank ``s``'s piece for ``d`` (``s`` on this host), where it lies now."""
        if s == me:
            return _raw(ins[d])
        k = offsets[s][d]
        return arena.data(local.index(s), base % 2)[k:k + counts[s][d] * size]

    # the blocks from the other hosts, one after another: pieces by source then destination
    stream: dict[tuple[int, int], int] = {}
    spans: list[tuple[int, int]] = []
    k = 0
    for h in away:
        a = k
        for s in h:
            for d in local:
                stream[(s, d)] = k
                k += counts[s][d] * size
        spans.append((a, k))
    rounds = [(a, min(a + chunk, k)) for a in range(0, k, chunk)] or [(0, 0)]
    outs[me].copy_(ins[me])

    if me != leader:
        arena.wait_all(base + 1, check)  # (the leader waited for them all: no wait)
        for s in local:
            if s != me:
                _raw(outs[s]).copy_(staged_piece(s, me))
        for i, (lo, hi) in enumerate(rounds):
            t = base + 1 + i
            if i:
                arena.wait_member(0, t + 1, check)
            data = arena.data(0, t % 2)[:hi - lo]
            for h in away:
                for s in h:
                    _overlap(stream[(s, me)], _raw(outs[s]), lo, data)
            arena.post()  # done reading round t - 1
        return True

    # the leader: each other host's block sent straight from the staged rows
    sends = [op.sendv(h[0], BLOCK_STEP, [as_bytes(staged_piece(s, d)) for s in local
                                          for d in h])
             for h in away]
    for s in local:
        if s != me:
            _raw(outs[s]).copy_(staged_piece(s, me))
    one = _mine(arena, (base + 1) % 2, rounds[0][1])
    # a block wholly in round 1 lands in the arena; the others wait in scratch memory
    spill = sum(b - a for a, b in spans if b > chunk)
    scratch = arena.scratch(spill) if spill else one
    boxes: list[tuple[int, torch.Tensor, bool]] = []  # (start, block, staged already)
    got: list[Slot] = []
    used = 0
    for h, (a, b) in zip(away, spans):
        there = b <= chunk
        box = one[a:b] if there else scratch[used:used + b - a]
        used += 0 if there else b - a
        boxes.append((a, box, there))
        got.append(op.recv(h[0], BLOCK_STEP, as_bytes(box)))
    # the rows stay put until every send is out: their ranks may not overwrite them before
    op.wait(*got, *sends)
    for i, (lo, hi) in enumerate(rounds):
        t = base + 1 + i
        if i:
            arena.wait_all(t, check)  # every member is done reading round t - 2
        dst = one if i == 0 else _mine(arena, t % 2, hi - lo)
        for a, box, there in boxes:
            if not there:
                _into(a, box, lo, dst[:hi - lo])
        arena.post()
        if i == 0:  # its own column, before round 3 overwrites round 1's half
            for h, (a, box, _) in zip(away, boxes):
                for s in h:
                    _overlap(stream[(s, me)], _raw(outs[s]), a, box)
    return True


def _mine(arena: Arena, half: int, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of this member's staging half ``half``, reserved."""
    return arena.heads(torch.uint8, nbytes)[half][arena.index]


def _offsets(targets: list[int], counts: list[int], size: int, start: int) -> dict[int, int]:
    """Where each target's piece starts in a row staged in ``targets`` order."""
    out, k = {}, start
    for d in targets:
        out[d] = k
        k += counts[d] * size
    return out


def _overlap(at: int, dst: torch.Tensor, lo: int, src: torch.Tensor) -> None:
    """The bytes of ``dst`` (a piece at ``at`` of a stream) that lie in ``src`` (the
    stream's bytes from ``lo`` on), copied into ``dst``."""
    a, b = max(at, lo), min(at + dst.numel(), lo + src.numel())
    if a < b:
        dst[a - at:b - at].copy_(src[a - lo:b - lo])


def _into(at: int, box: torch.Tensor, lo: int, dst: torch.Tensor) -> None:
    """The bytes of ``box`` (at ``at`` of a stream) that fall in ``dst`` (the stream
    from ``lo`` on), copied there."""
    a, b = max(at, lo), min(at + box.numel(), lo + dst.numel())
    if a < b:
        dst[a - lo:b - lo].copy_(box[a - at:b - at])
