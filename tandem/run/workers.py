"""The local worker processes of one attempt: start, watch, signal, stop.

Each worker is a new process (``start_new_session``) running
:mod:`tandem.run._worker`, which becomes the worker's supervisor
(:mod:`tandem.run._supervisor`) and forks the worker itself. Signals go to the
supervisor, which forwards them to the worker's process group (so helpers the worker
started, data loaders and compilers, receive them too); SIGKILL is never sent to a
supervisor that can be asked instead: it gets ``KILL_REQUEST`` and kills everything
under it, wherever it went. A reaper thread per worker waits for its supervisor's exit
and notes the time, so the agent knows the order in which ranks died without polling
races.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Protocol

from tandem.run._supervisor import KILL_REQUEST, cgroup_remove
from tandem.run.streams import Console, start_pump

__all__ = ["WorkerSpec", "Worker", "WorkerGroup", "BOOTSTRAP", "Process", "Launcher"]

BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker.py")
# How long a supervisor asked to kill everything may take before it is killed itself
# (then the job's cgroup, where there is one, still holds what the worker left).
KILL_GRACE = 15.0


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    rank: int
    local_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    error_file: str
    log_dir: str | None = None  # holds stdout.log and stderr.log when set
    stdout_console: bool = True
    stderr_console: bool = True
    cgroup: str = ""  # the job's cgroup, where the supervisor puts the worker
    label: str = ""  # how its output lines are prefixed (default ``rank<rank>``)
    guard: int = -1  # the job reaper's pipe, held by every supervisor (``_reaper.py``)


class Process(Protocol):
    """The worker's supervisor as the agent sees it: a ``subprocess.Popen``, or a process
    forked by the zygote (``tandem.run.warm.Adopted``); the agent's child either way."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def wait(self) -> int: ...


# starts ``spec``'s supervisor, giving it the pipe ``report`` (for the worker's pid) and
# pipes for the streams ``wanted``
Launcher = Callable[[WorkerSpec, int, "dict[str, bool]"], Process]


def popen(spec: WorkerSpec, report: int, wanted: dict[str, bool]) -> Process:
    """A new interpreter running the bootstrap: the usual (cold) start."""
    guard = ("--guard", str(spec.guard)) if spec.guard >= 0 else ()
    return subprocess.Popen(
        [*spec.argv[:2], "--report", str(report), *guard, *spec.argv[2:]], env=spec.env,
        start_new_session=True, pass_fds=(report,) if spec.guard < 0 else (report, spec.guard),
        stdout=subprocess.PIPE if wanted["stdout"] else subprocess.DEVNULL,
        stderr=subprocess.PIPE if wanted["stderr"] else subprocess.DEVNULL)


class Worker:
    """One running worker; ``returncode``/``exit_time`` are set by its reaper thread.
    ``launch`` starts its supervisor (default: :func:`popen`)."""

    def __init__(self, spec: WorkerSpec, out: Console, err: Console,
                 on_exit: threading.Event, launch: Launcher = popen) -> None:
        self.spec = spec
        self.returncode: int | None = None
        self.exit_time: float | None = None
        self.retired = False  # failed, and the job went on without it (tandem.elastic)
        self.start_time = time.time()
        self.worker_pid = 0  # the worker's own pid, as soon as its supervisor reports it
        files = {name: os.path.join(spec.log_dir, f"{name}.log") if spec.log_dir else None
                 for name in ("stdout", "stderr")}
        wanted = {"stdout": spec.stdout_console or files["stdout"] is not None,
                  "stderr": spec.stderr_console or files["stderr"] is not None}
        self._pid_pipe, report = os.pipe()  # the supervisor writes the worker's pid there
        try:
            self.proc = launch(spec, report, wanted)
        except BaseException:
            os.close(self._pid_pipe)
            raise
        finally:
            os.close(report)
        self.pid = self.proc.pid  # the supervisor's
        key = out.labelled(spec.label) if spec.label else spec.rank  # how its lines show
        self._key, self._out = key, out
        self._pumps = []
        if self.proc.stdout is not None:
            self._pumps.append(start_pump(self.proc.stdout, key,
                                          out if spec.stdout_console else None,
                                          files["stdout"], f"tandem-out-{spec.rank}"))
        if self.proc.stderr is not None:
            self._pumps.append(start_pump(self.proc.stderr, key,
                                          err if spec.stderr_console else None,
                                          files["stderr"], f"tandem-err-{spec.rank}"))
        self._reaper = threading.Thread(target=self._reap, args=(on_exit,),
                                        name=f"tandem-reap-{spec.rank}", daemon=True)
        self._reaper.start()

    def _reap(self, on_exit: threading.Event) -> None:
        # the supervisor writes the worker's pid and closes the pipe at once (or exits
        # first, having failed): known from the start, e.g. to ask it for a dump
        with os.fdopen(self._pid_pipe, "rb") as pipe:
            text = pipe.read(32)
        self.worker_pid = int(text) if text.isdigit() else 0
        if hasattr(os, "waitid"):
            try:  # wait without reaping: the zombie keeps the pid (and group id) ours
                os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                pass
        self.exit_time = time.time()
        if self.spec.cgroup:  # what a supervisor killed from outside could not clean up
            cgroup_remove(os.path.join(self.spec.cgroup, f"worker-{self.pid}"), KILL_GRACE)
        self.returncode = self.proc.wait()
        on_exit.set()

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def send(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (the worker and its children), through
        its supervisor; SIGKILL kills everything the worker started."""
        if not self.alive:
            return  # reaped: its pid may belong to someone else by now
        try:
            os.kill(self.pid, KILL_REQUEST if sig == signal.SIGKILL else sig)
        except ProcessLookupError:
            pass  # exiting: nothing left to signal

    def kill_supervisor(self) -> None:
        """The last resort, for a supervisor that does not answer ``KILL_REQUEST``."""
        if self.alive:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def join_output(self, timeout: float) -> None:
        """Wait until the worker's pipes are drained (its last lines printed)."""
        deadline = time.monotonic() + timeout
        for pump in self._pumps:
            pump.join(max(0.0, deadline - time.monotonic()))

    def show_as(self, label: str) -> None:
        """Prefix this worker's lines with ``[label]`` from now on (its rank changed:
        a spare took a lost worker's place, ranks closed up after a loss)."""
        self._out.relabel(self._key, label)


class WorkerGroup:
    """The workers of one node for one attempt."""

    def __init__(self, specs: list[WorkerSpec], out: Console, err: Console) -> None:
        self.specs = specs
        self.changed = threading.Event()  # set whenever a worker exits
        self.workers: list[Worker] = []
        self._out, self._err = out, err

    def start(self, stop: Callable[[], bool] = lambda: False, launch: Launcher = popen) -> None:
        """Start every worker with ``launch``, unless ``stop()`` says the job is ending
        meanwhile (a signal arrived); call from the main thread (PR_SET_PDEATHSIG follows
        it)."""
        for spec in self.specs:
            if stop():
                return
            self.add(spec, launch)

    def add(self, spec: WorkerSpec, launch: Launcher = popen) -> Worker:
        """Start one more worker (a replacement or a spare); from the main thread."""
        worker = Worker(spec, self._out, self._err, self.changed, launch)
        self.workers.append(worker)
        return worker

    def failed(self) -> list[Worker]:
        """Workers that failed, leaving out the retired ones the job went on without."""
        return [w for w in self.workers if not w.retired and w.returncode not in (None, 0)]

    def all_succeeded(self) -> bool:
        """Every worker that is not retired exited with status 0."""
        current = [w for w in self.workers if not w.retired]
        return bool(current) and all(w.returncode == 0 for w in current)

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if w.alive]

    def signal_all(self, sig: int) -> None:
        for w in self.alive():
            w.send(sig)

    def wait(self, timeout: float) -> bool:
        """Wait until every worker has exited; False if some still run after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(min(left, 0.05))
            self.changed.clear()
        return True

    def stop(self, sig: int | None, timeout: float) -> list[int]:
        """Send ``sig`` (None: it was already sent), SIGKILL after ``timeout``; the ranks hit."""
        hit = [w.spec.rank for w in self.alive()]
        if sig is not None:
            self.signal_all(sig)
        if not self.wait(timeout):
            self.kill_all()
        return hit

    def kill_all(self) -> None:
        """Kill every worker and all they started; wait until their supervisors are gone."""
        self.signal_all(signal.SIGKILL)
        if not self.wait(KILL_GRACE):
            for w in self.alive():
                w.kill_supervisor()
            self.wait(KILL_GRACE)

    def close(self, output_timeout: float = 2.0) -> None:
        """Kill any worker still running; wait (briefly) until their output is printed."""
        self.kill_all()
        deadline = time.monotonic() + output_timeout
        for w in self.workers:
            w.join_output(max(0.0, deadline - time.monotonic()))


def python_argv(target: str, args: tuple[str, ...], *, module: bool, no_python: bool,
                supervisor: tuple[str, ...]) -> tuple[str, ...]:
    """The worker command line: the bootstrap, its ``supervisor`` options, the user's target."""
    mode = ("--exec",) if no_python else ("-m",) if module else ("--",)
    return (sys.executable, BOOTSTRAP, *supervisor, *mode, target, *args)
