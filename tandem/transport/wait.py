"""Waiting for posted operations: deadlines, lost peers, and timeouts that name names.

Every blocking wait in tandem ends in :func:`wait_all`. It returns when the slots
complete, and otherwise raises, never later than the deadline:

* a slot failed (mismatch, abort from a peer): that error, naming the operation;
* a rank of the group died, even one this rank is not waiting on: ``PeerLostError``
  within a fraction of a second (the transport notices closed connections);
* the deadline passed: ``CollectiveTimeoutError`` naming the ranks not heard from.

Timeouts are shared: a rank that times out tells its peers at once, and a rank that
learns of a peer's timeout adds the ranks *it* was waiting on. So when rank 1 waits
on rank 0, which waits on a stopped rank 2, both name rank 2, not just each other.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable

from tandem.errors import CollectiveTimeoutError, PeerLostError
from tandem.transport.base import Mailbox, Slot

__all__ = ["wait_all"]

# how long a rank that timed out listens for its peers' timeouts before reporting
TIMEOUT_GRACE = 0.5


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
                _raise(slot, pending, describe, mailbox)
            continue
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            for s in pending:
                mailbox.cancel(s)
            raise _timed_out(pending, describe, mailbox, peers)
        if slot.event.wait(min(remaining, 0.05)):
            continue
        for p in peers:
            lost = mailbox.dead.get(p)
            if lost is not None:
                for s in pending:
                    mailbox.cancel(s)
                raise PeerLostError(f"{describe()} failed: {lost}", p) from lost


def _waiting_on(slots: Iterable[Slot], me: int) -> set[int]:
    return {s.peer for s in slots if not s.event.is_set() and s.peer not in (-1, me)}


def _raise(slot: Slot, pending: Iterable[Slot], describe: Callable[[], str],
           mailbox: Mailbox) -> None:
    error = slot.error
    assert error is not None
    if isinstance(error, CollectiveTimeoutError):
        # a peer timed out: add whom this rank was still waiting on
        mine = _waiting_on(pending, mailbox.rank)
        if slot.header is None and slot.peer not in (-1, mailbox.rank):
            mine.add(slot.peer)  # the receive the abort interrupted
        missing = tuple(sorted((set(error.missing) | mine) - {mailbox.rank}))
        for s in pending:
            mailbox.cancel(s)
        raise CollectiveTimeoutError(
            f"{describe()} timed out: waiting on rank(s) {_names(mine) or '-'}; "
            f"peers report: {error}", missing) from error
    if isinstance(error, PeerLostError) and not str(error).startswith("["):
        raise PeerLostError(f"{describe()} failed: {error}", error.rank) from error
    raise error


def _names(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


def _timed_out(pending: Iterable[Slot], describe: Callable[[], str], mailbox: Mailbox,
               peers: tuple[int, ...]) -> CollectiveTimeoutError:
    slots = list(pending)
    mine = _waiting_on(slots, mailbox.rank)
    error = CollectiveTimeoutError(
        f"{describe()} timed out: no message from rank(s) {_names(mine)}", tuple(sorted(mine)))
    groups = {s.key[2] for s in slots}
    if mailbox.reply is None or not groups:
        return error
    group = next(iter(groups))
    seen = len(mailbox.reports[group])
    for p in peers:
        if p != mailbox.rank and p not in mailbox.dead:
            mailbox.reply(p, group, error)
    # listen briefly for what the peers were waiting on
    end = time.monotonic() + TIMEOUT_GRACE
    missing = set(mine)
    while time.monotonic() < end:
        reports = [r for r in mailbox.reports[group][seen:] if isinstance(r, CollectiveTimeoutError)]
        if reports:
            for r in reports:
                missing |= set(r.missing)
            break
        time.sleep(0.02)
    missing.discard(mailbox.rank)
    if missing == mine:
        return error
    return CollectiveTimeoutError(
        f"{describe()} timed out: no message from rank(s) {_names(mine)}; the group is "
        f"waiting on rank(s) {_names(missing)}", tuple(sorted(missing)))
