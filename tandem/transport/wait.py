"""Waiting for posted operations: deadlines, lost peers, and timeouts that name names.

Every blocking wait in tandem ends in :func:`wait_all`. It returns when the slots
complete, and otherwise raises, never later than the deadline:

* a slot failed (mismatch, abort from a peer): that error, naming the operation;
* a rank of the group died, even one this rank is not waiting on: ``PeerLostError``
  naming the first rank noticed dead, within a fraction of a second (the transport
  notices closed connections);
* the deadline passed: ``CollectiveTimeoutError`` naming the ranks that stalled.

A peer that vanished is blamed only once the group's own news had a moment to come
(:func:`blame`): a rank that raised (a mismatch) tells every member why before it
leaves, but the news may take another way than its leaving (a relay through other
hosts, or a check that read "aborted?" just before both arrived), and the cause, not
its consequence, is what every rank should report.

Timeouts are shared. A rank that times out, or learns that a peer did, tells every
peer which ranks it was waiting on, and listens briefly for their reports. A rank
that reports is alive, so it is never blamed; what remains of everyone's waits are
the ranks that stalled. In a ring where rank 2 is stopped, rank 3 waits on 2, rank 0
on 3 and rank 1 on 0: ranks 0, 1 and 3 report, and all three name rank 2 alone.
Where every rank waited on reports, none is stopped: a rank came late, and the ranks
the timeout named are kept (a verdict never names nobody).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable, NoReturn

from tandem.errors import CollectiveTimeoutError, PeerLostError, TandemError
from tandem.transport.failures import Failures
from tandem.transport.mailbox import Mailbox
from tandem.transport.message import Slot

__all__ = ["wait_all", "blame", "raise_lost", "TIMEOUT_GRACE", "LOST_GRACE"]

# how long a rank that timed out listens for its peers' reports before raising
TIMEOUT_GRACE = 0.5
# how long a rank that saw a peer vanish waits for its group's abort news before blaming
# the peer: relayed news lagged a peer's exit by up to ~0.1 s at load 60 on 2 cores
LOST_GRACE = 1.0


def blame(failures: Failures, group: int, lost: TandemError, deadline: float) -> TandemError:
    """What a wait on ``group`` that found ``lost`` (a peer died or left) raises: the
    group's abort if it is known within :data:`LOST_GRACE` (never past ``deadline``),
    else ``lost``; a real crash is reported that much later."""
    end = min(time.monotonic() + LOST_GRACE, deadline)
    while True:
        aborted = failures.aborted(group)
        if aborted is not None:
            return aborted
        if time.monotonic() >= end:
            return lost
        time.sleep(0.01)


def raise_lost(failures: Failures, group: int, lost: PeerLostError, rank: int,
               deadline: float, describe: Callable[[], str]) -> NoReturn:
    """Raise for ``rank``, found gone (``lost``) by a wait on ``group``: the group's abort
    if :func:`blame` finds it, else the loss, naming the call."""
    cause = blame(failures, group, lost, deadline)
    if cause is not lost:
        raise cause
    raise PeerLostError(f"{describe()} failed: {lost}", rank) from lost


def wait_all(slots: Iterable[Slot], deadline: float, describe: Callable[[], str],
             mailbox: Mailbox, group_peers: Iterable[int] = ()) -> None:
    """Wait for every slot of one operation; ``group_peers`` are watched for death."""
    pending = collections.deque(slots)
    peers = tuple(group_peers)
    while pending:
        slot = pending[0]
        if slot.event.is_set():
            pending.popleft()
            if slot.error is not None:
                _raise(slot, pending, describe, mailbox, peers, deadline)
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _cancel(pending, mailbox)
            raise _timed_out(pending, describe, mailbox, peers)
        if slot.event.wait(min(remaining, 0.05)):
            continue
        lost = mailbox.failures.first_lost(peers)
        if lost is not None:
            try:
                raise_lost(mailbox.failures, slot.key[2], lost, lost.rank, deadline, describe)
            finally:  # after the grace, before the error leaves
                _cancel(pending, mailbox)


def _cancel(slots: Iterable[Slot], mailbox: Mailbox) -> None:
    for s in slots:
        mailbox.cancel(s)


def _waiting_on(slots: Iterable[Slot], me: int) -> set[int]:
    return {s.peer for s in slots if not s.event.is_set() and s.peer not in (-1, me)}


def _names(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(ranks))) or "-"


def _raise(slot: Slot, pending: collections.deque[Slot], describe: Callable[[], str],
           mailbox: Mailbox, peers: tuple[int, ...], deadline: float) -> None:
    error = slot.error
    assert error is not None
    if isinstance(error, PeerLostError):
        error = blame(mailbox.failures, slot.key[2], error, deadline)
    if isinstance(error, CollectiveTimeoutError):
        # a peer timed out: add whom this rank was still waiting on, and tell the others
        mine = _waiting_on(pending, mailbox.rank)
        if slot.header is None and slot.peer not in (-1, mailbox.rank):
            mine.add(slot.peer)  # the receive the abort interrupted
        _cancel(pending, mailbox)
        missing = _verdict(slot.key[2], mine, error, mailbox, peers, describe)
        raise CollectiveTimeoutError(
            f"{describe()} timed out: the group is waiting on rank(s) {_names(missing)}"
            f"{_also(mine, missing)}; a peer timed out first and said so (the cause below "
            f"is its report)", tuple(sorted(missing))) from error
    _cancel(pending, mailbox)
    if isinstance(error, PeerLostError) and "reported by" not in str(error):
        raise PeerLostError(f"{describe()} failed: {error}", error.rank) from error
    raise error


def _timed_out(pending: Iterable[Slot], describe: Callable[[], str], mailbox: Mailbox,
               peers: tuple[int, ...]) -> CollectiveTimeoutError:
    slots = list(pending)
    mine = _waiting_on(slots, mailbox.rank)
    error = CollectiveTimeoutError(
        f"{describe()} timed out: no message from rank(s) {_names(mine)}", tuple(sorted(mine)))
    groups = {s.key[2] for s in slots}
    if not groups:
        return error
    missing = _verdict(next(iter(groups)), mine, error, mailbox, peers, describe)
    if missing == mine:
        return error
    # the ranks nobody heard from come first: a rank this one waited on that reported is
    # alive (waiting too), and is said to be
    return CollectiveTimeoutError(
        f"{describe()} timed out: the group is waiting on rank(s) {_names(missing)}, from "
        f"which no rank heard{_also(mine, missing)}", tuple(sorted(missing)))


def _also(mine: set[int], missing: set[int]) -> str:
    """What this rank waited on beyond the verdict: live ranks, waiting in turn."""
    alive = sorted(mine - missing)
    if not alive:
        return ""
    return (f" (this rank waited on {'rank' if len(alive) == 1 else 'ranks'} "
            f"{_names(alive)}, alive and waiting too)")


def _verdict(group: int, mine: set[int], cause: CollectiveTimeoutError, mailbox: Mailbox,
             peers: tuple[int, ...], describe: Callable[[], str]) -> set[int]:
    """Tell the live peers whom this rank waits on; listen for theirs; return the ranks
    that stalled: all that anyone waits on, less every rank that reported (it is alive)."""
    me = mailbox.rank
    failures = mailbox.failures
    live = {p for p in peers if p != me and failures.lost(p) is None}
    if mailbox.reply is not None:
        mine_error = CollectiveTimeoutError(
            f"{describe()} timed out on rank {me}: no message from rank(s) {_names(mine)}",
            tuple(sorted(mine)))
        if live:
            mailbox.reply(sorted(live), group, mine_error)
    end = time.monotonic() + TIMEOUT_GRACE
    while True:
        reports = [(r, e) for r, e in failures.reports(group)
                   if isinstance(e, CollectiveTimeoutError)]
        reporters = {r for r, _ in reports}
        if live <= reporters or time.monotonic() >= end:
            break
        time.sleep(0.02)
    missing = set(mine) | set(cause.missing)
    for _, e in reports:
        missing |= set(e.missing)
    stalled = missing - reporters - {me}
    if not stalled:
        # every rank waited on reported: none is stopped, so one came late (it entered
        # the call after its peers' deadline, and its report says only whom it then
        # waited on). What the timeout named stands: on the late rank that is itself
        stalled = set(cause.missing) or mine - {me}
    return stalled
