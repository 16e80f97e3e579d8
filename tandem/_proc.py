"""Whether a process is alive, for everything in tandem that cleans up after the dead.

Sweeps of leftovers (shared-memory segments, checkpoint temporaries, launcher scratch
directories) name the process that created them; they are removed only once that
process is gone::

    if not process_alive(pid):
        os.unlink(leftover)
"""

from __future__ import annotations

import os

__all__ = ["process_alive", "process_stopped"]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: exists and is not a zombie.

    A process of another user counts as alive (we may not signal it, so we cannot
    know better). A zombie has exited and only waits for its parent to collect its
    status, so it counts as dead: what it left behind is stale.
    """
    if pid <= 0:
        return False  # 0 and negative numbers name process groups, not a process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _state(pid) != b"Z"  # no /proc (not Linux): kill(0) succeeded, so it exists


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP; not a tracer)."""
    return _state(pid) == b"T"


def _state(pid: int) -> bytes:
    """The state letter of ``pid`` in /proc (R, S, T, Z, ...); empty if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) state ...": comm may hold spaces and parentheses
            return f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return b""
