"""The flight recorder: the last calls of one process group, as they happen.

Every collective and point-to-point call on a group leaves a :class:`Call` in its
group's ring of ``TANDEM_FLIGHT_RECORDER`` entries (2000 by default; 0 turns it
off). A call moves through the states ``queued`` (issued; an ``async_op=True`` call
waits here for the group's progress engine), ``started``, then ``completed`` or
``failed``, with a timestamp at each step. The watchdog reads the ring to find
stalled calls (:mod:`tandem.collectives.stall`), the dump writes it out as JSON
(:mod:`tandem.collectives.dump`), the timeline turns finished calls into spans
(:mod:`tandem.collectives.timeline`), and :func:`tandem.stats` sums it up::

    >>> tandem.stats()["default"]["all_reduce"]
    OpStats(count=120, bytes=491520, seconds=0.0131, failed=0)

Recording is on the latency path of every call, so it is kept to plain attribute
stores: a collective's op is its own record (a point-to-point call gets one small
object), one list store into the ring, three clock reads; per-op totals are added up
every ``FOLD_EVERY`` calls.
``python -m tandem.bench recorder`` measures what it costs against a 4 KB
all_reduce.

Calls on one group run one at a time, so the collective path needs no lock;
point-to-point calls complete on transport threads and take one for the counters.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.autograd.profiler as _torch_profiler

if TYPE_CHECKING:
    from tandem.collectives.timeline import Timeline

__all__ = ["Call", "Recorder", "OpStats", "QUEUED", "STARTED", "COMPLETED", "FAILED",
           "STATE_NAMES", "clock", "payload_bytes"]

QUEUED, STARTED, COMPLETED, FAILED = 0, 1, 2, 3
STATE_NAMES = ("queued", "started", "completed", "failed")
FOLD_EVERY = 64  # collectives whose totals are added up at once (see Recorder.end)
clock = time.perf_counter  # the clock of every timestamp here (and of DDP's own timings)
_profiling = torch._C._autograd._profiler_enabled  # per thread, as record_function records
_new = object.__new__


class Call:
    """One call as recorded: what it was, where it was called, and how far it got.

    ``seq`` is the group's sequence number of a collective (-1 for point-to-point);
    ``peer`` is the other side's global rank for point-to-point (-1 for a receive from
    any rank, and for collectives). Made by :meth:`Recorder.begin`, which stores only
    what differs from the class-level defaults below: recording runs on the latency
    path of every call.
    """

    index: int  # position in its recorder's order of calls
    op: str
    seq: int
    sig: bytes
    site: bytes
    nbytes: int
    t_queued: float
    peer = -1
    tag = 0
    state = QUEUED
    t_start = 0.0
    t_end = 0.0
    deadline = 0.0  # time.monotonic() at which the call fails, once started
    error = ""
    warned = 0  # stall warnings logged so far
    phases: list[tuple[float, float]] | None = None  # waits, while a timeline runs
    profile: Any = None  # the open torch.profiler range
    thread = 0  # the thread that ran it, while a timeline runs

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

    ``timeline`` (set while a timeline runs) receives every finished call;
    ``on_failure(reason)`` is called when a call fails (the process's dumper).
    """

    def __init__(self, capacity: int, name: str = "") -> None:
        self.capacity = capacity
        self.name = name  # the group's
        self._ring: list[Call | None] = [None] * capacity
        self._next = itertools.count()  # next() is atomic: p2p calls record from any thread
        self._totals: dict[str, list[Any]] = {}  # op -> see _add_up
        self._ended: list[Call] = []  # collectives ended since the last _fold
        self._lock = threading.Lock()
        self.issued = 0  # collective calls issued on the group (the next sequence number)
        self.timeline: Timeline | None = None
        self.on_failure: Callable[[str], object] | None = None

    # -- the call path ---------------------------------------------------------------
    def begin(self, call: Call, result: Any, nbytes: int = -1, running: bool = False) -> bool:
        """Record the collective ``call`` (its group's :class:`~tandem.collectives.group.Op`,
        which is its own record) as issued, or with ``running`` as issued and started at
        once; False when recording is off.

        The call's bytes are ``nbytes``, or when that is -1 those of ``result``, the list
        of tensors it returns.
        """
        capacity = self.capacity
        if not capacity:
            return False
        call.nbytes = nbytes if nbytes >= 0 else payload_bytes(result)
        call.t_queued = now = clock()
        call.index = i = next(self._next)
        self._ring[i % capacity] = call
        self.issued = call.seq + 1
        if running:  # one clock read and one call fewer for a call that runs at once
            call.state = STARTED
            call.t_start = now
            if self.timeline is not None or _torch_profiler._is_profiler_enabled:
                self._watch(call)
        return True

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
        call.state = STARTED
        call.t_start = call.t_queued = clock()
        call.index = i = next(self._next)
        self._ring[i % capacity] = call
        return call

    def start(self, call: Call) -> None:
        """The collective ``call``, queued until now, starts running in this thread."""
        call.state = STARTED
        call.t_start = clock()
        if self.timeline is not None or _torch_profiler._is_profiler_enabled:
            self._watch(call)

    def _watch(self, call: Call) -> None:
        # a timeline or a profiler runs (torch's own flag says cheaply whether any does)
        if self.timeline is not None:
            call.phases = []
            call.thread = threading.get_ident()
        if _profiling():  # torch.profiler records this thread: show the call as a range
            call.profile = torch.profiler.record_function(f"tandem.{call.op}")
            call.profile.__enter__()

    def end(self, call: Call, error: BaseException | None = None) -> None:
        """The call finished (``error``: it failed with it)."""
        call.t_end = clock()
        if call.profile is not None:
            call.profile.__exit__(None, None, None)
            call.profile = None
        if error is None and call.seq >= 0:
            # the common case. Collectives on a group end one at a time, and their
            # totals are added up FOLD_EVERY calls at once: counting each call as it
            # ended cost ~0.3 us more per small call (measured in place)
            call.state = COMPLETED
            ended = self._ended
            ended.append(call)
            if len(ended) >= FOLD_EVERY:
                self._fold()
        else:
            self._end_slow(call, error)
        if self.timeline is not None:
            self.timeline.call(call, self.name)

    def _fold(self) -> None:
        with self._lock:
            _add_up(self._totals, self._ended)
            self._ended.clear()

    def _end_slow(self, call: Call, error: BaseException | None) -> None:
        # point-to-point calls end on transport threads, concurrently; failures are rare
        with self._lock:
            _add_up(self._totals, [call])
            if error is not None:
                self._totals[call.op][3] += 1
        if error is None:
            call.state = COMPLETED
            return
        call.error = f"{type(error).__name__}: {error}"
        call.state = FAILED
        if self.on_failure is not None:
            self.on_failure(f"{call.what()} failed: {call.error}")

    # -- readers (the watchdog, dumps, stats) ----------------------------------------
    def calls(self) -> list[Call]:
        """The recorded calls, oldest first."""
        ring = list(self._ring)  # one copy: writers keep going meanwhile
        return sorted((c for c in ring if c is not None), key=lambda c: c.index)

    def in_flight(self) -> list[Call]:
        """Calls issued or running, oldest first."""
        ring = list(self._ring)
        return sorted((c for c in ring if c is not None and c.state < COMPLETED),
                      key=lambda c: c.index)

    def totals(self) -> dict[str, OpStats]:
        with self._lock:
            totals = {op: list(t) for op, t in self._totals.items()}
            # collectives ended since the last fold count in this copy: only their
            # writer folds them (it appends without the lock, folds with it)
            _add_up(totals, list(self._ended))
        return {op: OpStats(int(t[0]), int(t[1]), float(t[2]), int(t[3]))
                for op, t in sorted(totals.items())}


def _add_up(totals: dict[str, list[Any]], calls: list[Call]) -> None:
    """Add finished ``calls`` to ``totals`` (op -> [count, bytes, seconds, failed])."""
    for c in calls:
        t = totals.get(c.op)
        if t is None:
            t = totals[c.op] = [0, 0, 0.0, 0]
        t[0] += 1
        t[1] += c.nbytes
        t[2] += c.t_end - c.t_start
