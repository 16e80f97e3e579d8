"""A real Ray cluster on one machine: a head node and worker nodes, each its own host.

    from tandem.testing.ray import ray_cluster

    with ray_cluster(2, workdir) as cluster:             # or Unavailable, saying why
        done = cluster.run([sys.executable, "driver.py"], timeout=120)   # on the head node

The hosts are a :class:`~tandem.testing.netns.NetnsLab`: host 0 runs ``ray start
--head`` and every driver given to :meth:`RayCluster.run` (``RAY_ADDRESS`` is set to
the head), hosts 1.. run ``ray start --address=HEAD``. Each node is started with
``nsenter --net=... unshare --uts`` and named ``node1``, ``node2`` ... (as the SLURM
cluster's nodes are), with its own Ray temp directory (sockets and logs) and 2 CPUs.
Ray's default temp directory is never used, so ``ray.init()`` elsewhere on the machine
does not find this cluster, nor the cluster another one; its nodes and drivers share a
token of its own (``RAY_AUTH_TOKEN``), not the one in ``~/.ray``.

Memory is bounded: every Ray process (and every actor and driver they start) runs in a
cgroup of its own limited to ``memory_limit`` bytes where cgroup v1's memory controller
or cgroup v2 is writable (``bounded`` says whether it was); the object store of each
node gets 100 MB. ``close()`` SIGKILLs every process in the lab's namespaces and the
cgroup, by pid, then deletes both: never ``ray stop``, which stops every Ray process on
the machine, other users' included. A cluster whose maker was killed outright leaves its
cgroup and temp directory, named with the maker's pid: the next cluster removes them
(the lab removes the namespaces, killing what ran there). Measured on a loaded 2-core machine: about 40 s
from nothing to 2 alive nodes, ~1 GB resident.

Needs root, iproute2, util-linux (nsenter, unshare) and Ray (``pip install
'tandem[ray]'``; ``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from tandem._proc import process_alive
from tandem.testing.netns import NetnsLab, Unavailable, unavailable_reason
from tandem.testing.slurm import namespace_command

__all__ = ["RayCluster", "ray_cluster", "ray_unavailable", "HEAD_PORT"]

HEAD_PORT = 6379  # each node has its own network namespace: no other cluster shares it
_UP_DEADLINE_S = 180.0
_OBJECT_STORE_BYTES = 100_000_000
_CPUS_PER_NODE = 2
_NODE_ATTEMPTS = 3
_MEMORY_LIMIT = 6 << 30  # an idle 2-node cluster holds ~1 GB; ~80 MB and torch per actor
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_PREFIX = "tandem-ray-"  # then the pid of the process that made it: of a cgroup, a temp dir
_WAIT_NODES = """\
import sys, time, ray
want, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
ray.init(address=sys.argv[3], logging_level="ERROR", log_to_driver=False)
while time.monotonic() < deadline:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want:
        print(len(alive), flush=True)
        sys.exit(0)
    time.sleep(0.5)
sys.exit(f"{len(alive)} of {want} Ray nodes alive")
"""


def ray_unavailable() -> str:
    """Why a Ray cluster cannot be made here (empty when it can)."""
    why = unavailable_reason()
    if why:
        return why
    missing = [t for t in ("nsenter", "unshare") if shutil.which(t) is None]
    if missing:
        return f"util-linux's {', '.join(missing)} missing"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed: pip install 'tandem[ray]' (scripts/setup.sh installs it)"
    return ""


class _MemoryCgroup:
    """A cgroup limited to ``limit`` bytes for the cluster's processes, where one can be
    made (``path`` None otherwise: the cluster then runs unbounded, as Ray allows)."""

    def __init__(self, limit: int) -> None:
        self.path: Path | None = None
        name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        for root in (_CGROUP_V1, Path("/sys/fs/cgroup")):
            for stale in _stale(root):  # a run killed outright left it
                _MemoryCgroup._empty(stale)
        try:
            if (_CGROUP_V1 / "cgroup.procs").exists():
                path = _CGROUP_V1 / name
                path.mkdir()
                self.path = path
                (path / "memory.limit_in_bytes").write_text(str(limit))
            elif Path("/sys/fs/cgroup/cgroup.controllers").exists():
                path = Path("/sys/fs/cgroup") / name
                path.mkdir()
                self.path = path
                (path / "memory.max").write_text(str(limit))
        except OSError:
            self.close()

    def enter(self, argv: Sequence[str]) -> list[str]:
        """``argv``, started inside the cgroup (children follow it)."""
        if self.path is None:
            return list(argv)
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"),
                *argv]

    def pids(self) -> list[int]:
        if self.path is None:
            return []
        with contextlib.suppress(OSError):
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        return []

    def close(self) -> None:
        if self.path is not None:
            self._empty(self.path)
        self.path = None

    @staticmethod
    def _empty(path: Path) -> None:
        """SIGKILL every process in the cgroup at ``path``, by pid; remove it."""
        for _ in range(100):  # a killed process leaves the cgroup once it is reaped
            with contextlib.suppress(OSError, ValueError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def _stale(root: Path) -> list[Path]:
    """This module's cgroups or temp directories under ``root`` whose maker is gone."""
    found = []
    with contextlib.suppress(OSError):
        for entry in root.glob(f"{_PREFIX}*"):
            pid = entry.name[len(_PREFIX):].partition("-")[0]
            if pid.isdigit() and not process_alive(int(pid)):
                found.append(entry)
    return found


class RayCluster:
    """A Ray head and ``nodes - 1`` workers on a :class:`NetnsLab`; see the module docstring."""

    def __init__(self, nodes: int, workdir: Path, memory_limit: int = _MEMORY_LIMIT) -> None:
        self.nodes = nodes
        self.workdir = workdir
        self.lab = NetnsLab(nodes, workdir / "net")
        self.hostnames = [f"node{n + 1}" for n in range(nodes)]
        # Ray's unix sockets live in its temp directory: a pytest path is too long for them
        for stale in _stale(Path(tempfile.gettempdir())):
            shutil.rmtree(stale, ignore_errors=True)
        self.temp = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-"))
        self.cgroup = _MemoryCgroup(memory_limit)
        # every node and driver proves this token (Ray would otherwise make one in ~/.ray)
        self._token = secrets.token_hex(32)
        self._procs: list[subprocess.Popen[Any]] = []

    @property
    def bounded(self) -> bool:
        return self.cgroup.path is not None

    @property
    def address(self) -> str:
        return f"{self.lab.addrs[0]}:{HEAD_PORT}"

    @property
    def addrs(self) -> list[str]:
        return list(self.lab.addrs)

    def _env(self, node: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RAY_", "TANDEM_")) and k not in ("MASTER_ADDR",
                                                                      "MASTER_PORT", "RANK",
                                                                      "WORLD_SIZE")}
        env.update(RAY_TMPDIR=str(self.temp / f"n{node}"), RAY_USAGE_STATS_ENABLED="0",
                   PYTHONUNBUFFERED="1", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self._token)
        env.update(extra or {})
        return env

    def _ray(self, node: int, *args: str) -> list[str]:
        return [sys.executable, "-m", "ray.scripts.scripts", "start",
                f"--node-ip-address={self.lab.addrs[node]}", f"--num-cpus={_CPUS_PER_NODE}",
                f"--object-store-memory={_OBJECT_STORE_BYTES}", "--disable-usage-stats",
                f"--temp-dir={self.temp / f'n{node}'}", "--block", *args]

    def start(self) -> None:
        """Start every node and wait until all are alive; :class:`Unavailable` if not."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lab.setup()
        for node in range(self.nodes):
            (self.temp / f"n{node}").mkdir()
            args = (["--head", f"--port={HEAD_PORT}", "--include-dashboard=false"]
                    if node == 0 else [f"--address={self.address}"])
            self._start_node(node, args)
        done = self.run([sys.executable, "-c", _WAIT_NODES, str(self.nodes),
                         str(_UP_DEADLINE_S), self.address], timeout=_UP_DEADLINE_S + 30,
                        check=False)
        if done.returncode != 0:
            raise Unavailable(f"the Ray cluster did not come up ({done.stderr[-1500:]}):\n"
                              f"{self._logs()}")

    def _logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}"
                         for f in sorted(self.workdir.glob("ray-node*.out")))

    def _start_node(self, node: int, args: list[str]) -> None:
        """Start ``node`` and wait until its ``ray start`` says it runs. Ray gives a new
        node's raylet 30 s to register, fixed: on a machine loaded far past its cores
        that can pass, so a node that gave up is started again (up to 3 times)."""
        out = self.workdir / f"ray-node{node + 1}.out"
        for attempt in range(_NODE_ATTEMPTS):
            before = out.stat().st_size if out.exists() else 0
            proc = self._spawn(node, self._ray(node, *args), out)
            deadline = time.monotonic() + _UP_DEADLINE_S
            while time.monotonic() < deadline:
                with open(out, "rb") as f:
                    f.seek(before)
                    if b"Ray runtime started" in f.read():
                        return
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
            for pid in self.lab.pids(node):  # whatever the attempt left in the node
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        raise Unavailable(f"Ray node {node + 1} did not start in {_NODE_ATTEMPTS} "
                          f"attempts:\n{self._logs()}")

    def _spawn(self, node: int, argv: list[str], out_path: Path) -> subprocess.Popen[Any]:
        cmd = self.cgroup.enter(namespace_command(self.lab.names[node], self.hostnames[node],
                                                  argv))
        with open(out_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self._env(node),
                                    cwd=self.workdir, start_new_session=True)
        self._procs.append(proc)
        return proc

    def command(self, argv: Sequence[str], node: int = 0) -> list[str]:
        """``argv`` as it runs on ``node`` (0: the head), inside the cluster's cgroup."""
        return self.cgroup.enter(namespace_command(self.lab.names[node], self.hostnames[node],
                                                   argv))

    def run(self, argv: Sequence[str], timeout: float, check: bool = True,
            env: Mapping[str, str] | None = None, cwd: Path | None = None,
            local: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` (a driver) on the head node with ``RAY_ADDRESS`` set to the head;
        ``local``: without it, so that ``ray.init()`` starts a Ray of its own there (the
        cluster need not be started for that)."""
        extra = {} if local else {"RAY_ADDRESS": self.address}
        proc = subprocess.Popen(self.command(argv), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=cwd or self.workdir,
                                env=self._env(0, {**extra, **(env or {})}),
                                start_new_session=True)
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"{' '.join(argv)} ran past {timeout:g}s:\n{out[-3000:]}\n"
                                 f"{err[-3000:]}") from None
        done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n"
                                 f"{out[-3000:]}\n{err[-3000:]}")
        return done

    def close(self) -> None:
        """SIGKILL every process of the cluster, by pid; delete the lab and the cgroup."""
        try:
            self.lab.kill_all()
            for proc in self._procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            self.cgroup.close()
        finally:
            self.lab.close()
            shutil.rmtree(self.temp, ignore_errors=True)


@contextlib.contextmanager
def ray_cluster(nodes: int, workdir: Path, start: bool = True) -> Iterator[RayCluster]:
    """A running :class:`RayCluster` (``start=False``: its hosts only, for drivers that
    start Ray themselves), closed on exit; :class:`Unavailable` says why not."""
    why = ray_unavailable()
    if why:
        raise Unavailable(why)
    cluster = RayCluster(nodes, workdir)
    try:
        if start:
            cluster.start()
        else:
            cluster.workdir.mkdir(parents=True, exist_ok=True)
            cluster.lab.setup()
        yield cluster
    finally:
        cluster.close()


if __name__ == "__main__":  # bring a cluster up by hand: python -m tandem.testing.ray DIR
    with ray_cluster(2, Path(sys.argv[1])) as c:
        print(c.run([sys.executable, "-c", "import ray; ray.init(); print(ray.nodes())"],
                    timeout=120).stdout)
