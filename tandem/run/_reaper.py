"""The last resort: once the launcher and every supervisor are gone, kill what is left.

A worker's supervisor kills whatever the worker started (``_supervisor.py``), and a
cgroup, where the launcher could make one, holds them all. Without a cgroup nothing
finds the worker's helpers once the launcher and the supervisors are all killed
(SIGKILL, the OOM killer): a daemon that double-forked, or a child in a session of its
own, is then init's child, and no process of the job is left to look for it.

So each launcher starts this tiny process (standard library only, in a session of its
own) with two things::

    python _reaper.py GUARD_FD MARK

- ``GUARD_FD``, the read end of a pipe whose write end only the launcher and the
  supervisors hold (never a worker: it closes its copy at once). A read returns end
  of file when every one of them is gone, however they died;
- ``MARK``, the job's mark: every worker's environment holds ``TANDEM_JOB_MARK=MARK``
  (random, one per launch), and so does everything started from it that kept the
  environment it was started with, which is where ``/proc/<pid>/environ`` reads it.

It then kills, with SIGKILL, every process whose environment holds exactly that mark,
until none is left, and exits. Processes of other jobs and users carry another mark or
none, or their environment cannot be read: they are never touched. A process that
replaced its environment when it started a program (``env -i``, ``execve`` with its
own) carries no mark and escapes: only a cgroup holds those.
"""

import os
import signal
import sys
import time
from typing import List, Set

MARK = "TANDEM_JOB_MARK"
SWEEP_TIMEOUT = 30.0  # seconds to keep killing while marked processes fork new ones


def marked(mark: str) -> List[int]:
    """The processes (other than this one) whose environment holds ``MARK=mark``."""
    wanted = f"{MARK}={mark}".encode()
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue  # gone, or another user's: not ours
        if wanted in env.split(b"\0"):
            found.append(int(name))
    return found


def sweep(mark: str, timeout: float = SWEEP_TIMEOUT) -> List[int]:
    """SIGKILL every process marked ``mark`` until none is left; the pids killed."""
    killed: Set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        pids = marked(mark)  # a zombie has no environment left: it is not found again
        if not pids or time.monotonic() >= deadline:
            return sorted(killed)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.01)


def main(argv: List[str]) -> None:
    guard, mark = int(argv[0]), argv[1]
    while True:  # until every holder of the write end is gone
        try:
            if not os.read(guard, 64):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    sweep(mark)  # its output goes nowhere: the launcher that would show it is gone

if __name__ == "__main__":
    main(sys.argv[1:])
