"""The supervisor between the launcher and one worker: nothing the worker starts outlives it.

Every worker the launcher starts begins as a small process running ``_worker.py``. It
becomes the worker's supervisor: it forks the worker (a fork of a process that has
imported nothing but the standard library: about a millisecond, no second interpreter),
then loads this module, off the worker's way, and waits::

    launcher ── supervisor ── worker ── the worker's children, grandchildren, daemons...

What Linux offers, all used at once:

- The worker leads a process group of its own: signals reach it and every helper that
  stays in its group (data loaders, compilers); SIGKILL to the group ends them all.
- The supervisor is a child subreaper (``PR_SET_CHILD_SUBREAPER``): whatever loses its
  parent, even a process that started a session of its own or daemonised, becomes the
  supervisor's child instead of init's, so the supervisor can find and kill it.
- A cgroup (v2), when the launcher could create one (``--cgroup``): the worker and
  everything it starts stay inside whatever they do with sessions and groups, and
  ``cgroup.kill`` ends them all at once (a loop over ``cgroup.procs`` before Linux 5.14).
- Parent-death signals (``PR_SET_PDEATHSIG``): if the launcher dies, even by SIGKILL,
  the kernel sends the supervisor ``KILL_REQUEST``; it kills everything, removes the
  launcher's scratch directory (``--scratch``) and exits. The worker gets SIGKILL if
  the supervisor itself dies.

The launcher talks to the supervisor with signals: the ones it forwards (``--forward``)
go on to the worker's process group; ``KILL_REQUEST`` (``--kill-signal``) means "kill
everything now" (the launcher never SIGKILLs a supervisor it can ask). Once the worker
has exited, the supervisor kills what it left behind and exits with the worker's
status: its exit code, or death by the same signal. It imports the standard library
only, like ``_worker.py``, which loads it by path.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import sys
import threading
import time
from typing import NoReturn

__all__ = ["Supervisor", "KILL_REQUEST", "cgroup_kill", "cgroup_remove"]

# A real-time signal nobody else sends; SIGUSR2 where there are none (then it cannot
# also be forwarded).
KILL_REQUEST = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
KILL_TIMEOUT = 10.0  # seconds to make everything left under the worker go away
WATCH_INTERVAL = 0.5  # where there are no parent-death signals: how often to look


class _Stop(Exception):
    """Raised by the KILL_REQUEST handler to leave the supervisor's wait."""


def _say(line: str) -> None:
    """One line on stderr: a pipe to the launcher, with no reader once it has died
    (Python ignores SIGPIPE, so the write raises): that must not stop a clean-up."""
    try:
        sys.stderr.write(f"tandemrun supervisor: {line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def cgroup_kill(path: str) -> None:
    """SIGKILL every process in the cgroup at ``path`` (with ``cgroup.kill``, Linux 5.14+,
    also those of the cgroups below it)."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
        return
    except FileNotFoundError:
        if not os.path.isdir(path):
            return
    except OSError:
        pass
    for _ in range(100):  # before Linux 5.14: one by one, until nothing is left
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(line) for line in f if line.strip()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def cgroup_remove(path: str, timeout: float) -> bool:
    """Kill what is left in the cgroup at ``path`` and remove it (its children first)."""
    deadline = time.monotonic() + timeout
    for root, dirs, _ in os.walk(path, topdown=False):
        for name in dirs:
            _rmdir_when_empty(os.path.join(root, name), deadline)
    return _rmdir_when_empty(path, deadline)


def _rmdir_when_empty(path: str, deadline: float) -> bool:
    while True:
        cgroup_kill(path)
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            # EBUSY while the killed processes finish exiting
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
        time.sleep(0.01)


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` that has not exited (without /proc: none found).

    Zombies are walked through, not reported: a zombie's children are still its own
    until it is collected.
    """
    found: set[int] = set()
    live: set[int] = set()
    todo = [pid]
    while todo:
        for child in _children(todo.pop()) - found:
            found.add(child)
            todo.append(child)
            if _stat(child)[:1] not in ([b"Z"], [b"X"], []):
                live.add(child)
    return live


def _children(pid: int) -> set[int]:
    """The children of ``pid``, from /proc: its own list where the kernel keeps one
    (cheap on a host with many processes), else a look at every process's parent."""
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        return {int(p) for p in os.listdir("/proc")
                if p.isdigit() and _stat(int(p))[1:2] == [str(pid).encode()]}
    found: set[int] = set()
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found  # gone: its children come to us and are found next time
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            continue
    return found


def _stat(pid: int) -> list[bytes]:
    """State (R, S, Z, ...) and parent pid of ``pid``, then more (empty if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()  # after "pid (comm)"
    except OSError:
        return []


class Supervisor:
    """The supervisor of the already forked ``worker``; see the module docstring.

    ``_worker.py`` forks with the forwarded signals and ``kill_signal`` blocked, then::

        Supervisor(parent, forward, kill_signal, worker=pid, ...).supervise()  # exits

    ``told``: whether the kernel sends ``kill_signal`` when the launcher dies; if not,
    a thread watches for it.
    """

    def __init__(self, parent: int, forward: list[int], kill_signal: int, *, worker: int,
                 told: bool, cgroup: str = "", scratch: str = "", report_fd: int = -1) -> None:
        self.parent = parent
        self.forward = [s for s in forward if s not in (kill_signal, signal.SIGCHLD)]
        self.kill_signal = kill_signal
        self.worker = worker
        self.told = told
        self.job_cgroup = cgroup
        self.cgroup = ""  # this worker's own, under the job's
        self.scratch = scratch
        self.report_fd = report_fd
        self._blocked = {*forward, kill_signal}  # as _worker.py blocked them
        self._waiting = False  # in supervise()'s wait for the worker

    def _start(self) -> None:
        """Everything to do before waiting (signals are still blocked)."""
        self._report()
        self._make_cgroup()
        self._contain()
        for sig in self.forward:
            signal.signal(sig, self._pass_on)
        signal.signal(self.kill_signal, self._stop)
        if not self.told:  # no parent-death signal here: look for ourselves
            threading.Thread(target=self._watch_parent, daemon=True).start()

    def _make_cgroup(self) -> None:
        if not self.job_cgroup:
            return
        path = os.path.join(self.job_cgroup, f"worker-{os.getpid()}")
        try:
            os.mkdir(path)
            self.cgroup = path
        except OSError as exc:
            _say(f"cannot create the cgroup {path}: {exc}")

    def _contain(self) -> None:
        """Move the worker into its cgroup, while it starts: a move takes 5-10 ms (the
        kernel waits for an RCU grace period), too long to hold up every worker's start.
        What the worker started before it moved is moved after it."""
        if not self.cgroup:
            return
        procs = -1
        try:
            procs = os.open(os.path.join(self.cgroup, "cgroup.procs"), os.O_WRONLY)
            os.write(procs, str(self.worker).encode())
            for pid in _descendants(self.worker):  # those it forked before it moved
                try:
                    os.write(procs, str(pid).encode())  # one pid per write
                except ProcessLookupError:
                    pass  # exited meanwhile
        except ProcessLookupError:
            pass  # the worker exited already; the clean-up finds what it left
        except OSError as exc:
            _say(f"cannot move the worker into the cgroup {self.cgroup}: {exc}; the "
                 f"supervisor alone cleans up after it")
        finally:
            if procs >= 0:
                os.close(procs)

    def _report(self) -> None:
        """Tell the launcher the worker's pid (it only knows ours)."""
        if self.report_fd < 0:
            return
        try:
            os.write(self.report_fd, str(self.worker).encode())
        except OSError:
            pass  # the launcher is gone; nobody reads it
        os.close(self.report_fd)

    def _pass_on(self, signum: int, frame: object) -> None:
        try:
            os.killpg(self.worker, signum)
        except OSError:
            pass  # the group is empty: the worker is exiting

    def _stop(self, signum: int, frame: object) -> None:
        if self._waiting:  # once the cleanup has begun, it goes on regardless
            raise _Stop()

    def _watch_parent(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(WATCH_INTERVAL)
        os.kill(os.getpid(), self.kill_signal)

    def supervise(self) -> NoReturn:
        """Wait for the worker (collecting orphans meanwhile); clean up; exit as it did."""
        self._start()
        self._waiting = True
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self._blocked)
            while True:
                done = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
                if done is None or done.si_pid == self.worker:
                    break
                os.waitpid(done.si_pid, 0)  # an orphan that ended: collect it
            self._waiting = False  # in the try: a _Stop raised before this line is caught
        except _Stop:
            pass
        self._waiting = False
        # nothing is forwarded any more: the worker's pid is about to be released
        signal.pthread_sigmask(signal.SIG_BLOCK, self._blocked)
        status = 1 << 8  # exit code 1, should _end_everything itself fail
        try:
            status = self._end_everything()
            # the launcher is gone: clean up after it too. The scratch directory first:
            # nothing below us can write there any more, and removing our cgroup may
            # wait for the kernel (up to KILL_TIMEOUT)
            self._remove_scratch()
            if self.cgroup:
                cgroup_remove(self.cgroup, KILL_TIMEOUT)
            if self.job_cgroup and os.getppid() != self.parent:
                try:
                    os.rmdir(self.job_cgroup)  # the last supervisor to leave succeeds
                except OSError:
                    pass
        finally:
            self._remove_scratch()  # the launcher may have died meanwhile
            self._exit_like(status)

    def _remove_scratch(self) -> None:
        if self.scratch and os.getppid() != self.parent:
            import shutil  # only here: 3 ms of imports nobody else needs

            shutil.rmtree(self.scratch, ignore_errors=True)
            if not os.path.exists(self.scratch):
                self.scratch = ""

    def _end_everything(self) -> int:
        """SIGKILL the worker and everything below it, wherever it went; collect them all
        and return the worker's wait status."""
        deadline = time.monotonic() + KILL_TIMEOUT
        if self.cgroup:
            cgroup_kill(self.cgroup)
        try:  # the worker, alive or a zombie, still holds its process group's id
            os.killpg(self.worker, signal.SIGKILL)
        except OSError:
            pass
        status = self._collect_worker(deadline)
        while True:
            if self.cgroup:
                cgroup_kill(self.cgroup)
            left = _descendants(os.getpid())
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:  # collect whatever has exited (the worker's orphans come to us)
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                return status  # nothing is left at all
            if time.monotonic() >= deadline:
                _say(f"processes {sorted(left)} did not die within {KILL_TIMEOUT:.0f}s "
                     f"of SIGKILL")
                return status
            time.sleep(0.005)

    def _collect_worker(self, deadline: float) -> int:
        """The worker's wait status, once it has died of its own or of our SIGKILL."""
        while True:
            pid, status = os.waitpid(self.worker, os.WNOHANG)
            if pid:
                return status
            if time.monotonic() >= deadline:
                return int(signal.SIGKILL)  # stuck in the kernel: report it as killed
            time.sleep(0.005)

    def _exit_like(self, status: int) -> NoReturn:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the worker dumped its own
            if sig != signal.SIGKILL:
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
            os.kill(os.getpid(), sig)
            os._exit(128 + sig)  # a signal that does not kill (e.g. ignored by default)
        os._exit(os.waitstatus_to_exitcode(status))
