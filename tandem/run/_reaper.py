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
until none is left, and exits. Should the reaper itself have been killed as well, the
next launcher's reaper, as it starts, sweeps what is left: the marked processes of
this user whose mark names a launcher (``<pid>.<pid namespace>-...``) in our pid
namespace that is gone, and which no live reaper watches. Processes of other jobs and users carry another mark or
none, or their environment cannot be read: they are never touched. A process that
replaced its environment when it started a program (``env -i``, ``execve`` with its
own) carries no mark and escapes: only a cgroup holds those.
"""

import os
import re
import signal
import sys
import time
from typing import Dict, List, Set

MARK = "TANDEM_JOB_MARK"
SWEEP_TIMEOUT = 30.0  # seconds to keep killing while marked processes fork new ones
_OWNER = re.compile(r"(\d+)\.(\d+)-")  # a mark's launcher: pid.pid-namespace-random


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


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def abandoned() -> Dict[str, List[int]]:
    """Marked processes of this user left by jobs whose launcher and reaper are both gone
    (their launcher in this pid namespace): mark -> pids."""
    me, uid = os.getpid(), os.getuid()
    namespace = os.stat("/proc/self/ns/pid").st_ino
    prefix = f"{MARK}=".encode()
    marks: Dict[str, List[int]] = {}
    watched: Set[str] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = [a for a in f.read().split(b"\0") if a]
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"_reaper.py") for a in argv):
            watched.add(argv[-1].decode(errors="replace"))  # a live reaper's mark
        for entry in env:
            if entry.startswith(prefix):
                marks.setdefault(entry[len(prefix):].decode(errors="replace"),
                                 []).append(int(name))
    out = {}
    for mark, pids in marks.items():
        owner = _OWNER.match(mark)
        if (owner is None or int(owner.group(2)) != namespace or mark in watched
                or _running(int(owner.group(1)))):
            continue
        out[mark] = pids
    return out


def sweep_abandoned() -> List[int]:
    """Kill what jobs without a launcher or a reaper left; the pids killed."""
    killed: List[int] = []
    for mark in abandoned():
        killed += sweep(mark)
    return killed


def main(argv: List[str]) -> None:
    guard, mark = int(argv[0]), argv[1]
    try:
        sweep_abandoned()  # what earlier jobs left, their reapers killed too
    except Exception:  # noqa: BLE001 - our own job's watch must go on regardless
        pass
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
