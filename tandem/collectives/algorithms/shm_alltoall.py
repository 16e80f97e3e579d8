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
* the leader, once its host posted, swaps its host's table rows with the other leaders
  and writes the whole table after its own row; once it checked the table it sends each
  other host's block straight from the staged rows and its own input (one ``sendmsg``
  of the pieces), copies its own column out of its host's rows, and receives the other
  hosts' blocks straight into the arena for round 1: into its other half, then into
  what round 0 left free of its own half; a block that fits neither waits in scratch
  memory and follows in rounds 2..k, a staging half each;
* every other rank reads the table the leader wrote and checks it alike (the same error
  on every rank), then copies its column out of its host's rows and out of each round
  the leader posts: one kernel wait a round, no message.

Every rank posts once a round: the leader when it staged it, the others once they
have read the rounds before it. A half is written for round t only when every member has posted t
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
from tandem.collectives.algorithms.flat import copy_overlap
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
    leader = local[0]
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

    # the other hosts' blocks (pieces by source then destination) land in round 1: in
    # the leader's round-1 half, then in what its round-0 half leaves free after its
    # row, the table and its pieces (nobody reads there in this call); a block that fits
    # neither waits in scratch memory and follows in rounds of a staging half
    inner: dict[tuple[int, int], int] = {}  # a piece's offset in its block
    sizes = []
    for h in away:
        k = 0
        for s in h:
            for d in local:
                inner[(s, d)] = k
                k += counts[s][d] * size
        sizes.append(k)
    free = _up(start(leader) + sum(counts[leader][d] for d in targets(leader)) * size)
    room = {(base + 1) % 2: 0, base % 2: free}  # half: its first free byte
    place: list[tuple[int, int]] = []  # (half, offset), or (-1, offset in the spill)
    spill = 0
    for nb in sizes:
        half = next((f for f, used in room.items() if used + nb <= chunk), -1)
        if half < 0:
            place.append((-1, spill))
            spill += nb
        else:
            place.append((half, room[half]))
            room[half] += nb
    rounds = [(a, min(a + chunk, spill)) for a in range(0, spill, chunk)]
    outs[me].copy_(ins[me])

    if me != leader:
        arena.wait_all(base + 1, check)  # (the leader waited for them all: no wait)
        for s in local:
            if s != me:
                _raw(outs[s]).copy_(staged_piece(s, me))
        arena.wait_member(0, base + 2, check)  # (waited for the table already)
        for h, (half, at0) in zip(away, place):
            if half >= 0:
                data = arena.data(0, half)
                for s in h:
                    k = at0 + inner[(s, me)]
                    _raw(outs[s]).copy_(data[k:k + counts[s][me] * size])
        arena.post()  # done reading round 1 and round 0
        for i, (lo, hi) in enumerate(rounds):
            t = base + 2 + i
            arena.wait_member(0, t + 1, check)
            data = arena.data(0, t % 2)[:hi - lo]
            for h, (half, at0) in zip(away, place):
                if half < 0:
                    for s in h:
                        copy_overlap(_raw(outs[s]), at0 + inner[(s, me)], data, lo)
            arena.post()  # done reading round t - 1
        return True

    def staged_block(s: int, h: list[int]) -> list[memoryview]:
        """Rank ``s``'s pieces for host ``h``: one view where they lie together (another
        rank's staged row holds them in a row: a view cost 3.6 us, 64 pieces a block at 8x8)."""
        if s == me:
            return [as_bytes(ins[d]) for d in h]
        k = offsets[s][h[0]]
        nb = sum(counts[s][d] for d in h) * size
        return [as_bytes(arena.data(local.index(s), base % 2)[k:k + nb])]

    # the leader: each other host's block sent straight from the staged rows
    sends = [op.sendv(h[0], BLOCK_STEP, [v for s in local for v in staged_block(s, h)])
             for h in away]
    for s in local:
        if s != me:
            _raw(outs[s]).copy_(staged_piece(s, me))
    halves = {f: _mine(arena, f, used) for f, used in room.items()}
    scratch = arena.scratch(spill) if spill else halves[base % 2]
    boxes = [halves[half][at0:at0 + nb] if half >= 0 else scratch[at0:at0 + nb]
             for (half, at0), nb in zip(place, sizes)]
    got = [op.recv(h[0], BLOCK_STEP, as_bytes(box)) for h, box in zip(away, boxes)]
    # the rows stay put until every send is out: their ranks may not overwrite them before
    op.wait(*got, *sends)
    arena.post()  # round 1
    for h, box in zip(away, boxes):  # its own column, before a later round overwrites it
        for s in h:
            k = inner[(s, me)]
            _raw(outs[s]).copy_(box[k:k + counts[s][me] * size])
    for i, (lo, hi) in enumerate(rounds):
        t = base + 2 + i
        arena.wait_all(t, check)  # every member is done reading round t - 2
        dst = _mine(arena, t % 2, hi - lo)
        for (half, at0), box in zip(place, boxes):
            if half < 0:
                copy_overlap(dst, lo, box, at0)
        arena.post()
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
