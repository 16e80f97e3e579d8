"""Failure bookkeeping of one rank's transport: lost peers, aborted groups, reports.

What the transport knows about failures, and the form in which ranks tell each other
(the payload of an ABORT message). Blame is exact: a peer's connection closing
without a goodbye names that peer; an error learnt from another rank says so
("rank 0 died (reported by rank 1)"); a timeout report carries the reporter, so a
rank that reports is known to be alive (see ``wait``)::

    book = Failures(rank=1)
    book.lose(0, PeerLostError("rank 0 closed its connection ...", 0))
    book.lost(0)              # the error, or None
    book.failure(0, group)    # why a receive from 0 on ``group`` cannot complete, or None
"""

from __future__ import annotations

import collections
import threading
from typing import Iterable

from tandem.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    PeerLostError,
    StateError,
    TandemError,
)

__all__ = ["Failures", "Report", "ABORT_CODES", "encode_error", "decode_error", "split_relay",
           "with_relay"]

# An ABORT message's ``step`` says which error the receivers raise.
ABORT_CODES: dict[int, type[TandemError]] = {
    0: StateError,
    1: CollectiveMismatchError,
    2: CollectiveTimeoutError,
    3: PeerLostError,
}
_KEPT_REPORTS = 256  # per group: enough to hear every rank of a large group once

Report = tuple[int, TandemError]  # (the rank that reported, its error)


def encode_error(error: TandemError, reporter: int, relay: Iterable[int] = ()) -> bytes:
    """An ABORT payload: the details other ranks need to rebuild ``error``; ``relay``:
    ranks of the receiver's host it passes the news on to (the sender has no connection
    to them, see ``MixedTransport.abort``)."""
    missing = ",".join(map(str, getattr(error, "missing", ())))
    lost = getattr(error, "rank", -1)
    return f"{missing};{lost};{reporter};{','.join(map(str, relay))}\n{error}".encode()


def with_relay(data: bytes, relay: Iterable[int]) -> bytes:
    """An ABORT payload (as :func:`split_relay` leaves it) asking its receiver to pass it
    on to ``relay``; the reporter and the error stay the original's."""
    head, nl, text = data.partition(b"\n")
    fields = (head.split(b";") + [b"", b"", b""])[:3]
    return b";".join(fields + [",".join(map(str, relay)).encode()]) + nl + text


def split_relay(data: bytes) -> tuple[list[int], bytes]:
    """(the ranks an ABORT payload asks its receiver to pass it on to, the payload to
    pass on: the same news with no one left to relay to)."""
    head, nl, text = data.partition(b"\n")
    fields = head.split(b";")
    if len(fields) < 4 or not fields[3]:
        return [], data
    relay = [r for r in (_int(f.decode(errors="replace")) for f in fields[3].split(b","))
             if r >= 0]
    return relay, b";".join(fields[:3] + [b""]) + nl + text


def decode_error(code: int, data: bytes) -> Report:
    """(reporter, error) from an ABORT payload; the error says who reported it."""
    head, _, text = data.decode(errors="replace").partition("\n")
    fields = head.split(";")
    missing_text, lost_text, reporter_text = (fields + ["", "", ""])[:3]
    reporter = _int(reporter_text)
    error_type = ABORT_CODES.get(code, StateError)
    if error_type is PeerLostError:
        lost = _int(lost_text)
        who = f"rank {lost} died" if lost >= 0 else "a rank was lost"
        return reporter, PeerLostError(f"{who} (reported by rank {reporter}): {text}", lost)
    text = f"[reported by rank {reporter}] {text}"
    if error_type is CollectiveTimeoutError:
        missing = tuple(_int(m) for m in missing_text.split(",") if _int(m) >= 0)
        return reporter, CollectiveTimeoutError(text, missing)
    return reporter, error_type(text)


def _int(text: str) -> int:
    text = text.strip()
    return int(text) if text.lstrip("-").isdigit() else -1


class Failures:
    """Everything this rank learnt about failures; thread-safe, read by any thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._dead: dict[int, PeerLostError] = {}  # in the order they were noticed
        # peers that said goodbye before closing: a finished peer, not a crashed one, so
        # only calls that still need it fail
        self._departed: set[int] = set()
        self._left: dict[int, PeerLostError] = {}
        self._aborted: dict[int, TandemError] = {}
        self._quiet: set[int] = set()  # groups failed here only (destroyed), nothing to tell
        self._closed: TandemError | None = None
        self._reports: dict[int, collections.deque[Report]] = {}

    # -- queries -----------------------------------------------------------------------
    def lost(self, peer: int) -> PeerLostError | None:
        """Why ``peer`` is gone if it died (a goodbye first makes it ``left``), else None."""
        return self._dead.get(peer)

    def first_lost(self, peers: Iterable[int]) -> PeerLostError | None:
        """The earliest noticed death among ``peers``: the cause, not a later consequence."""
        if not self._dead:
            return None
        wanted = set(peers)
        return next((e for p, e in list(self._dead.items()) if p in wanted), None)

    def all_lost(self) -> dict[int, PeerLostError]:
        """Every peer that died, in the order noticed, with why (a copy)."""
        return dict(self._dead)

    def all_left(self) -> dict[int, PeerLostError]:
        """Every peer that closed after a goodbye, with why receives from it fail (a copy)."""
        return dict(self._left)

    def left(self, peer: int) -> PeerLostError | None:
        """Why a receive from ``peer``, which closed its group on purpose, cannot complete."""
        return self._left.get(peer)

    def aborted(self, group: int) -> TandemError | None:
        """Why ``group`` failed here, or None."""
        return self._aborted.get(group) or self._closed

    def failure(self, peer: int, group: int) -> TandemError | None:
        """Why a receive from ``peer`` on ``group`` cannot complete, or None."""
        # every receive asks this: one expression, no nested call
        return (self._aborted.get(group) or self._closed or self._dead.get(peer)
                or self._left.get(peer))

    def reports(self, group: int) -> list[Report]:
        """Every failure peers reported on ``group``, oldest first."""
        with self._lock:
            return list(self._reports.get(group, ()))

    @property
    def closed(self) -> TandemError | None:
        return self._closed

    # -- updates -------------------------------------------------------------------------
    def depart(self, peer: int) -> None:
        with self._lock:
            self._departed.add(peer)

    def lose(self, peer: int, error: PeerLostError) -> PeerLostError:
        """Record that ``peer``'s connection is gone; return the error its receives get."""
        with self._lock:
            if peer in self._departed:
                error = PeerLostError(
                    f"rank {peer} left (it closed its process group) before sending what rank "
                    f"{self.rank} is waiting for; did the ranks run different collectives?",
                    peer)
                return self._left.setdefault(peer, error)
            return self._dead.setdefault(peer, error)

    def abort(self, group: int, error: TandemError, quiet: bool = False) -> TandemError:
        """Record that ``group`` failed; return the first error it failed with.

        ``quiet``: a failure of this rank only (its group was destroyed), which peers
        have no use for (see :meth:`reasons`).
        """
        with self._lock:
            if group not in self._aborted and quiet:
                self._quiet.add(group)
            return self._aborted.setdefault(group, error)

    def reasons(self) -> list[tuple[int, TandemError]]:
        """(group, error) of every group that failed here for a reason peers should know:
        a rank that leaves tells them first, so none blames its leaving."""
        with self._lock:
            return [(g, e) for g, e in self._aborted.items() if g not in self._quiet]

    def report(self, group: int, reporter: int, error: TandemError) -> None:
        with self._lock:
            kept = self._reports.setdefault(group, collections.deque(maxlen=_KEPT_REPORTS))
            kept.append((reporter, error))

    def close(self, error: TandemError) -> None:
        """Every group fails with ``error`` from now on (the transport closed)."""
        with self._lock:
            if self._closed is None:
                self._closed = error
