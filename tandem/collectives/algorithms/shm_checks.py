"""How a shared-memory collective waits: who is late, who is dead, who is in another call.

Mismatches: a call moving no messages cannot rely on the mailbox's signature check,
so each member announces every call in its segment (``ProcessGroup`` does), and
after the first wait of a call every member compares every peer's announcement of
this call number with its own (:func:`verify`); a peer that is in some other call,
through shared memory or messages, is found by the same comparison while waiting
(:func:`arena_check`); a peer found in this very call is not compared again in it.
Waits end early when the group is aborted or a member dies,
and at the deadline.

    arena, check = prepare(op)          # the group's arena, and what its waits check
    arena.post(); arena.wait_all(arena.posted, check)
    verify(op, arena)                   # after the call's first wait
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from tandem.collectives.group import Op
from tandem.errors import CollectiveMismatchError, CollectiveTimeoutError
from tandem.transport import Arena

__all__ = ["prepare", "arena_check", "verify", "BACKGROUND_SPIN_S"]

BACKGROUND_SPIN_S = 5e-6


def _arena(op: Op) -> Arena:
    arena = op.group.arena
    assert arena is not None, "the shm algorithm runs only on groups that share memory"
    return arena


def _mismatch(op: Op, who: int, seq: int, sig: bytes, site: bytes) -> CollectiveMismatchError:
    """``who``: the global rank in the other call."""
    g = op.group
    theirs = (f"{sig.decode(errors='replace')} (its call #{seq}, this is #{op.seq})"
              if seq != op.seq else sig.decode(errors="replace"))
    return CollectiveMismatchError(
        f"collective mismatch (group {g.group_id}, sequence {op.seq}): rank "
        f"{g.ranks[g.group_rank]} called {op.sig.decode(errors='replace')} at "
        f"{op.site.decode(errors='replace')} but rank {who} called {theirs} at "
        f"{site.decode(errors='replace')}")


def _matched(op: Op, arena: Arena) -> set[int]:
    """The members of ``arena`` already found in ``op``: none is compared again in it (a
    first barrier on a host wakes many times, and each wake compared every laggard)."""
    call = (op.seq, op.sig)
    if arena.matched_call != call:
        arena.matched_call = call
        arena.matched = set()
    return arena.matched


def _differs(op: Op, arena: Arena, member: int, strict: bool, ranks: Sequence[int],
             matched: set[int]) -> CollectiveMismatchError | None:
    """Whether ``member`` (``ranks[member]``) is in another call than ``op``.

    ``strict``: the member has posted the phase this rank waited for, so it must have
    announced this very call; if it has not, its phase belongs to another call.
    ``matched`` (:func:`_matched`): members found in ``op``, skipped; one found is added.
    """
    if member in matched:
        return None
    if arena.holds(member, op.seq, op.sig):
        matched.add(member)
        return None
    seen = None
    for _ in range(1000):  # None: the member is rewriting the entry right now; re-read
        seen = arena.announcement(member, op.seq)
        if seen is not None:
            break
    if seen is None:
        return None
    seq, sig, site = seen
    if seq == op.seq and sig == op.sig:
        matched.add(member)
        return None
    if seq > op.seq and strict:
        # it posted this call's phase and has since run further (a gather's non-roots
        # return without waiting) than the announcements kept; its own check of this
        # call compared ours, so a different call would have failed there
        return None
    if seq < op.seq:
        if not strict:
            return None  # it has not got here yet
        seq, sig, site = arena.latest(member)
        if seq < 0:
            sig = b"no collective yet"
    return _mismatch(op, ranks[member], seq, sig, site)


def arena_check(op: Op, arena: Arena, ranks: Sequence[int] | None = None,
                messages: bool = False) -> Callable[[], None]:
    """What a rank waiting in shared memory checks before it sleeps and as it wakes;
    ``ranks``: the global ranks of the arena's members (default: the group's);
    ``messages``: the call moves messages too, so one of this call with its signature
    that waits unreceived is its own, not a peer's other call."""
    g = op.group
    transport = g.transport
    members = g.ranks if ranks is None else ranks

    def check() -> None:
        transport.check_group(g.group_id, g.ranks, op.deadline, op.describe)
        lagging = [q for q in arena.lagging(arena.target) if q != arena.index]
        if lagging:
            matched = _matched(op, arena)
            for q in lagging:
                gone = transport.left(members[q])
                if gone is not None:
                    transport.raise_lost(g.group_id, gone, members[q], op.deadline,
                                         op.describe)
                error = _differs(op, arena, q, False, members, matched)
                if error is not None:
                    raise error
        parked = transport.parked_call(g.group_id, op.seq, op.sig if messages else None)
        if parked is not None:
            sender, header = parked
            raise _mismatch(op, sender, header.seq, header.sig, header.site)
        if time.monotonic() > op.deadline:
            names = ", ".join(str(members[q]) for q in lagging)
            raise CollectiveTimeoutError(
                f"{op.describe()} timed out: waiting in shared memory on rank(s) {names}",
                tuple(members[q] for q in lagging))

    return check


def verify(op: Op, arena: Arena, members: Sequence[int] | None = None,
           ranks: Sequence[int] | None = None) -> None:
    """After the call's first wait on ``members`` (default: all): each announced this
    very call, and made the same previous call (a call whose root waits on nobody is
    checked here, next time). ``ranks``: as for :func:`arena_check`; an arena of some
    of the group's ranks holds only the calls that use it, so no previous call is
    compared there."""
    matched = _matched(op, arena)
    for q in range(arena.size) if members is None else members:
        if q != arena.index:
            error = _differs(op, arena, q, True, op.group.ranks if ranks is None else ranks,
                             matched)
            if error is not None:
                raise error
    if ranks is None:
        # every member that has announced the previous call is compared, not only those
        # waited on: a root that waits on nobody still sees a previous call that differed
        op.group.compare_previous(op, range(arena.size))


def prepare(op: Op, arena: Arena | None = None, ranks: Sequence[int] | None = None,
            messages: bool = False) -> tuple[Arena, Callable[[], None]]:
    """The group's arena (or ``arena``, of the global ranks ``ranks``) set up for this
    call, and the check its waits run (``messages``: as for :func:`arena_check`)."""
    arena = _arena(op) if arena is None else arena
    # a call queued with async_op=True runs beside the caller's own work (DDP: backward),
    # so its waits leave the CPU almost at once instead of polling
    background = threading.current_thread() is op.group.engine_thread
    arena.spin = BACKGROUND_SPIN_S if background else arena.default_spin
    arena.wait_log = op.phases  # [timeline hook]
    return arena, arena_check(op, arena, ranks, messages)
