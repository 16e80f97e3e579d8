"""Warm starts: new workers forked from a zygote that has imported torch and tandem.

A worker started the usual way pays for a new interpreter, ``import torch``, tandem's
imports and, when its script makes its optimizer, ``torch._dynamo``'s (together 2.5 to
5 s on a loaded 2-core machine) before it is ready to join. When a job runs elastic (:mod:`tandem.run.inplace`), the agent starts one
zygote per node (``_zygote.py``, which describes the fork side), and new workers, the
replacements of lost ones and the spares, are forked from it::

    pool = WarmPool(template, say)    # template: a worker of this node, for its env
    pool.start()                      # the zygote imports; the agent goes on
    why = pool.unusable(spec)         # "" when ``spec`` may start warm
    if pool.ready():
        group.add(spec, launch=pool.launch)     # a Worker like any other
    pool.close()                      # the zygote is killed; no process is left

The agent is made a child subreaper while it has a zygote, and the zygote forks twice,
the middle process exiting at once: each new process becomes the agent's own child.
This was picked over the alternatives because the agent then treats it as any worker
it started itself: it waits for it without reaping (``waitid(WNOWAIT)``, so the pid
stays ours while it may be signalled), reads its exit status from the kernel, and the
new process's parent-death signal follows the agent, not the zygote. A pid file
descriptor would give no exit status; a zygote reporting exit statuses would tie every
worker's fate to the zygote's.

A worker starts cold (a new interpreter, as without a zygote), with one line saying
why, when the zygote failed or is not there (it imports, then checks it has a single
thread: numpy's BLAS starts a pool unless ``OMP_NUM_THREADS=1`` or
``OPENBLAS_NUM_THREADS=1``), when the worker runs another program (``--no-python``) or
another interpreter, or when its environment differs from the zygote's beyond what
each worker has of its own (the variables the launcher sets per worker): torch and
tandem read no other variable after their import, but they may read those at import.
``--no-warm-start`` turns warm starts off.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from typing import IO, Any, Callable, Collection

from tandem.run._supervisor import _children, _stat
from tandem.run._worker import PR_SET_CHILD_SUBREAPER, _prctl
from tandem.run.workers import BOOTSTRAP, WorkerSpec

__all__ = ["WarmPool", "Adopted", "ZYGOTE", "per_worker"]

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_zygote.py")
WARM_WAIT = 120.0  # seconds the zygote may take to import (4-12 s on a loaded 2-core host,
# 60 s and more at a load of 80): the first workers wait for it
REPLY_WAIT = 5.0  # seconds for the zygote to fork a worker (it takes milliseconds)
# variables that the launcher sets per worker: they may differ from the zygote's
PER_WORKER = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TANDEM_RESTART_COUNT", "TANDEM_MAX_RESTARTS", "TANDEM_RUN_ID", "TANDEM_ERROR_FILE",
    "TANDEM_TRACEBACK_ONCE", "TANDEM_TRACE_DIR", "TANDEM_TTY", "COLUMNS",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"})
PER_WORKER_PREFIXES = ("TANDEM_ELASTIC_",)


class Adopted:
    """A process forked by the zygote and adopted by the agent; used as a ``Popen``."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None

    def wait(self) -> int:
        """Reap it; its exit code, or minus the signal that killed it (as ``Popen``)."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class WarmPool:
    """One node's zygote, from the agent's side; see the module docstring."""

    def __init__(self, template: WorkerSpec, say: Callable[[str], None]) -> None:
        self._template = template
        # what every worker of the node shares: the zygote's imports must see no rank's own
        self._env = {k: v for k, v in template.env.items() if not per_worker(k)}
        self._say = say
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self.pid = 0  # the zygote's, once it is ready
        self.broken = ""  # why the zygote cannot serve (set once, never cleared)
        self._gate: tuple[int, int] | None = None  # see hold()
        self._started = 0.0

    # -- the zygote's life -----------------------------------------------------------
    def start(self) -> None:
        """Start the zygote (from the main thread: its parent-death signal follows it)."""
        unusable = self.unusable(self._template)
        if unusable:
            self._fail(unusable)
            return
        if not _prctl(PR_SET_CHILD_SUBREAPER, 1):
            self._fail("the launcher cannot adopt processes (PR_SET_CHILD_SUBREAPER)")
            return
        self._started = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, ZYGOTE, "--parent", str(os.getpid()),
                 "--socket", str(theirs.fileno())],
                env=self._env, pass_fds=(theirs.fileno(),), start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            self._fail(f"the zygote could not start: {exc}")
            return
        finally:
            theirs.close()
        self._sock = ours

    def ready(self) -> bool:
        """Whether the zygote waits for requests; notes a failure (see ``broken``)."""
        if self.pid or self.broken:
            return bool(self.pid) and not self.broken
        message = self._receive(0.0)
        if message is not None and "ready" in message:
            self.pid = int(message["ready"])
            self._say(f"warm starts ready: a zygote (pid {self.pid}) imported torch and "
                      f"tandem in {time.monotonic() - self._started:.1f}s")
            said = str(message.get("said", "")).rstrip()
            if said:  # import warnings: each worker started cold would have printed them
                self._say("what the zygote's imports printed (once for this node's workers):")
                for line in said.splitlines():
                    self._say(f"  {line}")
        elif message is not None:
            self._fail(f"the zygote failed: {message.get('error', message)}")
        elif self._proc is not None and self._proc.poll() is not None:
            self._fail(f"the zygote exited with status {self._proc.returncode}")
        return bool(self.pid)

    def warming(self) -> bool:
        """Whether the zygote is still importing: not ready, not failed, and within
        ``WARM_WAIT`` of its start (then it counts as failed)."""
        if self.ready() or self.broken:
            return False
        if time.monotonic() - self._started > WARM_WAIT:
            self._fail(f"the zygote was not ready within {WARM_WAIT:g}s of its start")
            return False
        return True

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the zygote to be ready; whether it is."""
        if self._sock is not None and not self.pid and not self.broken:
            select.select([self._sock], [], [], timeout)
        return self.ready()

    def _receive(self, timeout: float) -> dict[str, Any] | None:
        """The zygote's next message, if one comes within ``timeout``; ``{"error": ...}``
        when its end closed."""
        if self._sock is None:
            return None
        if not select.select([self._sock], [], [], timeout)[0]:
            return None
        try:
            data = self._sock.recv(1 << 16)
        except OSError as exc:
            data = json.dumps({"error": str(exc)}).encode()
        loaded: dict[str, Any] = json.loads(data) if data else {"error": "it exited"}
        return loaded

    def _fail(self, why: str) -> None:
        self.broken = why
        self._say(f"warm starts off: {why}; new workers start cold")
        self._stop()

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()  # SIGKILLed: at once
            self._proc = None

    def close(self) -> None:
        """Kill the zygote; the agent stops adopting (call once its workers are gone)."""
        self._stop()
        self.pid = 0
        self.broken = self.broken or "closed"
        _prctl(PR_SET_CHILD_SUBREAPER, 0)

    # -- workers --------------------------------------------------------------------
    def unusable(self, spec: WorkerSpec) -> str:
        """Why ``spec`` must start cold ("" if the zygote can fork it)."""
        argv = spec.argv
        if len(argv) < 2 or argv[0] != sys.executable or argv[1] != BOOTSTRAP:
            return f"the worker runs {argv[0] if argv else 'nothing'}, not this interpreter"
        if _mode(argv[2:]) == "--exec":
            return "the worker runs a program of its own (--no-python)"
        differ = sorted(k for k in set(spec.env) ^ set(self._env) | {
            k for k in set(spec.env) & set(self._env) if spec.env[k] != self._env[k]}
            if not per_worker(k))
        if differ:
            return f"its environment differs from the zygote's in {', '.join(differ[:5])}"
        return self.broken

    def launch(self, spec: WorkerSpec, report: int, wanted: dict[str, bool]) -> Adopted:
        """Fork ``spec``'s worker from the zygote (see ``workers.Launcher``); raises
        ``OSError`` when the zygote does not answer (the pool is then broken)."""
        if not self.ready() or self._sock is None:
            raise OSError(self.broken or "the zygote is not ready")
        ends: dict[str, tuple[int, int]] = {}
        try:
            for name in ("stdout", "stderr"):
                ends[name] = os.pipe() if wanted[name] else (-1, os.open(os.devnull, os.O_WRONLY))
            request = {"argv": list(spec.argv[2:]), "env": spec.env, "cwd": os.getcwd(),
                       "guard": spec.guard >= 0, "gate": self._gate is not None}
            socket.send_fds(self._sock, [json.dumps(request).encode()],
                            [ends["stdout"][1], ends["stderr"][1], report]
                            + ([spec.guard] if spec.guard >= 0 else [])
                            + ([self._gate[0]] if self._gate is not None else []))
            reply = self._receive(REPLY_WAIT)
        except (OSError, ValueError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for _, write in ends.values():
                os.close(write)
        if reply is None or "pid" not in reply:
            for read, _ in ends.values():
                if read >= 0:
                    os.close(read)
            why = reply.get("error", reply) if reply else f"no answer within {REPLY_WAIT:g}s"
            self._fail(f"the zygote could not fork a worker: {why}")
            raise OSError(self.broken)
        pipes = {name: os.fdopen(read, "rb") if read >= 0 else None
                 for name, (read, _) in ends.items()}
        return Adopted(int(reply["pid"]), pipes["stdout"], pipes["stderr"])

    def hold(self) -> None:
        """Hold the workers forked from now on until :meth:`release`: forked one after
        the other, the first would otherwise run seconds ahead of the last on a loaded
        host, where new interpreters all start at once (and, e.g., print the same
        ``--help`` close enough together for the console to merge it)."""
        if self._gate is None:
            self._gate = os.pipe()

    def release(self) -> None:
        """Let the workers held since :meth:`hold` run."""
        if self._gate is not None:
            for end in self._gate:
                os.close(end)
            self._gate = None

    def children(self) -> list[int]:
        """The agent's children that belong to the pool (the zygote)."""
        return [self._proc.pid] if self._proc is not None else []



def per_worker(name: str) -> bool:
    """Whether the launcher sets the variable ``name`` per worker (see ``PER_WORKER``)."""
    return name in PER_WORKER or name.startswith(PER_WORKER_PREFIXES)


def _mode(options: tuple[str, ...]) -> str:
    """How ``_worker.py`` runs its target, from its arguments: ``--``, ``-m`` or ``--exec``."""
    i = 0
    while i < len(options) and options[i] not in ("--", "-m", "--exec"):
        i += 2  # an option of the supervisor and its value
    return options[i] if i < len(options) else "--"


def reap_strays(known: Collection[int]) -> None:
    """Reap exited children of the agent that are no worker of it: processes adopted
    while it is a subreaper (a worker whose supervisor was killed, say)."""
    for pid in _children(os.getpid()) - set(known):
        if _stat(pid)[:1] == [b"Z"]:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass  # not ours after all
