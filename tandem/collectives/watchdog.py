"""The per-process watchdog: stall warnings, and dumps when something failed elsewhere.

Two daemon threads per process, stopped by :meth:`Watchdog.close`:

* ``tandem-watchdog`` looks at this process only. Every tick it checks each group's
  flight recorder for calls running longer than ``TANDEM_STALL_WARN`` and logs a
  stall warning for each (then at 2x, 4x, ... the threshold, until the call's
  deadline); and it dumps the flight recorders when a group was aborted (a failure
  elsewhere) or a peer lost while this rank has calls in flight that have not failed
  yet (a failing call dumps by itself).
* ``tandem-watchdog-store`` (started at the first tick, after start-up's own use of
  the store) talks to the store, so a store that stops answering
  (its host stopped) delays only the peers' part of a warning, never the warning,
  the dumps, or this rank's own calls. It answers other ranks' questions ("what
  are you doing?") and asks them on behalf of a stalled call.

The same question also goes straight to each peer over the transport (``Kind.STATE``
messages, answered by the peer's reader thread): the store lives in one rank's
process (rank 0's, with env:// and tcp://), and when that rank is stopped the store
answers nobody, while every live peer still answers over its own connection. Only
the stopped rank is then reported as not answering. Peers this rank has no connection
to yet (tcp across hosts connects on first use) are asked through the store alone: a
connection made now would wait on a stopped peer for its whole handshake.

The exchange through the store, under the group's private prefix::

    asks          a counter; a stalled rank adds 1 to it
    state/<rank>  each rank's latest answer (:func:`stall.process_state`, JSON),
                  rewritten when it sees the counter move, with the count it answers

Every rank reads ``asks`` once per poll (one store round trip a second by default;
jobs of more than 128 ranks poll less often, so the store's host serves at most ~128
polls a second), and the store holds one answer per rank, whatever the number of
stalls. Warnings go to the ``tandem`` logger (stderr unless configured).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Callable, Hashable

from tandem.collectives.group import ProcessGroup
from tandem.collectives.recorder import STARTED, Call, clock
from tandem.collectives.stall_report import process_state, stall_warning
from tandem.errors import TandemError
from tandem.store.base import Store
from tandem.transport import Header, Kind, Transport

__all__ = ["Watchdog", "EarlyThread", "LOGGER"]

LOGGER = logging.getLogger("tandem")
POLL_SHARE = 128  # ranks polling the store per second, at most (see the module doc)
CLOSE_TIMEOUT = 5.0


def tick_for(stall_warn: float) -> float:
    """Seconds between the watchdog's looks: 1 s, or less for thresholds below 8 s."""
    return min(1.0, max(0.05, stall_warn / 8)) if stall_warn > 0 else 1.0


class _Exchange:
    """The store side: answer peers' questions, ask peers on behalf of a stalled call."""

    def __init__(self, store: Store, rank: int, world_size: int, poll: float,
                 state: Callable[[int], dict[str, Any]]) -> None:
        self.store = store
        self.rank = rank
        self.poll = poll * max(1.0, world_size / POLL_SHARE)
        self.answer_wait = min(10.0, 2 * self.poll + 1.0)
        self._state = state
        self._answered = 0
        self.job = ""
        self.failed = ""  # why the store is no longer used

    def start(self) -> None:
        self.store.add("asks", 0)  # the counter exists before anyone polls it
        # one id for the whole job, whoever sets it first: dumps of other jobs in the
        # same directory are told apart by it
        self.job = self.store.compare_set("job", "", uuid.uuid4().hex[:12]).decode()

    def answer(self) -> None:
        asks = int(self.store.get("asks"))
        if asks > self._answered:
            self.store.set(f"state/{self.rank}", json.dumps(self._state(asks)))
            self._answered = asks

    def ask(self, peers: list[int], stop: threading.Event) -> dict[int, Any]:
        """The answers of ``peers`` given after this question (missing: no answer)."""
        asks = self.store.add("asks", 1)
        got: dict[int, Any] = {}
        deadline = time.monotonic() + self.answer_wait
        delay = min(0.1, self.poll)
        while not stop.wait(delay):
            self.answer()  # peers stalled at the same time are asking us too
            for r in peers:
                if r in got or not self.store.check([f"state/{r}"]):
                    continue
                state = json.loads(self.store.get(f"state/{r}"))
                if state.get("ask", 0) >= asks:
                    got[r] = state
            if len(got) == len(peers) or time.monotonic() > deadline:
                break
        return got


class EarlyThread:
    """The watchdog's thread, started before the work it will run is known: where its
    starter waits anyway (init, for the other ranks), since ``Thread.start`` waits for
    the new thread to get a CPU (up to 0.1 s at 16 ranks on 2 CPUs, at the end of
    init). ``start=False``: not yet, :meth:`start` starts it (init: once this rank's
    entry is in the store, so the others never wait for this start). ``run`` hands it
    the work (starting it, if not yet); ``cancel`` ends it; unclaimed, it ends after
    ``timeout`` seconds and ``run`` starts a thread of its own."""

    def __init__(self, name: str, timeout: float, start: bool = True) -> None:
        self._name = name
        self._timeout = timeout
        self._lock = threading.Lock()
        self._work: Callable[[], None] | None = None
        self._given = threading.Event()
        self._expired = False
        self._started = False
        self.thread = threading.Thread(target=self._wait, daemon=True, name=name)
        if start:
            self.start()

    def start(self) -> None:
        """Start the thread (once; not after :meth:`cancel` or :meth:`run`)."""
        with self._lock:
            if self._started or self._given.is_set():
                return
            self._started = True
            self.thread.start()

    def _wait(self) -> None:
        self._given.wait(self._timeout)
        with self._lock:
            self._expired = not self._given.is_set()
            work = self._work
        if work is not None:
            work()

    def run(self, work: Callable[[], None]) -> threading.Thread:
        """Run ``work`` on this thread (on a new one if this one ended unclaimed)."""
        with self._lock:
            if not self._expired and not self._given.is_set():
                self._work = work
                self._given.set()
                if not self._started:  # never started: it runs the work at once
                    self._started = True
                    self.thread.start()
                return self.thread
        thread = threading.Thread(target=work, daemon=True, name=self._name)
        thread.start()
        return thread

    def cancel(self) -> None:
        """End the thread without running anything (set-up failed, or no watchdog)."""
        with self._lock:
            self._given.set()


class Watchdog:
    """See the module docstring. ``groups()`` lists this process's groups right now."""

    def __init__(self, rank: int, world_size: int, groups: Callable[[], list[ProcessGroup]],
                 transport: Transport, store: Store | None, stall_warn: float,
                 dump: Callable[[str, Hashable], object],
                 early: EarlyThread | None = None) -> None:
        self.rank = rank
        self.groups = groups
        self.transport = transport
        self.stall_warn = stall_warn
        self.tick = tick_for(stall_warn)
        self._dump = dump
        self._stop = threading.Event()
        self.exchange = None
        if store is not None and stall_warn > 0:
            self.exchange = _Exchange(store, rank, world_size, self.tick,
                                      lambda ask: process_state(rank, self.groups(), ask))
        # the local thread hands questions to the store thread through these; a question
        # is numbered so that a late answer never passes for the next question's
        self._question: tuple[int, list[int]] | None = None
        self._answers: tuple[int, dict[int, Any]] | None = None
        self._asked = 0
        self._cv = threading.Condition()
        # answers that came over the transport: peer -> (question number, state)
        self._direct: dict[int, tuple[int, dict[str, Any]]] = {}
        self._direct_asked = 0
        self._answer_wait = (self.exchange.answer_wait if self.exchange is not None
                             else min(10.0, 2 * self.tick + 1.0))
        if stall_warn > 0:
            transport.handle(Kind.STATE, self._on_state)
        self._threads = [threading.Thread(target=self._watch, name="tandem-watchdog",
                                          daemon=True)]
        if self.exchange is not None:
            self._threads.append(threading.Thread(target=self._serve, daemon=True,
                                                  name="tandem-watchdog-store"))
        # the store thread is started by the watchdog thread at its first tick: Thread.start
        # waits for the new thread to run (10-30 ms with 32 ranks on 2 CPUs), and its first
        # store round trips would land in start-up, when every rank uses the store at once;
        # no stall is looked for before that tick, so no report misses it
        if early is not None:  # started earlier, where init waited for the other ranks
            self._threads[0] = early.run(self._watch)
        else:
            self._threads[0].start()

    @property
    def job(self) -> str:
        return self.exchange.job if self.exchange is not None else ""

    def close(self) -> None:
        if self.stall_warn > 0:
            self.transport.handle(Kind.STATE, None)
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        for t in self._threads:  # the watchdog thread first: it may start the store one
            if t is not threading.current_thread() and t.ident is not None:
                t.join(CLOSE_TIMEOUT)

    # -- the local thread ----------------------------------------------------------------
    def _watch(self) -> None:
        store_threads = self._threads[1:]
        while not self._stop.wait(self.tick):
            for t in store_threads:
                if not self._stop.is_set():
                    t.start()
            store_threads = []
            try:
                self._check_failures()
                if self.stall_warn > 0:
                    self._check_stalls()
            except Exception as exc:  # noqa: BLE001 - the watchdog must outlive its bugs
                LOGGER.debug("tandem watchdog: %s: %s", type(exc).__name__, exc)

    def _check_failures(self) -> None:
        groups = self.groups()
        for g in groups:
            failure = self.transport.aborted(g.group_id)
            if failure is not None:
                self._dump(f"group '{g.group_name}' was aborted: {failure}", ("abort", g.group_id))
        lost = self.transport.lost_peers()
        if not lost or not any(g.recorder.in_flight() for g in groups):
            # an idle rank's peer that exits without destroy_process_group looks lost too,
            # at the end of every such job; a call that needs the peer fails and dumps
            return
        for peer, error in lost.items():
            self._dump(f"lost rank {peer}: {error}", ("lost", peer))

    def _due(self) -> list[tuple[ProcessGroup, Call]]:
        now, out = clock(), []
        for g in self.groups():
            for c in g.recorder.in_flight():
                if c.state == STARTED and now - c.t_start >= self.stall_warn * 2 ** c.warned:
                    out.append((g, c))
        return out

    def _check_stalls(self) -> None:
        due = self._due()
        if not due:
            return
        peers = sorted({r for g, c in due for r in ([c.peer] if c.peer >= 0 else g.ranks)}
                       - {self.rank})
        lost = {r: str(e) for r, e in self.transport.lost_peers().items()}
        asked = [r for r in peers if r not in lost]
        token = self._ask_direct(asked)
        states, note = self._ask(peers, lambda: all(
            r in self._direct and self._direct[r][0] == token for r in asked))
        direct = self._direct_answers(token, [r for r in peers if r not in states
                                              and r not in lost])
        if direct and note:  # the store failed us, the peers' own connections did not
            note = note.replace("peers' states unavailable: ", "").rstrip(")") + (
                "; peers answered over their own connections)")
        states.update(direct)
        now = clock()
        # the recorder's views of unfinished calls are kept while they run: one still in
        # flight now is the same object as when it was found due
        running = {id(c) for g in {g for g, _ in due} for c in g.recorder.in_flight()}
        for g, c in due:
            if id(c) not in running or c.state != STARTED:
                continue  # it finished while we asked
            waited = now - c.t_start
            while self.stall_warn * 2 ** c.warned <= waited:
                c.warned += 1
            next_at = self.stall_warn * 2 ** c.warned
            if c.deadline and time.monotonic() + (next_at - waited) >= c.deadline:
                next_at = None
            answer_wait = self._answer_wait
            LOGGER.warning(stall_warning(self.rank, g, c, states, lost, answer_wait, next_at,
                                         note))

    def _ask(self, peers: list[int],
             answered: Callable[[], bool] = lambda: False) -> tuple[dict[int, Any], str]:
        """Peers' states through the store thread, waiting a bounded time for it, or until
        ``answered()`` (under the lock: every peer answered over the transport)."""
        if self.exchange is None or not peers:
            return {}, "" if not peers else "(peers' states unavailable: no store)"
        if self.exchange.failed:
            return {}, f"(peers' states unavailable: {self.exchange.failed})"
        with self._cv:
            self._asked += 1
            token = self._asked
            self._question, self._answers = (token, peers), None
            self._cv.notify_all()
            end = time.monotonic() + self.exchange.answer_wait + 2 * self.exchange.poll + 1.0
            while not self._stop.is_set():
                if self._answers is not None and self._answers[0] == token:
                    return self._answers[1], ""
                if answered():
                    self._question = None
                    return {}, ""
                left = end - time.monotonic()
                if left <= 0:
                    self._question = None
                    return {}, "(peers' states unavailable: the store did not answer in time)"
                self._cv.wait(left)
            return {}, ""

    # -- the transport: questions and answers straight between the ranks ----------------
    def _ask_direct(self, peers: list[int]) -> int:
        """Send ``peers`` the question over the transport; its number."""
        with self._cv:
            self._direct_asked += 1
            token = self._direct_asked
        header = Header(Kind.STATE, 0, token, 0, 0)
        for r in peers:
            if not self.transport.connected(r):
                continue  # dialing a stopped rank would hold the report back: the store asks it
            try:
                if not self.transport.send_now(r, header, []):
                    self.transport.isendv(r, header, [])  # never waits: a full peer is fine
            except (TandemError, OSError) as exc:
                LOGGER.debug("tandem watchdog: cannot ask rank %d: %s", r, exc)
        return token

    def _direct_answers(self, token: int, peers: list[int]) -> dict[int, Any]:
        """The answers to question ``token`` from ``peers``, waiting at most the answer time
        more for them (the store's part, done first, took its own time)."""
        end = time.monotonic() + self._answer_wait
        with self._cv:
            while not self._stop.is_set():
                got = {r: self._direct[r][1] for r in peers
                       if r in self._direct and self._direct[r][0] == token}
                left = end - time.monotonic()
                if len(got) == len(peers) or left <= 0:
                    return got
                self._cv.wait(min(left, 0.05))
        return {}

    def _on_state(self, peer: int, header: Header, read: Callable[[memoryview], None]) -> None:
        """A peer's question (step 0): answer it; or its answer (step 1): keep it. Runs on
        the transport's reader thread, so it must not raise."""
        try:
            payload = bytearray(header.nbytes)
            if header.nbytes:
                read(memoryview(payload))
            if header.step == 0:
                text = json.dumps(process_state(self.rank, self.groups(), header.seq)).encode()
                answer = Header(Kind.STATE, 0, header.seq, 1, len(text))
                if not self.transport.send_now(peer, answer, [memoryview(text)]):
                    self.transport.isendv(peer, answer, [memoryview(text)])
            else:
                state = json.loads(payload)
                with self._cv:
                    self._direct[peer] = (header.seq, state)
                    self._cv.notify_all()
        except Exception as exc:  # noqa: BLE001 - a reader thread must never die of it
            LOGGER.debug("tandem watchdog: a state message from rank %d: %s", peer, exc)

    # -- the store thread ----------------------------------------------------------------
    def _serve(self) -> None:
        ex = self.exchange
        assert ex is not None
        try:
            ex.start()
            while not self._stop.is_set():
                ex.answer()
                with self._cv:
                    if self._question is None:
                        self._cv.wait(ex.poll)
                    question = self._question
                if question is not None and not self._stop.is_set():
                    token, peers = question
                    answers = ex.ask(peers, self._stop)
                    with self._cv:
                        if self._question == question:
                            self._question = None
                        self._answers = (token, answers)
                        self._cv.notify_all()
        except (TandemError, OSError, ValueError) as exc:
            ex.failed = f"the store failed: {type(exc).__name__}: {exc}"
            with self._cv:
                self._answers = (self._asked, {})
                self._cv.notify_all()
