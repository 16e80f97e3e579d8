"""The flight recorder: the last calls of one process group, as they happen.

Every collective and point-to-point call on a group leaves a :class:`Call` in its
group's ring of ``TANDEM_FLIGHT_RECORDER`` entries (2000 by default; 0 turns it
off). A call moves through the states ``queued`` (issued; an ``async_op=True`` call
waits here for the group's progress engine), ``started``, then ``completed`` or
``failed``, with a timestamp at each step. The watchdog reads the ring to find
stalled calls (:mod:`tandem.collectives.stall_report`), the dump writes it out as JSON
(:mod:`tandem.collectives.dump`), the timeline turns finished calls into spans
(:mod:`tandem.collectives.timeline`), and :func:`tandem.stats` sums it up::

    >>> tandem.stats()["default"]["all_reduce"]
    OpStats(count=120, bytes=491520, seconds=0.0131, failed=0)

Recording is on the latency path of every call: a blocking collective pays one small
list (:data:`RECORD_FIELDS`) stored at ``ring[seq % capacity]`` and one clock read,
written out in ``ProcessGroup._execute`` (the ``[recorder]`` lines); its state follows
from its times, per-op totals are added once per lap (:meth:`Recorder.lap`), and the
ring doubles as the transport's record of completed calls (:meth:`Recorder.completed`).
That keeps it near 1-2% of a 4 KB all_reduce (``python -m tandem.bench recorder``);
the measurements behind each choice are in ``docs/design.md``, "Flight recorder".

Calls on one group are issued one at a time, so the collective path needs no lock;
point-to-point calls complete on transport threads and take one for the counters.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
import time
from typing import Any, Callable, Protocol

import torch
import torch.autograd.profiler as _torch_profiler

__all__ = ["Call", "Recorder", "OpStats", "QUEUED", "STARTED", "COMPLETED", "FAILED",
           "RECORD_FIELDS", "STATE_NAMES", "clock", "payload_bytes"]

QUEUED, STARTED, COMPLETED, FAILED = 0, 1, 2, 3
STATE_NAMES = ("queued", "started", "completed", "failed")
# A recorded collective is one list of these, in this order (see Recorder)
# ("t_end" holds the running op until the call ends)
RECORD_FIELDS = ("seq", "op", "sig", "site", "nbytes", "t_issued", "t_start", "t_end", "error")
# The clock of every timestamp here, of deadlines (a call's start is its deadline's
# reading) and of DDP's own timings. On Linux it is the clock of time.perf_counter too.
clock = time.monotonic
_profiling = torch._C._autograd._profiler_enabled  # per thread, as record_function records
_new = object.__new__


class Call:
    """One call as recorded: what it was, where it was called, and how far it got.

    ``seq`` is the group's sequence number of a collective (-1 for point-to-point);
    ``peer`` is the other side's global rank for point-to-point (-1 for a receive from
    any rank, and for collectives). A recorded call stores only what differs from the
    class-level defaults below: recording runs on the latency path of every call.
    """

    op: str
    seq: int
    sig: bytes
    site: bytes
    nbytes = 0
    peer = -1
    tag = 0
    t_issued = 0.0  # when a call that waited in the group's queue was issued
    t_start = 0.0
    t_end = 0.0  # set last: a reader that sees it sees the call's error too
    deadline = 0.0  # clock() at which the call fails, once started
    error = ""
    warned = 0  # stall warnings logged so far
    phases: list[tuple[float, float]] | None = None  # waits, while a timeline runs
    profile: Any = None  # the open torch.profiler range
    thread = 0  # the thread that ran it, while a timeline runs

    @property
    def t_queued(self) -> float:
        """When the call was issued: its start, unless it waited in the queue first."""
        return self.t_issued or self.t_start

    @property
    def state(self) -> int:
        """QUEUED, STARTED, COMPLETED or FAILED, from the times and error set so far."""
        if self.t_end:
            return FAILED if self.error else COMPLETED
        return STARTED if self.t_start else QUEUED

    @property
    def is_p2p(self) -> bool:
        return self.op in ("send", "recv")

    def what(self) -> str:
        """``all_reduce #7`` or ``recv from rank 1 (tag 0)``: the call in a few words."""
        if self.op == "send":
            return f"send to rank {self.peer} (tag {self.tag})"
        if self.op == "recv":
            src = "any rank" if self.peer < 0 else f"rank {self.peer}"
            return f"recv from {src} (tag {self.tag})"
        return f"{self.op} #{self.seq}"


class Spans(Protocol):
    """Where a recorder sends finished calls while a timeline runs, and DDP its phases
    (:class:`tandem.collectives.timeline.Timeline`, which renders the recorder's calls)."""

    def call(self, call: Call, group: str) -> None: ...

    def span(self, name: str, t0: float, t1: float, cat: str = ...,
             args: dict[str, Any] | None = ...) -> None: ...

    def ddp_backward(self, t_backward: float, t_compute_end: float, t_waited: float,
                     t_end: float, buckets: list[tuple[int, int, float, float]]) -> None: ...


@dataclasses.dataclass(frozen=True)
class OpStats:
    """Totals of one operation on one group: calls finished, bytes, seconds, failures."""

    count: int
    bytes: int
    seconds: float
    failed: int


def payload_bytes(result: Any) -> int:
    """Bytes of the tensors a call returns (its ``result`` list), 0 when it has none."""
    if type(result) is list:
        if len(result) == 1:
            t = result[0]
            return t.nbytes if isinstance(t, torch.Tensor) else 0
        return sum(t.nbytes for t in result if isinstance(t, torch.Tensor))
    return 0


class Recorder:
    """The ring of one group's last ``capacity`` calls and its per-op totals.

    A collective is recorded by its group (``ProcessGroup._execute``) while ``capacity``
    is not 0, as one list, ``[seq, op, sig, site, nbytes, t_issued, t_start, t_end,
    error]`` (:data:`RECORD_FIELDS`) at ``ring[seq % capacity]`` (:meth:`lap` first when
    that index is 0). Until the call ends, ``t_end`` (index 7) holds its :class:`Call`
    (the op, whose deadline a call may move); the call keeps its list and replaces that
    with its end time when it returns (:meth:`fail` when it raises: ``error`` first,
    then ``t_end``), which lets the op go. An ``async_op=True`` call's list is made when
    it is queued (:meth:`queued`), and its ``t_start`` (index 6) set when it starts.
    While a timeline or a torch profiler runs (``timeline`` is set, or torch's
    ``_is_profiler_enabled``), the group also calls :meth:`watch` and :meth:`unwatch`
    with the op.

    Readers copy the ring and make a :class:`Call` of each record; one that sees
    ``t_end`` set sees the call's error too, and no record is ever rewritten for
    another call, so a reader never mixes two calls up.

    ``timeline`` (set while a timeline runs) receives every finished call;
    ``on_failure(reason)`` is called when a call fails (the process's dumper).
    """

    def __init__(self, capacity: int, name: str = "") -> None:
        self.capacity = capacity
        self.slots = capacity  # the rings' length once full: stays while capacity is toggled
        self.name = name  # the group's
        # collectives, at seq % capacity; both rings grow as calls are recorded (made in
        # full at creation, two 2,000-slot lists cost every group ~16 page faults at start-up)
        self.ring: list[list[Any] | None] = []
        self._views: dict[int, Call] = {}  # seq -> a reader's view of an unfinished call
        self._p2p: list[Call | None] = []
        self._p2p_next = itertools.count()  # next() is atomic: p2p calls record from any thread
        self._totals: dict[str, list[Any]] = {}  # op -> see _add
        self._folded = 0  # collectives below this sequence number are in _totals or _late
        self._late: list[list[Any]] = []  # collectives still running when their lap was added up
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self.timeline: Spans | None = None
        self.on_failure: Callable[[str], object] | None = None

    # -- the collective path (the rest is written out in ProcessGroup._execute) --------
    def queued(self, call: Call, result: Any, nbytes: int = -1) -> list[Any] | None:
        """Record the collective ``call`` as issued to the group's queue (async_op=True);
        return its record (None when recording is off).

        The call's bytes are ``nbytes``, or when that is -1 those of ``result``, the list
        of tensors it returns.
        """
        capacity = self.capacity
        if not capacity:
            return None
        seq = call.seq
        record = [seq, call.op, call.sig, call.site,
                  nbytes if nbytes >= 0 else payload_bytes(result), clock(), 0.0, call, ""]
        i = seq % capacity
        if not i:
            self.lap(seq)
        try:
            self.ring[i] = record
        except IndexError:  # the ring's first lap
            self.grow(i, record)
        return record

    def grow(self, i: int, record: list[Any]) -> None:
        """Store ``record`` at slot ``i``, past the ring's end: the ring grows to it (only
        the group's own thread records collectives)."""
        ring = self.ring
        ring.extend([None] * (i - len(ring)))
        ring.append(record)

    def lap(self, seq: int) -> None:
        """The ring is about to overwrite its oldest lap with collective ``seq``: add up
        the finished calls before it (running ones wait in a list until they end)."""
        with self._lock:
            done = [r for r in self._late if _ended(r)]
            self._late = [r for r in self._late if not _ended(r)]
            if not self._add_whole_lap(seq):
                for r in self.ring:
                    if r is not None and self._folded <= r[0] < seq:
                        (done if _ended(r) else self._late).append(r)
            for r in done:
                _add_record(self._totals, r)
            self._folded = seq

    def _add_whole_lap(self, seq: int) -> bool:
        """Add up the ring in a few passes in C if every record in it is still to be
        added up, ended, and of one op (the common case: a training loop's
        all_reduce); else return False, adding nothing. A record at a time cost 0.37 us
        per call, these passes 0.16 us (2,000 records in a tight loop, machine under
        load). In place (``python -m tandem.bench recorder``'s laps) the passes take
        0.33 us per call; turning the ring into one tuple per field first (``zip``) was
        faster in a tight loop and slower in place (0.38-0.45 us: 2,000 iterators and
        nine tuples made per lap), and counting without a list (``countOf``) saves a
        little (0.33 against 0.34 us)."""
        ring: list[Any] = self.ring  # a None in it stops the first pass (TypeError)
        if not ring:  # the first call: nothing to add up
            return True
        try:
            # no slot holds a later call than seq - 1, and each holds another call
            if min(map(_SEQ, ring)) < self._folded:  # TypeError: an empty slot
                return False
            op = ring[0][1]
            if _count_of(map(_OP, ring), op) != len(ring):
                return False
            seconds = sum(map(_END, ring)) - sum(map(_START, ring))
        except TypeError:  # an empty slot, or a running call's op where its end will be
            return False
        t = self._totals.get(op)
        if t is None:
            t = self._totals[op] = [0, 0, 0.0, 0]
        t[0] += len(ring)
        t[1] += sum(map(_BYTES, ring))
        t[2] += seconds
        t[3] += len(ring) - _count_of(map(_ERROR, ring), "")
        return True

    def watch(self, call: Call) -> None:
        """The call starts while a timeline or a profiler runs: give it phases, and a
        profiler range if torch's profiler records this thread."""
        if self.timeline is not None:
            call.phases = []
            call.thread = threading.get_ident()
        if _torch_profiler._is_profiler_enabled and _profiling():
            # torch.profiler records this thread: show the call as a range
            call.profile = torch.profiler.record_function(f"tandem.{call.op}")
            call.profile.__enter__()

    def unwatch(self, call: Call, record: list[Any]) -> None:
        """The watched call ended (its ``record`` is complete): close its range, hand it to
        the timeline."""
        if call.profile is not None:
            call.profile.__exit__(None, None, None)
            call.profile = None
        if self.timeline is not None:
            call.nbytes, call.t_issued, call.t_start, call.t_end, call.error = record[4:]
            self.timeline.call(call, self.name)

    def fail(self, call: Call, record: list[Any], error: BaseException,
             watched: bool = False) -> None:
        """The recorded collective ``call`` (its record ``record``) raised ``error``
        (``watched``: it was started watched)."""
        record[8] = f"{type(error).__name__}: {error}"
        record[7] = clock()  # after the error: a reader that sees one sees both
        if watched:
            self.unwatch(call, record)
        if self.on_failure is not None:
            self.on_failure(f"{call.what()} failed: {record[8]}")

    # -- the transport's view (strays: see tandem.transport.mismatch.History) ---------
    def completed(self, seq: int) -> tuple[bytes, bytes] | None:
        """(signature, call site) of collective ``seq`` if this rank completed it and the
        ring knows: its own record, ended without an error, or a later call that started
        (calls run in order; one still queued proves nothing, as queued calls are
        recorded when issued); None if not (yet), or not known. Any thread may ask."""
        ring = self.ring
        if not ring:
            return None
        i = seq % self.slots  # not ``capacity``, which may be toggled
        r = ring[i] if i < len(ring) else None  # past its end: not recorded yet
        if r is None or r[0] < seq:
            return None
        if r[0] == seq:
            if type(r[7]) is float and not r[8]:  # the end before the error: set last
                return r[2], r[3]
            return None
        if r[6] or any(x is not None and x[0] > seq and x[6] for x in ring[:]):
            return _EARLIER
        return None

    def last_completed(self, n: int) -> list[tuple[int, bytes, bytes]]:
        """(seq, signature, call site) of the last ``n`` collectives completed here,
        oldest first (those the ring still holds)."""
        done = sorted((r[0], r[2], r[3]) for r in self.ring[:]
                      if r is not None and type(r[7]) is float and not r[8])
        return done[-n:] if n else []

    # -- point-to-point ------------------------------------------------------------------
    def begin_p2p(self, op: str, peer: int, tag: int, nbytes: int, site: str) -> Call | None:
        """Record a send or receive as posted (it runs from then on)."""
        capacity = self.capacity
        if not capacity:
            return None
        call = _new(Call)
        call.op = op
        call.seq = -1
        call.sig = b""
        call.site = site.encode()
        call.nbytes = nbytes
        call.peer = peer
        call.tag = tag
        call.t_start = clock()
        i = next(self._p2p_next) % capacity
        try:
            self._p2p[i] = call
        except IndexError:  # the ring's first lap: grow it to i (calls come from any thread)
            with self._lock:
                p2p = self._p2p
                p2p.extend([None] * (i + 1 - len(p2p)))
                p2p[i] = call
        return call

    def end_p2p(self, call: Call, error: BaseException | None = None) -> None:
        """The send or receive finished (``error``: it failed with it)."""
        if error is not None:
            call.error = f"{type(error).__name__}: {error}"
        call.t_end = clock()
        with self._lock:  # transport threads end them, concurrently
            _add(self._totals, call.op, call.nbytes, call.t_end - call.t_start, bool(call.error))
        if self.timeline is not None:
            self.timeline.call(call, self.name)
        if error is not None and self.on_failure is not None:
            self.on_failure(f"{call.what()} failed: {call.error}")

    # -- readers (the watchdog, dumps, stats) ----------------------------------------
    def _collectives(self, running_only: bool = False) -> list[Call]:
        """The recorded collectives (``running_only``: those not ended), each a
        :class:`Call` made from its record; an unfinished call keeps one view while it
        runs (the watchdog counts its warnings on it)."""
        records = [r for r in self.ring[:] if r is not None]  # one copy: the group goes on
        if running_only:  # the watchdog's look every second: no view of the ended ones
            records = [r for r in records if not _ended(r)]
        with self._read_lock:  # the watchdog and the store thread both read
            out, running = [], {}
            for r in records:
                seq, end = r[0], r[7]  # the end before the error: it is set last
                ended = type(end) is float
                c = None if ended else self._views.get(seq)
                if c is None:
                    c = _new(Call)
                    c.seq, c.op, c.sig, c.site, c.nbytes, c.t_issued = r[:6]
                c.t_start = r[6]
                if ended:
                    c.error = r[8]
                    c.t_end = end
                else:
                    c.deadline = end.deadline  # the running op's: a call may move it
                    running[seq] = c
                out.append(c)
            self._views = running
        return out

    def _p2p_calls(self) -> list[Call]:
        return [c for c in self._p2p[:] if c is not None]

    def calls(self) -> list[Call]:
        """The recorded calls, oldest first."""
        return sorted([*self._collectives(), *self._p2p_calls()], key=_issue_order)

    def in_flight(self) -> list[Call]:
        """Calls issued or running, oldest first."""
        calls = [*self._collectives(running_only=True), *self._p2p_calls()]
        return sorted((c for c in calls if not c.t_end), key=_issue_order)

    @property
    def issued(self) -> int:
        """Collective calls recorded on the group so far (the next sequence number)."""
        return max((r[0] for r in self.ring[:] if r is not None), default=-1) + 1

    def totals(self) -> dict[str, OpStats]:
        with self._lock:
            totals = {op: list(t) for op, t in self._totals.items()}
            # the current lap's finished calls count in this copy: only the group's own
            # thread adds them up (in lap), under this lock
            current = [r for r in self.ring[:] if r is not None and r[0] >= self._folded]
            for r in [*current, *self._late]:
                if _ended(r):
                    _add_record(totals, r)
        return {op: OpStats(int(t[0]), int(t[1]), float(t[2]), int(t[3]))
                for op, t in sorted(totals.items())}


def _issue_order(c: Call) -> tuple[float, int]:
    return c.t_queued, c.seq


_SEQ, _OP, _BYTES, _START, _END, _ERROR = map(operator.itemgetter, (0, 1, 4, 6, 7, 8))
_count_of = operator.countOf
_EARLIER = (b"an earlier collective", b"?")


def _ended(record: list[Any]) -> bool:
    return type(record[7]) is float  # else it holds the running op


def _add_record(totals: dict[str, list[Any]], r: list[Any]) -> None:
    """Add the finished collective recorded as ``r`` to ``totals``."""
    _add(totals, r[1], r[4], r[7] - r[6], bool(r[8]))


def _add(totals: dict[str, list[Any]], op: str, nbytes: int, seconds: float,
         failed: bool) -> None:
    """Add one finished call to ``totals`` (op -> [count, bytes, seconds, failed])."""
    t = totals.get(op)
    if t is None:
        t = totals[op] = [0, 0, 0.0, 0]
    t[0] += 1
    t[1] += nbytes
    t[2] += seconds
    if failed:
        t[3] += 1
