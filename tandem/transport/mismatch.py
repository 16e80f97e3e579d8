"""Mismatch detection: telling, before any data is combined, that ranks called different things.

Every collective message carries its sender's signature and call site. A receive
compares them with its own (:func:`check`); since mismatched calls often use
different step numbers and never meet, arrivals are also compared with every
receive posted for the same call (:func:`clashing_posts`), posts with every parked
arrival of that call (:func:`clashing_arrival`), and a message for a call this rank
already completed is a stray (:meth:`History.stray`). The mailbox calls these
holding its lock; they only read what they are given.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable

from tandem.errors import CollectiveMismatchError
from tandem.transport.message import Header, Key, Kind, Slot

__all__ = ["History", "mismatch", "check", "clashing_posts", "clashing_arrival"]

# enum members as module constants: looking one up on its class costs ~10x a global
_COLL = Kind.COLL
_P2P = Kind.P2P

_KEPT_CALLS = 64  # completed calls remembered per group, to recognise strays


def _text(data: bytes) -> str:
    return data.decode(errors="replace")


def mismatch(slot: Slot, header: Header, my_rank: int, peer: int | None = None
             ) -> CollectiveMismatchError:
    """``slot``'s call (this rank's) and ``header``'s (``peer``'s) differ."""
    return CollectiveMismatchError(
        f"collective mismatch (group {header.group}, sequence {header.seq}): "
        f"rank {my_rank} called {_text(slot.sig)} at {_text(slot.site) or '?'} but rank "
        f"{slot.peer if peer is None else peer} called {_text(header.sig)} at "
        f"{_text(header.site)}")


def check(slot: Slot, header: Header, my_rank: int) -> CollectiveMismatchError | None:
    """Whether ``header`` may fill ``slot``: same call, same size."""
    if header.kind == _COLL and header.sig != slot.sig:
        return mismatch(slot, header, my_rank)
    if header.kind == _P2P and header.sig != slot.sig and header.sig and slot.sig:
        # a send's and a receive's signature are their tensors' dtypes: the same bytes
        # read as another dtype would be silently wrong values
        return CollectiveMismatchError(
            f"rank {slot.peer if slot.peer >= 0 else '?'} sent {_text(header.sig)} but rank "
            f"{my_rank} receives into {_text(slot.sig)} (tensor dtypes differ between send "
            f"and recv; sender at {_text(header.site)})")
    if slot.view is not None and header.nbytes != len(slot.view):
        what = "receive" if header.kind == _P2P else _text(slot.sig) or "receive"
        return CollectiveMismatchError(
            f"rank {slot.peer} sent {header.nbytes} bytes but rank {my_rank} expected "
            f"{len(slot.view)} for {what} (tensor sizes differ across ranks; sender at "
            f"{_text(header.site)})")
    return None


def clashing_posts(posted: dict[Key, Slot], header: Header) -> list[Slot]:
    """Posted receives of ``header``'s collective call whose signature differs."""
    if header.kind != _COLL:
        return []
    return [s for k, s in posted.items() if k[1] == _COLL and k[2] == header.group
            and k[3] == header.seq and s.sig != header.sig]


def clashing_arrival(parked: Iterable[Slot], kind: int, group: int, seq: int,
                     sig: bytes) -> Slot | None:
    """A parked message of the same collective call with another signature."""
    if kind != _COLL:
        return None
    for p in parked:
        k, h = p.key, p.header
        if k[1] == _COLL and k[2] == group and k[3] == seq and h is not None and h.sig != sig:
            return p
    return None


# A group's own record of its completed calls (its flight recorder's): given a sequence
# number, (signature, call site) of that call if this rank completed it, else None
Completed = Callable[[int], "tuple[bytes, bytes] | None"]


class History:
    """The last calls this rank completed per group: (seq, signature, call site).

    A group whose flight recorder is on records each call once, there
    (:meth:`follow`), and says ``recorded`` to :meth:`Mailbox.finished`; its calls
    made while recording was off are kept here.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._done: dict[int, collections.deque[tuple[int, bytes, bytes]]] = {}
        self._recorded: dict[int, Completed] = {}

    def follow(self, group: int, completed: Completed) -> None:
        """Look up ``group``'s calls with ``completed`` too (its recorder's)."""
        self._recorded[group] = completed

    def unfollow(self, group: int,
                 last: Callable[[int], Iterable[tuple[int, bytes, bytes]]]) -> None:
        """Stop looking ``group``'s calls up elsewhere, keeping its last completed calls
        here (``last(n)``: the last ``n``, oldest first)."""
        if self._recorded.pop(group, None) is not None:
            for seq, sig, site in last(_KEPT_CALLS):
                self.record(group, seq, sig, site)

    def record(self, group: int, seq: int, sig: bytes, site: bytes) -> None:
        # every call records itself: no deque made per call only to be thrown away
        done = self._done.get(group)
        if done is None:
            done = self._done[group] = collections.deque(maxlen=_KEPT_CALLS)
        done.append((seq, sig, site))

    def stray(self, peer: int, header: Header) -> CollectiveMismatchError | None:
        """A message for a call this rank already completed: the peer's call differed.

        E.g. two ranks that both believe they are the root of a broadcast only send.
        """
        if header.kind != _COLL:
            return None
        completed = self._recorded.get(header.group)
        mine = completed(header.seq) if completed is not None else None
        if mine is None:
            done = self._done.get(header.group)
            if not done or header.seq > done[-1][0]:
                return None
            mine = next(((sig, site) for seq, sig, site in done if seq == header.seq), None)
        sig, site = mine if mine is not None else (b"an earlier collective", b"?")
        return CollectiveMismatchError(
            f"collective mismatch (group {header.group}, sequence {header.seq}): "
            f"rank {self.rank} completed {_text(sig)} at {_text(site)} but rank {peer} called "
            f"{_text(header.sig)} at {_text(header.site)}")
