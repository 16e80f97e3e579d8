"""Collectives through shared staging memory: ranks read each other's memory directly.

Same-host groups get an :class:`~tandem.transport.Arena` at their first
call: every member maps every member's staging segment. A tensor streams through
it in rounds of at most ``arena.chunk`` bytes, so no segment is tensor-sized.

All-reduce, one round (``m`` elements, cut into one slice per member)::

    1. copy my input's *other* slices into my staging;        post, wait for all
    2. reduce my slice: my input's slice combined with every
       peer's staging slice, into my staging slice;            post, wait for all
    3. copy every member's reduced slice out of its staging into my tensor

Every byte of input is read once and every byte of output written once; the
staging stays in cache. Small tensors (``SMALL_BYTES`` or less) and pairs of ranks skip the
second wait: each member copies its whole round in and reduces all of it itself.

Broadcast and reduce (one root) are in ``shm_rooted``. All-gather: each
member stages its input, everyone copies every member's piece out. Reduce-scatter:
each member stages its pieces for the others and reduces its own from theirs.
Combines run in member order on every rank, so results are bit-identical
everywhere (and equal to the naive algorithm's).

Mismatches: a call moving no messages cannot rely on the mailbox's signature check,
so each member announces every call in its segment (``ProcessGroup`` does), and
after the first wait of a call every member compares every peer's announcement of
this call number with its own; a peer that is in some other call, through shared
memory or messages, is found by the same comparison while waiting (``check``).
Waits end early when the group is aborted or a member dies, and at the deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, Sequence

import torch

from tandem.collectives.algorithms.ring import even_bounds
from tandem.collectives.group import Op
from tandem.collectives.reduce_op import Combine, ReduceOp, combiner, finish
from tandem.errors import CollectiveMismatchError, CollectiveTimeoutError, PeerLostError
from tandem.transport import Arena

__all__ = ["shm_all_reduce", "shm_all_reduce_many", "shm_all_gather", "shm_reduce_scatter",
           "SMALL_BYTES", "SlotRing", "arena_check"]

SMALL_BYTES = 64 << 10
# rounds of the whole-round path: the round's slice of the tensor and a peer's staged
# copy then fit in a 1 MiB L2 together (measured, one rank alone: 64 MB in 7.4 ms at
# 512 KB rounds, 8.5 ms at 1 MiB, 10.3 ms at 256 KB)
WHOLE_ROUND_BYTES = 512 << 10
BACKGROUND_SPIN_S = 5e-6


def _arena(op: Op) -> Arena:
    arena = op.group.arena
    assert arena is not None, "the shm algorithm runs only on groups that share memory"
    return arena


def _mismatch(op: Op, member: int, seq: int, sig: bytes, site: bytes) -> CollectiveMismatchError:
    g = op.group
    theirs = (f"{sig.decode(errors='replace')} (its call #{seq}, this is #{op.seq})"
              if seq != op.seq else sig.decode(errors="replace"))
    return CollectiveMismatchError(
        f"collective mismatch (group {g.group_id}, sequence {op.seq}): rank "
        f"{g.ranks[g.group_rank]} called {op.sig.decode(errors='replace')} at "
        f"{op.site.decode(errors='replace')} but rank {g.ranks[member]} called {theirs} at "
        f"{site.decode(errors='replace')}")


def _differs(op: Op, arena: Arena, member: int, strict: bool) -> CollectiveMismatchError | None:
    """Whether ``member`` is in another call than ``op``.

    ``strict``: the member has posted the phase this rank waited for, so it must have
    announced this very call; if it has not, its phase belongs to another call.
    """
    seen = None
    for _ in range(1000):  # None: the member is rewriting the entry right now; re-read
        seen = arena.announcement(member, op.seq)
        if seen is not None:
            break
    if seen is None:
        return None
    seq, sig, site = seen
    if seq == op.seq and sig == op.sig:
        return None
    if seq < op.seq:
        if not strict:
            return None  # it has not got here yet
        seq, sig, site = arena.latest(member)
        if seq < 0:
            sig = b"no collective yet"
    return _mismatch(op, member, seq, sig, site)


def arena_check(op: Op, arena: Arena) -> Callable[[], None]:
    """What a rank waiting in shared memory checks before it sleeps and as it wakes."""
    g = op.group
    transport = g.transport

    def check() -> None:
        failure = transport.aborted(g.group_id)
        if failure is not None:
            raise failure
        for r in g.ranks:
            lost = transport.lost(r)
            if lost is not None:
                raise PeerLostError(f"{op.describe()} failed: {lost}", r) from lost
        lagging = [q for q in arena.lagging(arena.target) if q != arena.index]
        for q in lagging:
            gone = transport.left(g.ranks[q])
            if gone is not None:
                raise PeerLostError(f"{op.describe()} failed: {gone}", g.ranks[q]) from gone
            error = _differs(op, arena, q, strict=False)
            if error is not None:
                raise error
        parked = transport.parked_call(g.group_id, op.seq)
        if parked is not None:
            sender, header = parked
            member = g.ranks.index(sender) if sender in g.ranks else -1
            raise _mismatch(op, member, header.seq, header.sig, header.site)
        if time.monotonic() > op.deadline:
            names = ", ".join(str(g.ranks[q]) for q in lagging)
            raise CollectiveTimeoutError(
                f"{op.describe()} timed out: waiting in shared memory on rank(s) {names}",
                tuple(g.ranks[q] for q in lagging))

    return check


def _verify(op: Op, arena: Arena, members: Sequence[int] | None = None) -> None:
    """After the call's first wait on ``members`` (default: all): each announced this
    very call, and made the same previous call (a call whose root waits on nobody is
    checked here, next time)."""
    mine = arena.announcement(arena.index, op.seq - 1) if op.seq else None
    for q in range(arena.size) if members is None else members:
        if q == arena.index:
            continue
        error = _differs(op, arena, q, strict=True)
        if error is not None:
            raise error
        theirs = arena.announcement(q, op.seq - 1) if mine is not None else None
        if (mine is not None and theirs is not None and mine[0] == theirs[0] == op.seq - 1
                and mine[1] != theirs[1]):
            g = op.group
            raise CollectiveMismatchError(
                f"collective mismatch (group {g.group_id}, sequence {op.seq - 1}): rank "
                f"{g.ranks[arena.index]} called {mine[1].decode(errors='replace')} at "
                f"{mine[2].decode(errors='replace')} but rank {g.ranks[q]} called "
                f"{theirs[1].decode(errors='replace')} at {theirs[2].decode(errors='replace')}")


def _staging(arena: Arena, dtype: torch.dtype, per: int) -> list[list[torch.Tensor]]:
    """[half][member]: the first ``per`` elements of each staging half, typed."""
    table = arena.slots(dtype, per)
    return [table[0][0], table[1][0]]


class SlotRing:
    """Both staging halves as one ring of slots, for a call that streams through them
    itself (see ``Arena``'s module doc); ``order[r % slots][member]`` holds round r.

    The call starts in the half :meth:`Arena.begin_round` gives. Writing round ``r``
    over round ``r - slots`` needs every member to have read it; if a member's post of
    round ``k`` comes after its last read of round ``k - lag``, that is every member
    having posted round ``r - slots + lag``. The other half is first written only
    after every member posted round 0 of this call (nobody reads the previous call
    any more); a call that wrote it must end with :meth:`close`.
    """

    def __init__(self, arena: Arena, check: Callable[[], None], dtype: torch.dtype,
                 per: int) -> None:
        table = arena.slots(dtype, per)
        h = arena.begin_round(check)
        self.order = table[h] + table[1 - h]
        self.half, self.slots = len(table[h]), 2 * len(table[h])
        self.base = arena.posted  # a member's count after posting round r: base + r + 1
        self._arena, self._check = arena, check

    def reuse(self, r: int, lag: int) -> list[torch.Tensor]:
        """Round ``r``'s slot, once every member is done reading what it held."""
        need = max(r - self.slots + lag, 0 if r >= self.half else -1)
        if need >= 0:
            self._arena.wait_all(self.base + need + 1, self._check)
        return self.order[r % self.slots]

    def close(self, rounds: int) -> None:
        """After the call's last read (every member, the same ``rounds``)."""
        if rounds > self.half:
            self._arena.settle()


# A round covers up to ``per`` consecutive elements of the tensors laid end to end; a
# piece is one tensor's share of it: (view of the tensor, offset in the round).
Piece = tuple[torch.Tensor, int]


def _rounds(tensors: list[torch.Tensor], per: int) -> Iterator[tuple[int, list[Piece]]]:
    """(elements, pieces) of each round; at least one round, even for no elements."""
    if len(tensors) == 1:  # one tensor: its rounds in one call
        if tensors[0].numel() <= per:
            yield tensors[0].numel(), [(tensors[0], 0)]
            return
        for x in tensors[0].split(per):
            yield x.numel(), [(x, 0)]
        return
    pieces: list[Piece] = []
    filled = 0
    for t in tensors:
        at, n = 0, t.numel()
        while at < n:
            k = min(n - at, per - filled)
            pieces.append((t[at:at + k] if k < n else t, filled))
            at += k
            filled += k
            if filled == per:
                yield filled, pieces
                pieces, filled = [], 0
    if pieces or filled == 0:
        yield filled, pieces


def _clip(pieces: list[Piece], lo: int, hi: int) -> list[Piece]:
    """The parts of ``pieces`` that fall in round offsets [lo, hi)."""
    out = []
    for x, off in pieces:
        a, b = max(lo, off), min(hi, off + x.numel())
        if a < b:
            out.append((x[a - off:b - off] if b - a < x.numel() else x, a))
    return out


def _prepare(op: Op) -> tuple[Arena, Callable[[], None]]:
    """The group's arena set up for this call, and the check its waits run."""
    arena = _arena(op)
    # a call queued with async_op=True runs beside the caller's own work (DDP: backward),
    # so its waits leave the CPU almost at once instead of polling
    background = threading.current_thread() is op.group.engine_thread
    arena.spin = BACKGROUND_SPIN_S if background else arena.default_spin
    arena.wait_log = op.phases  # [timeline hook]
    return arena, arena_check(op, arena)


def shm_all_reduce(op: Op, buf: torch.Tensor, redop: ReduceOp) -> None:
    """All-reduce flat ``buf`` in place through the group's arena."""
    shm_all_reduce_many(op, [buf], redop)


def shm_all_reduce_many(op: Op, tensors: list[torch.Tensor], redop: ReduceOp) -> None:
    """All-reduce flat ``tensors`` (one dtype) in place, as if laid end to end, without
    flattening them into one buffer first."""
    arena, check = _prepare(op)
    dtype, size = tensors[0].dtype, tensors[0].element_size()
    n = sum(t.numel() for t in tensors)
    kernel = combiner(redop, dtype)
    if arena.size == 2 or n * size <= SMALL_BYTES:
        _whole_rounds(op, arena, check, tensors, redop, kernel)
        return
    per = arena.chunk // size
    views = _staging(arena, dtype, per)
    first = True
    for m, pieces in _rounds(tensors, per):
        staged = views[arena.begin_round(check)]
        _sliced_round(op, arena, check, staged if m == per else [v[:m] for v in staged],
                      pieces, redop, kernel, first)
        first = False


def _whole_rounds(op: Op, arena: Arena, check: Callable[[], None], tensors: list[torch.Tensor],
                  redop: ReduceOp, kernel: Combine) -> None:
    """Every member stages each round whole and reduces all of it itself.

    Rounds go through a :class:`SlotRing` of ``WHOLE_ROUND_BYTES`` slots (at most half
    a half); a member posts round ``k`` after reducing round ``k - 1`` (lag 1). Staging
    a round ahead while waiting for the peers was measured and dropped: 2 ranks, 64
    MB, 20 alternated runs against this lockstep, it was ahead in 7 of 10 runs at load
    11-19 and behind in 8 of 10 at load 7-14 (the round being reduced leaves the L2
    while the next one is staged).
    """
    size = tensors[0].element_size()
    per = max(1, min(arena.chunk // 2, WHOLE_ROUND_BYTES) // size)
    ring = SlotRing(arena, check, tensors[0].dtype, per)
    rounds = list(_rounds(tensors, per))
    for r, (m, pieces) in enumerate(rounds):
        staged = ring.reuse(r, 1)
        if m < per:
            staged = [v[:m] for v in staged]
        _stage_whole(arena, staged, pieces, redop)
        arena.post()
        arena.wait_all(ring.base + r + 1, check)
        if r == 0:
            _verify(op, arena)
        _reduce_whole(arena, staged, pieces, redop, kernel)
    ring.close(len(rounds))


def _prescaled(redop: ReduceOp, p: int) -> bool:
    """AVG over a power-of-two number of members stages each input already divided:
    dividing by a power of two is exact, so the sum of the quotients has the same bits
    as the quotient of the sum (subnormals aside), and no pass is spent dividing."""
    return redop.name == "AVG" and redop.fn is None and p & (p - 1) == 0


def _stage_whole(arena: Arena, staged: list[torch.Tensor], pieces: list[Piece],
                 redop: ReduceOp) -> None:
    p, me = arena.size, arena.index
    prescale = _prescaled(redop, p)
    mine = staged[me]
    for x, off in pieces:
        into = mine if len(pieces) == 1 else mine[off:off + x.numel()]
        if prescale:
            torch.mul(x, 1.0 / p, out=into)
        else:
            into.copy_(x)


def _reduce_whole(arena: Arena, staged: list[torch.Tensor], pieces: list[Piece],
                  redop: ReduceOp, kernel: Combine) -> None:
    p, me = arena.size, arena.index
    prescale = _prescaled(redop, p)
    averaging = redop.name == "AVG" and redop.fn is None
    for x, off in pieces:
        part = staged if len(pieces) == 1 else [s[off:off + x.numel()] for s in staged]
        # combine in member order into x; x is still in cache from the copy, so it is
        # read in place of my staged copy while its value is unchanged (member 0 or 1)
        own = part[me] if prescale else x
        kernel(own if me == 0 else part[0], own if me == 1 else part[1], x)
        for q in range(2, p):
            kernel(x, part[q], x)
        if averaging and not prescale:
            finish(redop, x, p)


def _sliced_round(op: Op, arena: Arena, check: Callable[[], None], staged: list[torch.Tensor],
                  pieces: list[Piece], redop: ReduceOp, kernel: Combine, first: bool) -> None:
    """Each member reduces one slice of the round; then everyone copies all slices out."""
    p, me = arena.size, arena.index
    m = len(staged[me])
    bounds = even_bounds(m, p)
    a, b = bounds[me]
    mine = staged[me]
    for x, off in _clip(pieces, 0, a) + _clip(pieces, b, m):
        mine[off:off + x.numel()].copy_(x)
    arena.post()
    arena.wait_all(arena.posted, check)
    if first:
        _verify(op, arena)
    for x, off in _clip(pieces, a, b):
        k = x.numel()
        out = mine[off:off + k]
        parts = [x if q == me else staged[q][off:off + k] for q in range(p)]
        kernel(parts[0], parts[1], out)
        for part in parts[2:]:
            kernel(out, part, out)
        finish(redop, out, p)
    arena.post()
    # my slice first, then each member's as soon as it is reduced: on a host with fewer
    # cores than ranks, a rank copies what is ready instead of waiting for the last one
    for q in [*range(me, p), *range(me)]:
        if q != me:
            arena.wait_member(q, arena.posted, check)
        qa, qb = bounds[q]
        for x, off in _clip(pieces, qa, qb):
            x.copy_(staged[q][off:off + x.numel()])


def shm_all_gather(op: Op, outs: list[torch.Tensor], mine: torch.Tensor) -> None:
    """Every member stages its input round by round; everyone copies every piece out.

    ``outs[q]`` (flat) receives member q's input, whose size it gives (sizes may differ
    between members; the caller's signature carries them, so all agree).
    """
    arena, check = _prepare(op)
    p, me, size = arena.size, arena.index, mine.element_size()
    per = arena.chunk // size
    views = _staging(arena, mine.dtype, per)
    sizes = [t.numel() for t in outs]
    for i, start in enumerate(range(0, max(max(sizes), 1), per)):
        staged = views[arena.begin_round(check)]
        m = max(0, min(per, sizes[me] - start))
        staged[me][:m].copy_(mine[start:start + m])
        arena.post()
        arena.wait_all(arena.posted, check)
        if i == 0:
            _verify(op, arena)
        for q in range(p):
            k = max(0, min(per, sizes[q] - start))
            if k:
                outs[q][start:start + k].copy_(mine[start:start + k] if q == me else staged[q][:k])


def shm_reduce_scatter(op: Op, out: torch.Tensor, ins: list[torch.Tensor], redop: ReduceOp) -> None:
    """Member q's result goes to its ``out``: each member stages its inputs for the
    others, and each reduces its own slice straight from the peers' staging.

    ``ins[q]`` (flat) is this member's contribution to member q's output; sizes may
    differ between members (the caller's signature carries them).
    """
    arena, check = _prepare(op)
    p, me, size = arena.size, arena.index, out.element_size()
    per = arena.chunk // size // p  # a round stages one piece for every member
    views = _staging(arena, out.dtype, per * p)
    kernel = combiner(redop, out.dtype)
    sizes = [t.numel() for t in ins]
    if out.numel() and out.untyped_storage().data_ptr() == ins[me].untyped_storage().data_ptr():
        ins = list(ins)
        ins[me] = ins[me].clone()  # the output overwrites my own input (in-place use)
    for i, start in enumerate(range(0, max(max(sizes), 1), per)):
        staged = views[arena.begin_round(check)]
        for q in range(p):
            k = max(0, min(per, sizes[q] - start))
            if q != me and k:
                staged[me][q * per:q * per + k].copy_(ins[q][start:start + k])
        arena.post()
        arena.wait_all(arena.posted, check)
        if i == 0:
            _verify(op, arena)
        k = max(0, min(per, sizes[me] - start))
        if not k:
            continue
        parts = [ins[me][start:start + k] if q == me else staged[q][me * per:me * per + k]
                 for q in range(p)]
        o = out[start:start + k]
        kernel(parts[0], parts[1], o)
        for part in parts[2:]:
            kernel(o, part, o)
        finish(redop, o, p)
