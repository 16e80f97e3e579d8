"""Sending every rank the parameters the others updated: ``all_gather`` on flat pieces.

After a ZeRO step each rank holds new values for the parameters it owns. An
:class:`Exchange` moves them with one ``all_gather`` per *round*, each rank
contributing one flat byte range per round (parameters of any dtype travel as
bytes):

* a run of memory at least :data:`SMALL_BYTES` long (one parameter, or several
  parameters lying end to end in the flat buffer of ``parameters_as_bucket_view``)
  is gathered *in place*: the receivers' output is the parameter memory itself,
  cut into pieces of at most :data:`ROUND_BYTES`;
* smaller parameters are packed together into a staging buffer and unpacked after
  the call.

Every rank builds the same plan from the same layout, so the sizes agree (the
shared-memory all-gather checks them). torch's ZeroRedundancyOptimizer broadcasts
each parameter (or each rank's bucket) from its owner instead: one collective per
parameter and rank.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from tandem.collectives.api import all_gather
from tandem.collectives.group import ProcessGroup
from tandem.collectives.work import Work

__all__ = ["Exchange", "Location", "ROUND_BYTES", "SMALL_BYTES"]

ROUND_BYTES = 8 << 20  # per rank and all_gather call: bounds the staging of packed rounds
SMALL_BYTES = 64 << 10  # smaller runs are packed: a call costs more than their copy


@dataclasses.dataclass(frozen=True)
class Location:
    """Where a parameter's bytes are: ``base`` (an index into the exchange's bases) and a
    byte offset in it; ``base`` is None for a parameter that is not contiguous."""

    base: int | None
    offset: int
    nbytes: int


# one rank's share of a round: direct (base, start, stop) or packed [(param, start, stop)]
_Direct = tuple[int, int, int]
_Packed = list[tuple[int, int, int]]


@dataclasses.dataclass
class _Share:
    direct: _Direct | None = None
    packed: _Packed = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        if self.direct is not None:
            return self.direct[2] - self.direct[1]
        return sum(b - a for _, a, b in self.packed)


def _runs(order: list[int], where: Sequence[Location]) -> list[tuple[int | None, int, int, list[int]]]:
    """Consecutive parameters lying end to end in one base merge into one run."""
    runs: list[tuple[int | None, int, int, list[int]]] = []
    for i in order:
        loc = where[i]
        if runs and loc.base is not None and runs[-1][0] == loc.base:
            base, start, stop, members = runs[-1]
            gap = loc.offset - stop
            if 0 <= gap < 64:  # only alignment padding between them
                runs[-1] = (base, start, loc.offset + loc.nbytes, members + [i])
                continue
        runs.append((loc.base, loc.offset, loc.offset + loc.nbytes, [i]))
    return runs


def _shares(order: list[int], where: Sequence[Location]) -> list[_Share]:
    """One rank's contributions, round by round."""
    direct: list[_Share] = []
    packed: list[_Share] = []
    for base, start, stop, members in _runs(order, where):
        if base is not None and stop - start >= SMALL_BYTES:
            for a in range(start, stop, ROUND_BYTES):
                direct.append(_Share(direct=(base, a, min(stop, a + ROUND_BYTES))))
            continue
        for i in members:
            n = where[i].nbytes
            if not packed or packed[-1].nbytes + n > ROUND_BYTES:
                packed.append(_Share())
            packed[-1].packed.append((i, 0, n))
    return direct + packed


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


class Exchange:
    """The plan that sends each owner's ``params`` to every rank, and its execution.

    ``where[i]`` locates parameter ``i`` in ``bases`` (the flat buffer, or the
    parameter itself); ``owners[i]`` is the group rank that updated it.
    """

    def __init__(self, params: Sequence[torch.Tensor], owners: Sequence[int],
                 where: Sequence[Location], bases: Sequence[torch.Tensor],
                 group: ProcessGroup) -> None:
        self.params = list(params)
        self.bases = [_bytes(b) for b in bases]
        self.group = group
        per_rank = [_shares([i for i, o in enumerate(owners) if o == r and where[i].nbytes], where)
                    for r in range(group.group_size)]
        depth = max((len(s) for s in per_rank), default=0)
        self.rounds = [[s[k] if k < len(s) else _Share() for s in per_rank] for k in range(depth)]

    def __len__(self) -> int:
        return len(self.rounds)

    def run(self) -> None:
        """Exchange now, in this thread (no hand-off to the progress thread)."""
        for shares in self.rounds:
            outs = self._issue(shares, async_op=False)[1]
            self._unpack(shares, outs)

    def start(self) -> list[tuple[Work | None, list[torch.Tensor], list[_Share]]]:
        """Queue every round on the progress thread; :meth:`finish` completes them."""
        return [(*self._issue(shares, async_op=True), shares) for shares in self.rounds]

    def finish(self, pending: list[tuple[Work | None, list[torch.Tensor], list[_Share]]]) -> None:
        for work, outs, shares in pending:
            if work is not None:
                work.wait()
            self._unpack(shares, outs)

    def _view(self, share: _Share) -> torch.Tensor:
        assert share.direct is not None
        base, a, b = share.direct
        return self.bases[base][a:b]

    def _issue(self, shares: list[_Share], async_op: bool) -> tuple[Work | None, list[torch.Tensor]]:
        me = self.group.group_rank
        outs = [self._view(s) if s.direct is not None else torch.empty(s.nbytes, dtype=torch.uint8)
                for s in shares]
        mine = shares[me]
        if mine.direct is None:
            at = 0
            for i, a, b in mine.packed:
                outs[me][at:at + b - a].copy_(_bytes(self.params[i])[a:b])
                at += b - a
        return all_gather(outs, outs[me], group=self.group, async_op=async_op), outs

    def _unpack(self, shares: list[_Share], outs: list[torch.Tensor]) -> None:
        me = self.group.group_rank
        with torch.no_grad():
            for r, (share, out) in enumerate(zip(shares, outs)):
                if r == me or share.direct is not None:
                    continue
                at = 0
                for i, a, b in share.packed:
                    p, piece = self.params[i].detach(), out[at:at + b - a]
                    if p.is_contiguous():
                        p.reshape(-1).view(torch.uint8)[a:b].copy_(piece)
                    else:  # packed whole (see _shares); clone: the offset may not be aligned
                        p.copy_(piece.clone().view(p.dtype).view(p.shape))
                    at += b - a
