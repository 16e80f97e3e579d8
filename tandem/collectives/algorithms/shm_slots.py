"""Streaming tensors through an arena's staging halves: rounds, pieces and slot rings.

A round covers up to ``per`` consecutive elements of the call's tensors laid end to
end (:func:`rounds`); a piece is one tensor's share of it. A call that streams
through both halves itself keeps them in a :class:`SlotRing`.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from tandem.transport import Arena

__all__ = ["staging", "SlotRing", "Piece", "rounds", "clip"]


def staging(arena: Arena, dtype: torch.dtype, per: int) -> list[list[torch.Tensor]]:
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
    any more); a call that wrote it must end with :meth:`close`. A member that never
    writes a slot (``write=False``) starts without waiting (:meth:`Arena.begin_round`).
    """

    def __init__(self, arena: Arena, check: Callable[[], None], dtype: torch.dtype,
                 per: int, write: bool = True) -> None:
        table = arena.slots(dtype, per)
        h = arena.begin_round(check, write)
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


# a piece: (view of one tensor, its offset in the round)
Piece = tuple[torch.Tensor, int]


def rounds(tensors: list[torch.Tensor], per: int) -> Iterator[tuple[int, list[Piece]]]:
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


def clip(pieces: list[Piece], lo: int, hi: int) -> list[Piece]:
    """The parts of ``pieces`` that fall in round offsets [lo, hi)."""
    out = []
    for x, off in pieces:
        a, b = max(lo, off), min(hi, off + x.numel())
        if a < b:
            out.append((x[a - off:b - off] if b - a < x.numel() else x, a))
    return out
