"""``ProcessGroup``: a set of ranks, its progress engine and the per-call ``Op`` context.

Collectives on one group complete in issue order. A blocking call runs inline in
the caller's thread when nothing is queued (no thread hand-off on the latency
path); ``async_op=True`` calls are queued to the group's progress engine, one
daemon thread per group, started on first use.

Any failure that leaves ranks out of step (a signature mismatch, a timeout, a
lost peer) *aborts* the group: every member is told and raises the same error,
and later calls on the group fail at once instead of hanging. ``close`` (called by
``destroy_process_group``) fails what is still pending at once with ``StateError``
and ends the group's threads and shared memory.
"""

from __future__ import annotations

import collections
import errno
import hashlib
import logging
import threading
import time
import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.autograd.profiler as _torch_profiler

from tandem._words import in_order
from tandem.config import Settings, size_text
from tandem.errors import (ArgumentError, CollectiveError, CollectiveMismatchError,
                           CollectiveTimeoutError, StateError, TandemError)
from tandem.collectives.backend import HOST_ARENA_KEY
from tandem.collectives.recorder import Call, Recorder, clock, payload_bytes
from tandem.collectives.work import Completions, Work
from tandem.transport import Arena, Header, Kind, Slot, Transport

__all__ = ["ProcessGroup", "NonMemberGroup", "Op", "as_bytes", "bounded", "spans_hosts",
           "kept_per_group", "host_layout", "host_shares_memory"]

# enum members as module constants: looking one up on its class costs ~10x a global
_COLL = Kind.COLL
_P2P = Kind.P2P

_SCRATCH_KEEP = 256 << 20  # larger working buffers are not kept between calls
_TEXT_KEEP = 1024  # bytes of a signature or call site kept as text; the rest is hashed
NON_GROUP_MEMBER = -100  # torch's value for "not a member"; a NonMemberGroup equals it
_LOGGER = logging.getLogger("tandem")
_UNRECEIVED_LISTED = 8  # sender/tag pairs a warning names; the rest are counted
_CLOSE_S = 1.0  # how long close() waits for the running call to fail and return
_SETTLE_TICK_S = 0.1  # how often close's wait for confirmations looks for a failure


def _first_tensors() -> None:
    """Make the kinds of tensor init and a first barrier make (empty, zeroed, viewing a
    buffer): torch sets up state at a process's first ones, which a worker forked from a
    process that imported tandem (tandemrun's zygote) then inherits instead of redoing."""
    torch.frombuffer(bytearray(8), dtype=torch.uint8)[:4].view(torch.int32)
    torch.zeros(1, dtype=torch.uint8)
    torch.empty(0, dtype=torch.uint8)


_first_tensors()


def bounded(text: str) -> bytes:
    """``text`` encoded, with anything beyond ~1 KiB replaced by its hash.

    Signatures carry per-rank lists (sizes of every rank's tensors) that grow with
    the group; every rank shortens alike, so equal calls still compare equal and
    different ones still differ, and a message always fits its frame.
    """
    data = text.encode()
    if len(data) <= _TEXT_KEEP:
        return data
    digest = hashlib.blake2b(data, digest_size=16).hexdigest().encode()
    return data[:_TEXT_KEEP - len(digest) - 5] + b"...#" + digest


_ENCODED: dict[str, bytes] = {}  # text -> bounded(text), for the texts calls repeat


def bounded_cached(text: str) -> bytes:
    """:func:`bounded`, remembered for up to 4096 texts: a call's signature and site come
    from caches, so every call of a training loop reuses one bytes object for each."""
    data = _ENCODED.get(text)
    if data is None:
        data = bounded(text)
        if len(_ENCODED) < 4096:
            _ENCODED[text] = data
    return data


_SITED: dict[tuple[str, str], bytes] = {}  # (signature, site) -> both as one signature


def _sited(sig: str, site: str) -> bytes:
    """The signature compared under ``TANDEM_CHECK_CALL_SITES``: the call's with its site
    (looked up by the pair, whose hashes Python keeps: no new string per call)."""
    key = (sig, site)
    data = _SITED.get(key)
    if data is None:
        data = bounded(f"{sig} site={site}")
        if len(_SITED) < 4096:
            _SITED[key] = data
    return data


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor as a writable memoryview (any dtype)."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def spans_hosts(group: "ProcessGroup") -> bool:
    """Whether ``group``'s ranks are on two or more hosts, every rank's host known (a
    group or a phase's view of one: anything with ``transport`` and ``ranks``)."""
    # asked on every call across hosts and O(group size) (3 us at 16 ranks): kept per
    # group, as a rank's host never changes once the group exists
    return kept_per_group(_SPANS, group, _spans)


_SPANS: weakref.WeakKeyDictionary[object, bool] = weakref.WeakKeyDictionary()
_Answer = TypeVar("_Answer")


def kept_per_group(cache: "weakref.WeakKeyDictionary[object, _Answer]", group: Any,
                   work: Callable[[Any], _Answer]) -> _Answer:
    """``work(group)``, kept in ``cache`` for as long as ``group`` (or the one-call view
    of one) lives; worked out each time for a group that cannot be weakly referenced."""
    try:
        return cache[group]
    except KeyError:
        pass
    except TypeError:
        return work(group)
    answer = cache[group] = work(group)
    return answer


def _spans(group: "ProcessGroup") -> bool:
    host_of = group.transport.host_of
    hosts = {host_of(rank) for rank in group.ranks}
    return len(hosts) > 1 and "" not in hosts


def host_layout(group: "ProcessGroup") -> list[list[int]] | None:
    """The group ranks on each host, hosts ordered by their lowest group rank.

    None when the hierarchical path does not apply: some rank's host is unknown, all
    ranks share one host, or no two ranks share a host.
    """
    # asked once or twice per call on every rank, and O(group size) to work out (4 us at
    # 16 ranks): kept per group, since a rank's host never changes once the group exists
    return kept_per_group(_LAYOUTS, group, _layout)


# each group's layout, for as long as the group (or the one-call view of one) lives
_LAYOUTS: weakref.WeakKeyDictionary[object, list[list[int]] | None] = (
    weakref.WeakKeyDictionary())


def _layout(group: "ProcessGroup") -> list[list[int]] | None:
    host_of = group.transport.host_of
    hosts = [host_of(rank) for rank in group.ranks]
    distinct = set(hosts)
    if "" in distinct or len(distinct) == 1 or len(distinct) == len(hosts):
        return None
    by_host: dict[str, list[int]] = {}
    for i, host in enumerate(hosts):
        by_host.setdefault(host, []).append(i)
    return list(by_host.values())


def host_shares_memory(group: "ProcessGroup", local: Sequence[int]) -> bool:
    """Whether the group ranks ``local`` (one host's) have the group's arena for their
    host (:meth:`ProcessGroup.host_arena`): two or more, able to map each other's memory."""
    return (len(local) > 1 and group.settings.shm_arena
            and group.transport.shares_memory_with([group.ranks[i] for i in local]))


class Op(Call):
    """One collective call: its group, sequence number, signature and deadline.

    Algorithms address peers by *group* rank; ``step`` numbers the messages of one
    call so each (peer, step) pair is unique within the call.

    An op is a :class:`Call` so that a timeline or a profiler can take it as the call's
    span; the flight recorder keeps a small list per call instead (see
    :mod:`tandem.collectives.recorder`), which refers to the op only while it runs.
    (Nothing may refer from the op back to itself or its record: every recorded call
    would then be left for the cycle collector, which ran every ~700 calls: measured,
    +2.5 us per 4 KB all_reduce.)
    """

    __slots__ = ("group", "name", "algorithm")

    def __init__(self, group: "ProcessGroup", name: str, seq: int, sig: bytes, site: bytes) -> None:
        self.group = group
        self.name = self.op = name
        self.seq = seq
        self.sig = sig
        self.site = site
        self.algorithm = ""

    def send(self, to: int, step: int, view: memoryview) -> Slot:
        g = self.group
        header = Header(_COLL, g.group_id, self.seq, step, len(view), self.sig, self.site)
        return g.transport.isend(g.ranks[to], header, view)

    def sendv(self, to: int, step: int, views: Sequence[memoryview]) -> Slot:
        """One message of ``views`` laid end to end, sent without joining them first."""
        g = self.group
        header = Header(_COLL, g.group_id, self.seq, step, sum(len(v) for v in views),
                        self.sig, self.site)
        return g.transport.isendv(g.ranks[to], header, views)

    def recv(self, frm: int, step: int, view: memoryview) -> Slot:
        g = self.group
        return g.transport.irecv(g.ranks[frm], _COLL, g.group_id, self.seq, step, view,
                                 self.sig, self.site)

    def wait(self, *slots: Slot) -> None:
        if all(s.event.is_set() and s.error is None for s in slots):
            return  # the common case in pipelined loops: nothing to wait for
        g = self.group
        # [timeline hook] while a timeline runs, each wait becomes a phase of the call's span
        phases = self.phases
        t0 = clock() if phases is not None else 0.0
        g.transport.wait(slots, self.deadline, self.describe, g.ranks)
        if phases is not None:
            phases.append((t0, clock()))

    def describe(self) -> str:
        g = self.group
        return (f"{self.name} #{self.seq} on group '{g.group_name}' (rank {g.group_rank} of "
                f"{g.group_size}, global ranks {in_order(g.ranks)}) called at "
                f"{self.site.decode(errors='replace')}")


class ProcessGroup:
    """The ranks ``ranks`` (global ranks, in group-rank order) talking over ``transport``."""

    def __init__(self, transport: Transport, ranks: list[int], group_id: int, group_name: str,
                 timeout: float, settings: Settings, backend: str) -> None:
        if transport.rank not in ranks:
            raise StateError(f"rank {transport.rank} is not in group ranks {ranks}")
        self.transport = transport
        self.ranks = list(ranks)
        self.group_id = group_id
        transport.know_group(group_id, self.ranks)
        self.group_name = group_name
        self.group_rank = self.ranks.index(transport.rank)
        self.group_size = len(self.ranks)
        self.timeout = timeout
        self.settings = settings
        self.backend = backend
        self.algorithm_override: dict[str, str] = {}
        self._check_sites = settings.check_call_sites
        self._seq = 0
        self._p2p_sent: collections.Counter[tuple[int, int]] = collections.Counter()
        self._p2p_recv: collections.Counter[tuple[int, int]] = collections.Counter()
        self._cv = threading.Condition()
        # (op, its function, its Work, its flight-recorder record or None)
        self._queue: collections.deque[tuple[Op, Callable[[Op], Any], Work, list[Any] | None]] = (
            collections.deque())
        self._busy = False
        self._engine: threading.Thread | None = None
        self._closed = False
        self.completions = Completions()
        self._scratch: torch.Tensor | None = None  # made by the first call that needs it
        # same-host groups share staging memory (made at the first call, by every member)
        self.shares_memory = (self.group_size > 1 and settings.shm_arena
                              and transport.shares_memory_with(self.ranks))
        self.arena: Arena | None = None
        # a group spanning hosts: its ranks on this host share staging memory (made by
        # the group's first call, by every rank of the host; see host_arena), in which
        # every call is announced; _host_ranks: those ranks, None where there is none
        self._host_arena: Arena | None = None
        layout = host_layout(self)
        local = None if layout is None else next(r for r in layout if self.group_rank in r)
        self._host_ranks = (None if local is None or not host_shares_memory(self, local)
                            else local)
        self._abort_passed = False  # this rank passed the group's abort to its host mates
        # a broadcast root's check left to finish by the end of the next call (confirm_later)
        self._unconfirmed: tuple[Op, list[Slot]] | None = None
        self.compared = -1  # the last call whose previous call was compared (compare_previous)
        # (seq, signature, call site) of the last call compared: the next call's previous one
        self._last_compared: tuple[int, bytes, bytes] | None = None
        # [flight recorder hook] this group's last calls (tandem/collectives/recorder.py)
        self.recorder = Recorder(settings.flight_recorder, group_name)
        if self.recorder.capacity:
            # its record of each completed call tells strays too (no second record)
            transport.follow_calls(group_id, self.recorder.completed)

    # -- torch-compatible accessors -----------------------------------------------
    def rank(self) -> int:
        return self.group_rank

    def size(self) -> int:
        return self.group_size

    def name(self) -> str:
        return self.group_name

    def __repr__(self) -> str:
        return f"<ProcessGroup '{self.group_name}' ranks={self.ranks} backend={self.backend}>"

    # -- issuing operations --------------------------------------------------------
    def new_op(self, name: str, sig: str, site: str) -> Op:
        if self._closed:
            raise StateError(f"process group '{self.group_name}' was destroyed")
        with self._cv:
            seq = self._seq
            self._seq += 1
        if self._check_sites:  # opt-in: correct programs may call one collective from two lines
            return Op(self, name, seq, _sited(sig, site), bounded_cached(site))
        return Op(self, name, seq, bounded_cached(sig), bounded_cached(site))

    def run(self, op: Op, fn: Callable[[Op], Any], async_op: bool, result: Any = None,
            nbytes: int = -1) -> Work | None:
        """Execute ``fn(op)`` in issue order; return a Work when ``async_op``.

        ``result`` is the list of tensors the call returns; ``nbytes`` their bytes when
        the caller knows them already (-1: count them), for the flight recorder.
        """
        failure = self.transport.aborted(self.group_id)
        if failure is not None:
            self._pass_on_abort(failure)
            unconfirmed, self._unconfirmed = self._unconfirmed, None  # reported here
            after = "" if unconfirmed is None else (
                f" (after {unconfirmed[0].describe()} had returned on its root, before every "
                f"rank confirmed it)")
            raise StateError(f"process group '{self.group_name}' was aborted earlier{after}: "
                             f"{failure}") from failure
        if not async_op:
            with self._cv:
                inline = not self._queue and not self._busy
                if inline:
                    self._busy = True
            if inline:
                try:
                    self._execute(op, fn, result, nbytes)
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
                return None
        record = self.recorder.queued(op, result, nbytes)  # [recorder]
        work = Work(op.describe(), result, self.completions)
        with self._cv:
            if self._closed:
                raise self._destroyed()
            self._queue.append((op, fn, work, record))
            if self._engine is None:
                self._engine = threading.Thread(target=self._engine_loop, daemon=True,
                                                name=f"tandem-engine-{self.group_name}")
                self._engine.start()
            self._cv.notify_all()
        if async_op:
            return work
        work.wait()
        return None

    @property
    def engine_thread(self) -> threading.Thread | None:
        """The thread that runs this group's queued (``async_op=True``) calls."""
        return self._engine

    def _engine_loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._queue or self._busy:
                        if self._closed:
                            return
                        self._cv.wait()
                    op, fn, work, record = self._queue.popleft()
                    self._busy = True
                try:
                    self._execute(op, fn, record=record)
                    work._complete()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                    work._complete(error=exc)
                finally:
                    with self._cv:
                        self._busy = False
                        self._cv.notify_all()
        except BaseException as exc:  # noqa: BLE001 - the engine must never die silently
            error = StateError(f"the progress engine of process group '{self.group_name}' "
                               f"failed ({type(exc).__name__}: {exc})")
            self.abort(error)
            self._fail_queued(error)

    def _fail_queued(self, error: TandemError) -> None:
        with self._cv:
            queued = list(self._queue)
            self._queue.clear()
        for _, _, work, _ in queued:
            work._complete(error=error)

    def _execute(self, op: Op, fn: Callable[[Op], Any], result: Any = None, nbytes: int = -1,
                 record: list[Any] | None = None) -> None:
        """Run ``fn(op)`` now; ``record``: the op was issued to the queue and recorded
        then, else ``result`` and ``nbytes`` are :meth:`run`'s, for the recorder."""
        now = clock()
        op.deadline = now + self.timeout
        # [recorder] written out here rather than called: in place, each method call and
        # clock read cost 2-3x what a tight loop says, on both ranks (see recorder.py).
        # The record is one list (~200 B with its times), not the op (~450 B with its
        # dict): the same cost in place (measured), half the memory, and the op is let go
        # when the call returns (its end time replaces it in the record)
        recorder = self.recorder
        watched = False
        if record is not None:
            record[6] = now  # t_start
        elif recorder.capacity:
            i = op.seq % recorder.capacity
            if not i:
                recorder.lap(op.seq)
            record = [op.seq, op.name, op.sig, op.site,
                      nbytes if nbytes >= 0 else payload_bytes(result),
                      0.0, now, op, ""]  # see recorder.RECORD_FIELDS
            try:
                recorder.ring[i] = record
            except IndexError:  # the ring's first lap: it grows as calls come
                recorder.grow(i, record)
        if record is not None and (recorder.timeline is not None
                                   or _torch_profiler._is_profiler_enabled):
            watched = True
            recorder.watch(op)
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        try:
            if self.shares_memory:
                if self.arena is None:
                    self.arena = self._make_arena(op)
                # every call says what it is, so a peer waiting in shared memory for a
                # different call can tell (see algorithms.shm)
                self.arena.announce(op.seq, op.sig, op.site)
            elif self._host_ranks is not None:
                # so too in the host's arena across hosts, made by the first call of any
                # kind: a rank waiting there (a barrier's check-in) names a mate that is in
                # a call moving messages only (it skipped one), not the deadline's laggard
                arena = self.host_arena(op, self._host_ranks)
                arena.announce(op.seq, op.sig, op.site)
            fn(op)
            if unconfirmed is not None:  # the previous call's root check, overlapped by this one
                self._settle(unconfirmed, op.deadline)
            if self.arena is not None and self.compared != op.seq:
                # a call that moved only messages (barrier, all_to_all, gather, scatter)
                # checks the previous call here, as the shared-memory ones do after their
                # first wait: a previous call whose root waited on nobody (a broadcast
                # with a different root on each rank) is otherwise never compared
                self.compare_previous(op, range(self.group_size))
            if record is None:
                self.transport.finished(self.group_id, op.seq, op.sig, op.site)
            else:
                # [recorder] ended before the transport is told: from then on, a message
                # for this call is a stray (Recorder.completed), and not kept twice
                record[7] = clock()  # t_end
                self.transport.finished(self.group_id, op.seq, op.sig, op.site, True)
        except CollectiveError as exc:
            self.abort(exc)
            if record is not None:
                recorder.fail(op, record, exc, watched)
            raise
        except Exception as exc:
            # e.g. a custom reduce op raised: the peers must not wait for us until the deadline
            self.abort(StateError(f"{op.describe()} failed on rank {self.ranks[self.group_rank]}: "
                                  f"{type(exc).__name__}: {exc}"))
            if record is not None:
                recorder.fail(op, record, exc, watched)
            raise
        except BaseException as exc:  # KeyboardInterrupt: the call did not finish
            if record is not None:
                recorder.fail(op, record, exc, watched)
            raise
        if watched:
            assert record is not None  # only a recorded call is watched
            recorder.unwatch(op, record)

    def confirm_later(self, op: Op, told: Sequence[Slot]) -> None:
        """Let ``op`` (a broadcast's root, its data sent) return before ``told``, the receives
        of its peers' confirmations, complete: the end of this group's next call waits for
        them (or :meth:`close`), so the round trip overlaps that call. A confirmation that
        clashes aborts the group at once, from the thread that read it, so the ranks still
        in ``op`` fail rather than wait; the root's next call then fails naming ``op``."""
        op.wait(*[s for s in told if s.done()])  # a clash already here fails in the call
        told = [s for s in told if not s.done()]
        if not told:
            return
        self.abort_on_clash(told)
        self._unconfirmed = (op, told)

    def abort_on_clash(self, slots: Sequence[Slot]) -> None:
        """Abort the group from the thread that completes any of ``slots`` with a mismatch,
        so ranks that no wait of this rank's will reach learn of it at once."""
        def clash(slot: Slot) -> None:
            if isinstance(slot.error, CollectiveMismatchError):
                self.abort(slot.error)

        for s in slots:
            s.on_done = clash
            if s.done():  # finished before its hook was in place (abort is idempotent)
                clash(s)

    def _settle(self, unconfirmed: tuple[Op, list[Slot]], deadline: float) -> None:
        """Wait for the confirmations :meth:`confirm_later` left, until ``deadline``."""
        prior, told = unconfirmed
        try:
            self.transport.wait(told, deadline, prior.describe, self.ranks)
        except CollectiveMismatchError as exc:
            raise CollectiveMismatchError(
                f"{prior.describe()} returned on its root before every rank had confirmed "
                f"it, and a rank disagreed: {exc}") from exc

    def _name_unconfirmed(self, unconfirmed: tuple[Op, list[Slot]], deadline: float) -> None:
        """While :meth:`close` waits for a broadcast root's confirmations, warn after
        ``stall_warn`` seconds (then at doubling intervals) naming the ranks they are
        missing from: it waits outside any call, so no stall report does (the watchdog is
        gone by then). Returns once they came, or the group failed (the wait that follows
        raises why)."""
        warn = self.settings.stall_warn
        if warn <= 0:
            return
        prior, told = unconfirmed
        transport = self.transport
        start = time.monotonic()
        due = start + warn
        while True:
            tick = min(deadline, due, time.monotonic() + _SETTLE_TICK_S)
            for slot in told:
                if not slot.event.wait(max(0.0, tick - time.monotonic())):
                    break
            missing = sorted({s.key[0] for s in told if not s.done()})
            if not missing or transport.aborted(self.group_id) is not None or any(
                    transport.lost(r) is not None for r in self.ranks):
                return
            now = time.monotonic()
            if now >= deadline:
                return
            if now >= due:  # at doubling intervals, as the watchdog's stall reports
                warn *= 2
                due = now + warn
                _LOGGER.warning(
                    "tandem: rank %d is closing group '%s' and has waited %.1f s for rank(s) "
                    "%s to confirm %s (the root returned before every rank had; it waits up "
                    "to %.0f s more, the group's timeout): %s still to enter that broadcast, "
                    "or stopped?", transport.rank, self.group_name, now - start,
                    in_order(missing), prior.describe(), deadline - now,
                    "is it" if len(missing) == 1 else "are they")

    def compare_previous(self, op: Op, members: Sequence[int]) -> None:
        """Raise if a member of ``members`` announced another call than this rank's as the
        call before ``op`` (same-host groups announce every call in their arena).

        Runs once per call, in issue order, so the previous call's signature is at hand;
        each member's entry is compared in place (:meth:`Arena.holds`) and read whole only
        when it differs. Reading both entries whole cost 3.5 us per 4 KB all_reduce, the
        in-place compare 1 us (measured, 2 ranks)."""
        arena = self.arena
        self.compared = op.seq
        previous, self._last_compared = self._last_compared, (op.seq, op.sig, op.site)
        if arena is None or previous is None or previous[0] != op.seq - 1:
            return
        seq, sig, site = previous
        for q in members:
            if q == arena.index or arena.holds(q, seq, sig):
                continue
            theirs = arena.announcement(q, seq)
            # a member rewriting the entry (None) or already past it has nothing to compare
            if theirs is not None and theirs[0] == seq and theirs[1] != sig:
                raise CollectiveMismatchError(
                    f"collective mismatch (group {self.group_id}, sequence {seq}): rank "
                    f"{self.ranks[arena.index]} called {sig.decode(errors='replace')} at "
                    f"{site.decode(errors='replace')} but rank {self.ranks[q]} called "
                    f"{theirs[1].decode(errors='replace')} at {theirs[2].decode(errors='replace')}")

    def host_arena(self, op: Op, local: Sequence[int]) -> Arena:
        """The staging memory shared by this host's group ranks ``local`` (lowest first),
        made by the group's first call, collectively over them, and kept until
        :meth:`close`."""
        if self._host_arena is None:
            self._host_arena = self._make_arena(op, HOST_ARENA_KEY | self.group_id,
                                                [self.ranks[i] for i in local])
        return self._host_arena

    def _make_arena(self, op: Op, key: int | None = None,
                    members: Sequence[int] | None = None) -> Arena:
        try:
            # an abort of the group or a member's death ends the wait for the hand-over
            return self.transport.arena(
                self.group_id if key is None else key,
                self.ranks if members is None else members, self.settings.shm_chunk or None,
                timeout=self.timeout,
                check=lambda: self.transport.check_group(self.group_id, self.ranks,
                                                         op.deadline, op.describe))
        except CollectiveTimeoutError as exc:
            names = ", ".join(map(str, exc.missing))
            raise CollectiveTimeoutError(f"{op.describe()} timed out waiting in shared memory "
                                         f"on rank(s) {names}: {exc}", exc.missing) from exc
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            # the host has the memory (TANDEM_SHM_CHUNK was checked against it), but this
            # process may not map it: ulimit -v, or a mapping count limit
            chunk = self.settings.shm_chunk
            raise ArgumentError(
                f"{op.describe()}: this rank cannot map the shared staging memory of "
                f"{len(self.ranks if members is None else members)} ranks ({exc}), two halves "
                f"of TANDEM_SHM_CHUNK={chunk or 'unset (1-4 MiB)'} each; lower "
                f"TANDEM_SHM_CHUNK, raise this process's address-space limit (ulimit -v), or "
                f"set TANDEM_SHM_ARENA=0") from exc

    def abort(self, error: TandemError) -> None:
        """Fail this group here and on every member, with ``error``."""
        if self.transport.aborted(self.group_id) is error:
            # learnt from a peer's abort: its host mates may not have been told
            self._pass_on_abort(error)
            return
        self.transport.abort(self.group_id, self.ranks, error)

    def _pass_on_abort(self, error: TandemError) -> None:
        """Tell this rank's same-host members, once, of the group's abort it learnt from a
        peer: a mate waiting for this rank's arena hand-over, or in an arena with it,
        learns at once whatever path the news took (a relay may not have reached it)."""
        if self._abort_passed or self._closed:  # destroyed here: nothing for the mates
            return
        self._abort_passed = True
        me = self.transport.rank
        mates = [r for r in self.ranks if r != me and self.transport.shares_memory_with([r])]
        if mates:
            self.transport.abort(self.group_id, mates, error)

    def scratch_kept(self) -> int:
        """Bytes of working memory kept between calls (none until a call needs some)."""
        return 0 if self._scratch is None else self._scratch.numel()

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Working memory for one collective, reused by the next one on this group.

        A fresh tensor-sized buffer per call is returned to the OS on free and faults
        in again on the next call: at 64 MB that cost more system time than moving the
        data (measured). Calls on one group run one at a time, so one buffer serves all.
        """
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        try:
            if nbytes > _SCRATCH_KEEP:
                return torch.empty(numel, dtype=dtype)
            if self._scratch is None or self._scratch.numel() < nbytes:
                self._scratch = None  # the old one freed first: it may be what does not fit
                self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as exc:
            if "can't allocate memory" not in str(exc):
                raise
            # torch's own text names neither the call nor why a collective allocates
            raise MemoryError(
                f"rank {self.ranks[self.group_rank]} cannot allocate the {size_text(nbytes)} "
                f"of working memory this call needs beside its tensors (ring and doubling "
                f"all-reduces receive up to a tensor's size there); free memory, raise this "
                f"process's limit (ulimit -v), or call on smaller tensors") from exc
        return self._scratch[:nbytes].view(dtype)

    # -- point-to-point ------------------------------------------------------------
    def p2p_send(self, dst: int, tag: int, view: memoryview, site: str, sig: bytes = b"") -> Slot:
        """``sig`` (the tensor's dtype) is compared with the receive's, when both have one."""
        key = (dst, tag)
        seq = self._p2p_sent[key]
        self._p2p_sent[key] += 1
        header = Header(_P2P, self.group_id, seq, tag, len(view), sig, bounded(site))
        return self.transport.isend(self.ranks[dst], header, view)

    def p2p_recv(self, src: int | None, tag: int, view: memoryview, sig: bytes = b"") -> Slot:
        if src is not None:
            key = (src, tag)
            seq = self._p2p_recv[key]
            self._p2p_recv[key] += 1
            return self.transport.irecv(self.ranks[src], _P2P, self.group_id, seq, tag, view,
                                        sig)
        index = {g: i for i, g in enumerate(self.ranks)}

        def match(peer: int, header: Header) -> bool:
            src_rank = index.get(peer)
            if src_rank is None or header.kind != _P2P or header.group != self.group_id:
                return False
            if header.step != tag or header.seq != self._p2p_recv[(src_rank, tag)]:
                return False
            self._p2p_recv[(src_rank, tag)] += 1  # claimed under the mailbox lock
            return True

        return self.transport.irecv_any(self.ranks, _P2P, self.group_id, view, match, sig)

    def wait_p2p(self, slot: Slot, timeout: float | None, what: str) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        peers = [slot.peer] if slot.peer >= 0 else self.ranks
        self.transport.wait([slot], deadline, lambda: f"{what} on group '{self.group_name}'",
                            peers)

    # -- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Fail what is pending with ``StateError``; end the engine, the futures thread
        and the shared staging memory. The transport is not closed (other groups use it).

        A broadcast root's check still out (:meth:`confirm_later`) is waited for first
        (up to the group's timeout); if ranks disagreed on that broadcast, the mismatch is
        raised once all is closed."""
        if self._closed:
            return
        unconfirmed, self._unconfirmed = self._unconfirmed, None
        report: BaseException | None = None
        if unconfirmed is not None:
            try:  # the last call's root check: a disagreement is reported, not dropped
                deadline = time.monotonic() + self.timeout
                self._name_unconfirmed(unconfirmed, deadline)
                self._settle(unconfirmed, deadline)
            except TandemError as exc:
                report = exc
            # a lost peer or this rank's own abort (elastic regroup, torch's abort) is not
            # the broadcast's to report: tearing down after it must go on quietly
            if not isinstance(report, CollectiveMismatchError):
                report = None
        self._warn_unreceived()
        error = self._destroyed()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._fail_queued(error)
        self.transport.fail_here(self.group_id, error)  # the running call fails at once
        end = time.monotonic() + _CLOSE_S
        engine = self._engine
        if engine is not None and engine is not threading.current_thread():
            engine.join(_CLOSE_S)
        with self._cv:
            while self._busy and time.monotonic() < end:
                self._cv.wait(max(0.0, end - time.monotonic()))
            idle = not self._busy and (engine is None or not engine.is_alive())
        self.completions.close()
        if self.recorder.slots:
            self.transport.unfollow_calls(self.group_id, self.recorder.last_completed)
        if idle:  # a call still inside must not see them unmapped
            for arena in (self.arena, self._host_arena):
                if arena is not None:
                    arena.close()
            self.arena = self._host_arena = None
        if report is not None:
            raise report

    def _warn_unreceived(self) -> None:
        """Log the sends that reached this rank and that no receive took: closing drops
        them, and their sender believes them delivered (an ``isend`` completes when sent)."""
        left = self.transport.unreceived(_P2P, self.group_id)
        if not left:
            return
        counts: dict[tuple[int, int], list[int]] = {}
        for peer, tag, nbytes in left:
            counts.setdefault((peer, tag), []).append(nbytes)
        listed = [f"from rank {peer} with tag {tag}: {len(sizes)} message(s) of "
                  f"{', '.join(str(n) for n in sizes[:4])}{', ...' if len(sizes) > 4 else ''} "
                  f"bytes" for (peer, tag), sizes in list(counts.items())[:_UNRECEIVED_LISTED]]
        more = len(counts) - len(listed)
        _LOGGER.warning(
            "tandem: rank %d closes group '%s' with %d message(s) that no receive took, now "
            "dropped: %s%s; each send needs a matching recv/irecv on its destination (same "
            "group and tag) before the group is destroyed", self.transport.rank,
            self.group_name, len(left), "; ".join(listed),
            f"; and {more} more sender/tag pair(s)" if more else "")

    def _destroyed(self) -> StateError:
        return StateError(f"process group '{self.group_name}' was destroyed "
                          f"(destroy_process_group) while the operation was pending")


class NonMemberGroup:
    """What ``new_group`` returns on a rank outside the group: every use raises."""

    def __init__(self, ranks: list[int], group_name: str, my_rank: int) -> None:
        self.ranks = list(ranks)
        self.group_name = group_name
        self.my_rank = my_rank

    def error(self, what: str) -> StateError:
        return StateError(
            f"rank {self.my_rank} called {what} on group '{self.group_name}' (global ranks "
            f"{in_order(self.ranks)}) but is not a member of it"
        )

    def rank(self) -> int:
        return -1

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"<NonMemberGroup '{self.group_name}' ranks={self.ranks}>"

    def __eq__(self, other: object) -> bool:
        """Equal to itself, and to torch's ``GroupMember.NON_GROUP_MEMBER`` (-100), which
        is what ported scripts compare ``new_group``'s result against."""
        if other is self:
            return True
        return type(other) is int and other == NON_GROUP_MEMBER

    __hash__ = object.__hash__
