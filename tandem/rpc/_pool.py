"""The server pool: threads that run incoming calls, and what keeps nested calls alive.

``size`` (``num_worker_threads``) bounds how many calls *run* at once. A thread that
waits inside an RPC (a served function calling ``rpc_sync``, ``to_here`` or waiting on a
future) announces it with :meth:`ServerPool.blocked`; while it waits it does not count,
so the pool starts another thread for queued work. That is why ping-pong nesting (A
calls B, which calls A, which calls B...) cannot deadlock, even with one worker thread.
Threads beyond ``size`` exit when their call returns.

Bounds: at most ``max_threads`` threads in all (then queued calls wait for a running
one to finish) and at most ``max_queued`` queued calls: past that ``submit`` blocks its
caller (the transport's reader thread), which stops reading that peer: back-pressure
instead of unbounded memory.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Callable, Iterator, Protocol

import torch

from tandem.transport.base import Poller
from tandem.transport.message import Flag

__all__ = ["ServerPool", "role", "adopt_thread_settings", "poll_as_reader", "Intake"]

Job = Callable[[], None]


class _Role(threading.local):
    pool: "ServerPool | None" = None  # set in the pool's threads
    reader: bool = False  # set in transport reader threads by the agent's handler
    # set while a lingering pool thread reads a frame itself: a call read then is run by
    # this thread (put here) instead of being queued for another one
    take: "list[Job] | None" = None


role = _Role()


class Intake(Protocol):
    """Where idle pool threads read the next call themselves (the agent's pollers)."""

    def watch(self, on: bool) -> None: ...

    def take(self) -> tuple[bool, Job | None]: ...


def poll_as_reader(poller: Poller) -> bool:
    """``poller.poll()`` with this thread acting as a reader while it delivers the frame
    (callbacks it runs may not wait, as on the transport's reader thread)."""
    was = role.reader
    role.reader = True
    try:
        return poller.poll()
    finally:
        role.reader = was


def adopt_thread_settings() -> None:
    """Give this new thread the process's torch thread count.

    OpenMP keeps the count per thread: a thread torch did not start gets the default
    (every core), so a served call's ops ran on a fresh team of spinning OpenMP threads.
    Measured on a loaded 2-core machine: an LSTM backward took 250 ms to 1.5 s in such a
    thread against 1-5 ms after this call.
    """
    torch.set_num_threads(torch.get_num_threads())


class ServerPool:
    """Runs jobs on up to ``size`` threads at once (see the module docstring)."""

    def __init__(self, size: int, name: str, max_threads: int, max_queued: int,
                 spin: float = 0.0) -> None:
        self._size = size
        self._name = name
        self._max_threads = max(size, max_threads)
        self._max_queued = max_queued
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._queue: collections.deque[Job] = collections.deque()
        self._parked: list[Flag] = []
        self._threads: set[threading.Thread] = set()
        self._blocked = 0
        self._running = 0
        self._closed = False
        self._made = 0
        self.spin = spin
        self.intake: Intake | None = None  # set by the server

    def submit(self, job: Job) -> None:
        """Queue ``job``; blocks while ``max_queued`` jobs already wait (back-pressure)."""
        with self._lock:
            while len(self._queue) >= self._max_queued and not self._closed:
                self._space.wait(0.5)
            if self._closed:
                return
            self._queue.append(job)
            if self._parked:
                self._parked.pop().set()
            elif self._active() < self._size and len(self._threads) < self._max_threads:
                self._spawn()

    def _active(self) -> int:
        return len(self._threads) - self._blocked

    def _spawn(self) -> None:  # caller holds the lock
        self._made += 1
        t = threading.Thread(target=self._work, daemon=True,
                             name=f"{self._name}-{self._made}")
        self._threads.add(t)
        t.start()

    def _work(self) -> None:
        role.pool = self
        adopt_thread_settings()
        me = threading.current_thread()
        flag: Flag | None = None
        while True:
            with self._lock:
                if flag is not None and flag in self._parked:
                    self._parked.remove(flag)  # woke by timeout, not by submit
                if self._closed or self._active() > self._size:
                    self._threads.discard(me)
                    return
                if not self._queue:
                    flag = Flag()
                    self._parked.append(flag)
                    job = None
                else:
                    flag = None
                    job = self._queue.popleft()
                    self._running += 1
                    self._space.notify()
            if job is None:
                assert flag is not None
                flag.wait(5.0)
                continue
            try:
                job()
            finally:
                with self._lock:
                    self._running -= 1
            self._linger()

    def _linger(self) -> None:
        """Poll ``spin`` seconds for the next job before parking: a thread that is awake
        takes it sooner than one woken from sleep (back-to-back calls, mostly). Meanwhile
        it reads incoming frames itself (``intake``) and runs a call it reads: the call
        then reaches a thread without a hand-off from the transport's reader thread."""
        intake = self.intake
        if intake is None or self._active() > self._size:
            end = time.perf_counter() + self.spin
            while not self._queue and time.perf_counter() < end:
                os.sched_yield()
            return
        intake.watch(True)
        try:
            end = time.perf_counter() + self.spin
            while not self._queue and not self._closed and time.perf_counter() < end:
                read, job = intake.take()
                if job is not None:
                    intake.watch(False)  # the reader thread reads while this one runs it
                    try:
                        self._run(job)
                    finally:
                        intake.watch(True)
                    end = time.perf_counter() + self.spin
                elif not read:
                    os.sched_yield()
        finally:
            intake.watch(False)

    def _run(self, job: Job) -> None:
        """Run a job this thread read itself (counted as running, like a queued one)."""
        with self._lock:
            if self._closed:
                return
            self._running += 1
        try:
            job()
        finally:
            with self._lock:
                self._running -= 1

    @contextlib.contextmanager
    def blocked(self) -> Iterator[None]:
        """Mark this pool thread as waiting on the network while the block runs."""
        with self._lock:
            self._blocked += 1
            if self._queue and not self._parked and self._active() < self._size \
                    and len(self._threads) < self._max_threads:
                self._spawn()
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1

    def busy(self) -> int:
        """Jobs queued or running."""
        with self._lock:
            return len(self._queue) + self._running

    def close(self, timeout: float) -> list[str]:
        """Stop every thread; return the names of threads still running a job at the end."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            for f in self._parked:
                f.set()
            self._space.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for t in threads:
            if t is not me:
                t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in threads if t.is_alive() and t is not me]
