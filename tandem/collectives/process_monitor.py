"""The observer of one process's groups: watchdog, flight-recorder dumps, timeline.

``init_process_group`` makes one :class:`Monitor` per process, ``new_group`` hands it
each new group (:meth:`Monitor.adopt`) and ``destroy_process_group`` closes it, which
stops its threads, writes the timeline and gives ``SIGUSR1`` back. It

* runs the :class:`~tandem.collectives.watchdog.Watchdog` (stall warnings, dumps when
  a group is aborted by a failure elsewhere, or a peer lost while calls are pending);
* dumps every group's flight recorder (:mod:`tandem.collectives.dump`) when a call
  fails, and on ``SIGUSR1`` if the signal was not already taken by the program (the
  handler only writes the file, from the main thread between two bytecodes; a
  forked child ignores it);
* owns the timeline, if one runs (``TANDEM_TIMELINE``, :func:`tandem.timeline`).

Each distinct failure (a group aborted, a peer lost) is dumped once; ``SIGUSR1`` and
explicit requests always write. The first dump of a process logs where it went.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from types import FrameType
from typing import Any, Callable, Hashable

from tandem.collectives.dump import snapshot, write_dump
from tandem.collectives.group import ProcessGroup
from tandem.collectives.timeline import Timeline
from tandem.collectives.watchdog import LOGGER, EarlyThread, Watchdog
from tandem.config import Settings
from tandem.errors import StateError
from tandem.store.base import Store
from tandem.transport import Transport

__all__ = ["Monitor"]

MAX_REASONS = 20  # reasons a dump lists (the latest ones)
DUMP_LOCK_TIMEOUT = 10.0


class Monitor:
    """See the module docstring. ``groups()`` lists the process's groups right now."""

    def __init__(self, rank: int, world_size: int, settings: Settings, transport: Transport,
                 store: Store | None, groups: Callable[[], list[ProcessGroup]],
                 early: EarlyThread | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.trace_dir = os.path.abspath(settings.trace_dir)
        self.notice = settings.dump_notice  # off under tandemrun, which says it once for all
        self.transport = transport
        self._groups = groups
        self._pid = os.getpid()
        self._lock = threading.RLock()  # reentrant: SIGUSR1 may arrive during a dump
        self._dumped: set[Hashable] = set()
        self._reasons: list[str] = []
        self._told = False
        self.timeline: Timeline | None = None
        self.watchdog: Watchdog | None = None
        if settings.flight_recorder > 0:
            self.watchdog = Watchdog(rank, world_size, groups, transport, store,
                                     settings.stall_warn, self.dump, early)
        elif early is not None:
            early.cancel()
        self._previous: Any = None
        self._closed = False
        self._installed = self._install_signal() if settings.flight_recorder > 0 else False
        if settings.timeline:
            self.start_timeline(settings.timeline)

    def adopt(self, group: ProcessGroup) -> None:
        """Watch ``group``: dump when its calls fail, draw them while a timeline runs."""
        gid = group.group_id
        # a failed call always dumps (its record is the freshest); the watchdog then
        # need not dump for the group's abort
        group.recorder.on_failure = lambda reason: self.dump(reason, ("abort", gid), again=True)
        group.recorder.timeline = self.timeline

    # -- dumps ---------------------------------------------------------------------------
    def dump(self, reason: str, once: Hashable | None = None, again: bool = False) -> str | None:
        """Write this rank's flight recorder; ``once``: skip if that key was dumped (unless
        ``again``), and remember it."""
        if not self._lock.acquire(timeout=DUMP_LOCK_TIMEOUT):
            return None
        try:
            if once is not None:
                if once in self._dumped and not again:
                    return None
                self._dumped.add(once)
            self._reasons = (self._reasons + [reason])[-MAX_REASONS:]
            job = self.watchdog.job if self.watchdog is not None else ""
            groups = self._groups()
            aborted = {g.group_id: e for g in groups
                       if (e := self.transport.aborted(g.group_id)) is not None}
            data = snapshot(self.rank, self.world_size, job, groups, aborted,
                            self.transport.lost_peers(), reason, self._reasons)
            try:
                path = write_dump(self.trace_dir, self.rank, data)
            except OSError as exc:
                LOGGER.warning("tandem: rank %d could not write its flight recorder to %s "
                               "(TANDEM_TRACE_DIR): %s", self.rank, self.trace_dir, exc)
                return None
            first, self._told = not self._told, True
        finally:
            self._lock.release()
        if first and reason != "SIGUSR1" and self.notice:
            LOGGER.warning("tandem: rank %d wrote its flight recorder to %s; 'python -m "
                           "tandem.trace %s' compares the ranks", self.rank, path, self.trace_dir)
        return path

    def _install_signal(self) -> bool:
        if (not hasattr(signal, "SIGUSR1")
                or threading.current_thread() is not threading.main_thread()):
            return False
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return False  # the program uses SIGUSR1 itself: leave it alone
        self._previous = signal.signal(signal.SIGUSR1, self._on_signal)
        return True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid or self._closed:
            return  # a forked child (a data loader worker), or the job's groups are gone
        path = self.dump("SIGUSR1")
        if path is not None and self.notice:
            # no logging here: its locks may be held by the code this signal interrupted
            os.write(2, f"tandem: rank {self.rank} wrote its flight recorder to {path}\n".encode())

    # -- timeline ------------------------------------------------------------------------
    def start_timeline(self, path: str, what: str = "TANDEM_TIMELINE") -> Timeline:
        if self.timeline is not None:
            raise StateError(f"a timeline is already being recorded (to {self.timeline.path})")
        timeline = Timeline(path, self.rank)
        timeline.check_writable(what)
        timeline.hook_optimizers()
        self.timeline = timeline
        for g in self._groups():
            g.recorder.timeline = timeline
        atexit.register(self.stop_timeline)  # a script that never destroys its group
        return timeline

    def stop_timeline(self) -> str | None:
        """Stop the timeline and write this rank's file; its path (None: none ran)."""
        timeline, self.timeline = self.timeline, None
        if timeline is None:
            return None
        atexit.unregister(self.stop_timeline)
        timeline.unhook_optimizers()
        for g in self._groups():
            g.recorder.timeline = None
        return timeline.write()

    # -- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.close()
        try:
            self.stop_timeline()
        except OSError as exc:  # checked at its start; a full disk must not stop the teardown
            LOGGER.warning("tandem: rank %d could not write its timeline: %s", self.rank, exc)
        if (self._installed and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGUSR1) == self._on_signal):
            signal.signal(signal.SIGUSR1, self._previous)
            self._installed = False  # else the handler stays, doing nothing (_closed)
        for g in self._groups():
            g.recorder.on_failure = None
