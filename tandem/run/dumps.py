"""What the launcher collects from a job for ``python -m tandem.trace``.

Before it stops a failed job, the launcher asks every live worker to dump its
flight recorder: a worker running tandem catches ``SIGUSR1`` and writes
``TANDEM_TRACE_DIR/rank<N>.json`` (``tandem.collectives.dump``). Only workers that
catch the signal get it (Linux: the ``SigCgt`` mask of ``/proc/<pid>/status``;
elsewhere no worker is asked), and only the worker process, not its children, whose
default action for ``SIGUSR1`` is to die. The launcher waits until each asked worker
has replaced its file, at most :data:`DUMP_WAIT` seconds, then stops the job as
before. With ``TANDEM_TIMELINE`` set, the ranks' timelines are merged when the job
ends.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Mapping, Sequence

from tandem.collectives.trace_files import dump_path, who
from tandem.run.workers import Worker
from tandem.trace.merge import merge_timeline

__all__ = ["DUMP_CLOCK_SLACK", "DUMP_WAIT", "trace_dir", "request_dumps", "fresh_dumps",
           "merge_job_timeline"]

DUMP_WAIT = 2.0  # seconds; a dump takes milliseconds once the worker's main thread runs
DUMP_CLOCK_SLACK = 0.01  # a file's mtime (the kernel's coarse clock) trails time.time() by a tick
DEFAULT_DIR = "tandem-trace"  # tandem's own default (TANDEM_TRACE_DIR), in the worker's cwd


def trace_dir(env: Mapping[str, str]) -> str:
    """Where a worker started with ``env`` (in this directory) writes its dumps."""
    return os.path.abspath(env.get("TANDEM_TRACE_DIR") or DEFAULT_DIR)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (False where unknown)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def request_dumps(workers: Sequence[Worker], timeout: float = DUMP_WAIT) -> list[int]:
    """Ask the workers that can to dump their flight recorders; the ranks that did."""
    asked: dict[int, tuple[Worker, str, int | None]] = {}
    for w in workers:
        # the worker itself, not its supervisor (which would pass the signal to the
        # worker's whole group, helpers included); its pid stays the worker's while the
        # supervisor, its parent, lives
        pid = w.worker_pid
        if w.alive and pid and catches(pid, signal.SIGUSR1):
            path = dump_path(trace_dir(w.spec.env), w.spec.rank)
            before = _inode(path)  # a dump replaces the file: a new inode
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
            asked[w.spec.rank] = (w, path, before)
    done: list[int] = []
    deadline = time.monotonic() + timeout
    while asked and time.monotonic() < deadline:
        for rank, (w, path, before) in list(asked.items()):
            now = _inode(path)
            if now is not None and now != before:
                done.append(rank)
                del asked[rank]
            elif not w.alive:
                del asked[rank]
        time.sleep(0.02)
    return sorted(done)


def fresh_dumps(workers: Sequence[Worker], since: float) -> str | None:
    """A line naming the dumps written since ``since`` (time.time()), None if none."""
    by_dir: dict[str, list[int]] = {}
    for w in workers:
        directory = trace_dir(w.spec.env)
        try:
            if os.stat(dump_path(directory, w.spec.rank)).st_mtime >= since:
                by_dir.setdefault(directory, []).append(w.spec.rank)
        except OSError:
            continue
    if not by_dir:
        return None
    parts = [f"{who(ranks)} in {d}" for d, ranks in by_dir.items()]
    return (f"flight recorders of {'; '.join(parts)}; 'python -m tandem.trace "
            f"{next(iter(by_dir))}' says where the ranks diverged")


def merge_job_timeline(env: Mapping[str, str]) -> str | None:
    """Merge the ranks' timelines if the job recorded one; a line saying where, or None."""
    path = env.get("TANDEM_TIMELINE")
    if not path:
        return None
    merged = merge_timeline(os.path.abspath(path))
    if merged is None:
        return None
    return f"timeline of {who(merged[1])} merged into {merged[0]}"
