"""What a job leaves on the host: nothing. The job's cgroup and its scratch directory.

Each worker has a supervisor (:mod:`tandem.run._supervisor`: process groups, a child
subreaper, parent-death signals); this module adds what the launcher itself holds::

    job = Containment.create()            # a cgroup v2 for the job's workers, if possible
    print(job.describe())                 # which mechanisms are active, and why not
    scratch = make_scratch()              # /tmp/tandemrun_<pid>...: logs, error files
    ...
    job.close()                           # kills anything left, removes the cgroup

The cgroup is ``tandemrun-<pid>.<pid namespace>-<random>`` below the launcher's own cgroup in the
unified (v2) hierarchy; each supervisor makes ``worker-<pid>`` in it and the worker
moves there. It needs write access to the launcher's cgroup (root, or a delegated
subtree such as systemd's ``user@.service``); elsewhere the supervisors alone keep
the promise, and :meth:`Containment.describe` says so. A launcher killed with SIGKILL
leaves both to its supervisors, which remove them on their way out; what a kill of
every process of the job leaves is swept by the next launcher of the same user.

Where there is no cgroup, a kill of the launcher and of every supervisor at once would
leave the workers' helpers (a daemon, a child in a session of its own) to init. The
job's reaper (``_reaper.py``, started here) outlives them all and kills every process
that carries the job's mark (``TANDEM_JOB_MARK`` in its environment) once they are gone.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile

from tandem._proc import process_alive
from tandem.run._reaper import MARK
from tandem.run._supervisor import cgroup_remove

__all__ = ["Containment", "make_scratch", "sweep"]

PREFIX = "tandemrun-"
SCRATCH_PREFIX = "tandemrun_"
# <prefix><pid>.<pid namespace>_...: a launcher's pid means something only in its own
# pid namespace (containers of one pod may share /tmp)
_OWNED = re.compile(r"tandemrun[-_](\d+)\.(\d+)[-_]")
REMOVE_TIMEOUT = 10.0
REAPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper.py")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _owner_tag() -> str:
    return f"{os.getpid()}.{_pid_namespace()}"


def _own_cgroup() -> str:
    """The directory of this process's cgroup in the unified hierarchy; OSError if none."""
    with open("/proc/self/cgroup") as f:
        path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    if path is None:
        raise OSError("this process is in no cgroup v2 hierarchy")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            # ... mount-root mount-point ... - fstype source options
            if fields[fields.index("-") + 1] == "cgroup2":
                root, mount = fields[3], fields[4]
                if path == root or path.startswith(root.rstrip("/") + "/"):
                    return os.path.join(mount, path[len(root):].lstrip("/"))
    raise OSError("no cgroup v2 hierarchy is mounted")


class Containment:
    """The job's cgroup, or why there is none, and its reaper; see the module docstring."""

    def __init__(self, cgroup: str = "", reason: str = "") -> None:
        self.cgroup = cgroup  # empty: none
        self.reason = reason  # why there is none
        self.mark = ""  # TANDEM_JOB_MARK of every worker (empty: no reaper)
        self.guard = -1  # the write end the reaper waits on: held by us and the supervisors
        self.reaper = 0  # its pid

    @classmethod
    def create(cls) -> Containment:
        job = cls._with_cgroup()
        job._start_reaper()
        return job

    @classmethod
    def _with_cgroup(cls) -> Containment:
        try:
            parent = _own_cgroup()
        except (OSError, ValueError, IndexError) as exc:
            return cls(reason=str(exc))
        try:  # opened for writing, not os.access: that says yes to root on a read-only mount
            os.close(os.open(os.path.join(parent, "cgroup.procs"), os.O_WRONLY))
        except OSError as exc:
            return cls(reason=f"no permission to move processes out of {parent} ({exc.strerror})")
        sweep(parent, PREFIX)
        path = os.path.join(parent, f"{PREFIX}{_owner_tag()}-{secrets.token_hex(3)}")
        try:
            os.mkdir(path)
        except OSError as exc:
            return cls(reason=f"cannot create {path}: {exc}")
        return cls(path)

    def _start_reaper(self) -> None:
        """Start ``_reaper.py``: it kills every process marked with this job's mark once
        we and every supervisor are gone (whatever killed us)."""
        read, write = os.pipe()  # both ends not inherited unless passed
        mark = f"{_owner_tag()}-{secrets.token_hex(8)}"
        try:
            proc = subprocess.Popen(
                [sys.executable, "-S", REAPER, str(read), mark], pass_fds=(read,),
                start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env={k: v for k, v in os.environ.items()
                                                if k != MARK})
        except OSError:
            os.close(write)
            return  # describe() says there is none
        finally:
            os.close(read)
        self.mark, self.guard, self.reaper = mark, write, proc.pid
        self._reaper_proc = proc  # collected in close(), once it may have exited

    def describe(self) -> str:
        helpers = "a supervisor per worker (process group, subreaper, parent-death signal)"
        if self.reaper:
            helpers += (f" and a reaper (pid {self.reaper}) for what is left once the launcher "
                        f"and every supervisor are gone")
        if self.cgroup:
            return f"workers are contained by the cgroup {self.cgroup} and {helpers}"
        return f"workers are contained by {helpers}; no cgroup: {self.reason}"

    def worker_cgroup(self, supervisor: int) -> str:
        """The cgroup that the supervisor with pid ``supervisor`` made for its worker."""
        return os.path.join(self.cgroup, f"worker-{supervisor}") if self.cgroup else ""

    def close(self) -> None:
        """Kill whatever is still in the job's cgroup and remove it; let the reaper go
        (it sweeps once the last supervisor is gone, then exits)."""
        if self.cgroup:
            cgroup_remove(self.cgroup, REMOVE_TIMEOUT)
            self.cgroup = ""
        if self.guard >= 0:
            os.close(self.guard)
            self.guard = -1
            # it outlives us on purpose: no warning about a child still running
            self._reaper_proc.returncode = 0


def make_scratch() -> str:
    """A new private directory for one launch, named after this launcher's pid."""
    root = tempfile.gettempdir()
    sweep(root, SCRATCH_PREFIX)
    return tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{_owner_tag()}_", dir=root)


def sweep(directory: str, prefix: str) -> None:
    """Remove what dead launchers of this user left in ``directory`` (a cgroup or /tmp)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    namespace = _pid_namespace()
    for name in names:
        owner = _OWNED.match(name) if name.startswith(prefix) else None
        if owner is None or int(owner.group(2)) != namespace:
            continue
        path = os.path.join(directory, name)
        try:
            if process_alive(int(owner.group(1))) or os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if prefix == PREFIX:
            cgroup_remove(path, REMOVE_TIMEOUT)
        else:
            shutil.rmtree(path, ignore_errors=True)

