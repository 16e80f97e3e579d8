"""Which worker lines the launcher's console shows, merged, and when: no threads, no I/O.

Identical lines that several ranks print on the same stream at about the same time
become one line, ``[rank0-3]: usage: train.py [-h] ...``, so a script's ``--help``, an
argparse error or a warning every rank prints appears once. :class:`Merger` keeps the
lines of both streams (stdout, stderr) that arrived but are not shown yet, in arrival
order, so that one stream's held lines are not overtaken by the other's::

    m = Merger()
    m.attach(0, "stdout"); m.attach(1, "stdout")    # the ranks whose stream is open
    m.line(0, "stdout", "usage: x", now)          # held: rank 1 may print the same
    m.line(1, "stdout", "usage: x", now + 0.2)    # merged: every open stream had it
    [(e.ranks, e.text) for e in m.due(now + 0.21)]   # [({0, 1}, "usage: x")]

The promises, each bounded:

* A line waits at most :data:`WINDOW` seconds for the same line from other ranks,
  less when every rank whose stream is open has printed it. A rank that printed
  :data:`SOLO_AFTER` lines in a row that no other rank printed (rank 0's progress, as a
  rule) is *solo*: its lines go out at once, until another rank repeats one of its
  recent lines.
* A rank's own lines keep their order on each stream: a line merges only into an
  entry after the last one holding that rank's previous line on that stream. Entries go out in arrival order, so a
  line never waits behind another for longer than that one's window.
* A block a rank printed at once (lines :data:`BURST` apart at most: one write) stays
  whole: when it stops matching the other ranks' blocks, its lines that had merged
  are taken back out. Two different tracebacks thus keep their own first line,
  instead of sharing one ``[rank0-1]: Traceback (most recent call last):``.
* At most :data:`MAX_PENDING` entries wait; past that the oldest goes out at once.
* A redraw (the text after a carriage return: a progress bar) is never merged or held;
  a newer redraw of the same rank replaces one not yet shown.

``WINDOW`` is set by what was measured on a loaded 2-core machine: four ranks that
import torch and then print the same argparse error printed it up to 0.77 s apart
(``--help``: 0.27 s).
"""

from __future__ import annotations

import collections
import dataclasses

from tandem.collectives.trace_files import rank_list

__all__ = ["Merger", "Entry", "WINDOW", "SOLO_AFTER", "BURST", "MAX_PENDING", "rank_ranges"]

WINDOW = 1.0  # seconds a line may wait for its twins
BURST = 0.005  # seconds between two lines of a rank that came from one write
SOLO_AFTER = 2  # unrepeated lines in a row after which a rank's lines are not held
LATE = 5.0  # seconds after which a repeat of a shown line no longer counts as a twin
MAX_PENDING = 1000
RECENT = 256  # shown lines remembered, to notice twins that came too late


@dataclasses.dataclass
class Entry:
    """One line (or redraw) to show on ``stream``, with every rank that printed it."""

    stream: str
    text: str
    ranks: set[int]
    redraw: bool
    due: float  # when it goes out unless every open stream has printed it before
    arrived: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> when

    def ready(self, now: float, open_ranks: set[int]) -> bool:
        """Due, or printed by every open stream (and that rank's block is over)."""
        return self.due <= now or (self.ranks >= open_ranks and now >= self._complete_at())

    def next_time(self, open_ranks: set[int]) -> float:
        return min(self.due, self._complete_at()) if self.ranks >= open_ranks else self.due

    def _complete_at(self) -> float:
        return max(self.arrived.values(), default=0.0) + BURST


def rank_ranges(ranks: set[int] | frozenset[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``0-2,5``: the ranks of a line's prefix, ``[rank0-2,5]: ``."""
    return rank_list(ranks).replace(" ", "")


class Merger:
    """See the module docstring; the caller serialises calls and supplies the clock."""

    def __init__(self, window: float = WINDOW, solo_after: int = SOLO_AFTER) -> None:
        self.window = window
        self.solo_after = solo_after
        self.open: dict[str, set[int]] = {}  # stream -> ranks whose pipe is open
        self.pending: collections.deque[Entry] = collections.deque()
        self._alone: dict[int, int] = {}  # rank -> lines in a row shown for it alone
        self._recent: collections.OrderedDict[tuple[str, str], tuple[float, frozenset[int]]] = (
            collections.OrderedDict())

    def attach(self, rank: int, stream: str) -> None:
        self.open.setdefault(stream, set()).add(rank)

    def detach(self, rank: int, stream: str) -> None:
        """The rank's stream ended: lines waiting for it need not wait any more."""
        self.open.get(stream, set()).discard(rank)

    def line(self, rank: int, stream: str, text: str, now: float) -> None:
        for entry in self._after_last_of(rank, stream):
            if not entry.redraw and entry.text == text and rank not in entry.ranks:
                entry.ranks.add(rank)
                entry.arrived[rank] = now
                return
        self._take_back_block(rank, stream, now)
        seen = self._recent.get((stream, text))
        if seen is not None and now - seen[0] < LATE and rank not in seen[1]:
            for twin in seen[1]:  # it came too late to merge: hold their lines again
                self._alone[twin] = 0
        self._own_line(rank, stream, text, now)

    def _own_line(self, rank: int, stream: str, text: str, now: float) -> None:
        solo = self._alone.get(rank, 0) >= self.solo_after
        due = now if solo else now + self.window
        self.pending.append(Entry(stream, text, {rank}, False, due, {rank: now}))

    def _take_back_block(self, rank: int, stream: str, now: float) -> None:
        """The rank's block stopped matching the others': its lines of the same block
        that merged are taken out of the shared entries and queued as its own."""
        block: list[Entry] = []
        later = now
        for entry in reversed(self.pending):
            if rank not in entry.ranks or entry.stream != stream:
                continue
            if len(entry.ranks) == 1 or later - entry.arrived[rank] > BURST:
                break
            block.append(entry)
            later = entry.arrived[rank]
        for entry in reversed(block):
            entry.ranks.discard(rank)
            self._own_line(rank, stream, entry.text, entry.arrived.pop(rank))

    def redraw(self, rank: int, stream: str, text: str, now: float) -> None:
        last = self.pending[-1] if self.pending else None
        if last is not None and last.redraw and last.ranks == {rank} and last.stream == stream:
            last.text = text  # only the newest state of a bar matters
            return
        self.pending.append(Entry(stream, text, {rank}, True, now, {rank: now}))

    def _after_last_of(self, rank: int, stream: str) -> list[Entry]:
        """The pending entries of ``stream`` after the last one holding ``rank``."""
        entries = [e for e in self.pending if e.stream == stream]
        for i in range(len(entries) - 1, -1, -1):
            if rank in entries[i].ranks:
                return entries[i + 1:]
        return entries

    def next_due(self) -> float | None:
        """When the oldest entry goes out (None: nothing waits)."""
        if not self.pending:
            return None
        head = self.pending[0]
        return head.next_time(self.open.get(head.stream, set()))

    def due(self, now: float) -> list[Entry]:
        """Take the entries to show now, in order."""
        out: list[Entry] = []
        while self.pending:
            head = self.pending[0]
            if (head.ready(now, self.open.get(head.stream, set()))
                    or len(self.pending) > MAX_PENDING):
                out.append(self._shown(self.pending.popleft(), now))
            else:
                break
        return out

    def drain(self, now: float) -> list[Entry]:
        """Take every entry, due or not (the launcher is about to print its own lines)."""
        out = [self._shown(e, now) for e in self.pending]
        self.pending.clear()
        return out

    def _shown(self, entry: Entry, now: float) -> Entry:
        if entry.redraw:
            return entry
        if len(entry.ranks) == 1:
            (rank,) = entry.ranks
            self._alone[rank] = self._alone.get(rank, 0) + 1
        else:
            for rank in entry.ranks:
                self._alone[rank] = 0
        key = (entry.stream, entry.text)
        self._recent[key] = (now, frozenset(entry.ranks))
        self._recent.move_to_end(key)
        while len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        return entry
