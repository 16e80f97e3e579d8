"""A real SLURM cluster on one machine: munged, slurmctld and N slurmd, each node its own host.

    from tandem.testing.slurm import slurm_cluster

    with slurm_cluster(2, workdir) as cluster:          # or Unavailable, saying why
        done = cluster.run(["srun", "-N2", "--ntasks-per-node=2", "hostname"], timeout=30)
        cluster.leftovers()                              # processes a job left on a node

The hosts are a :class:`~tandem.testing.netns.NetnsLab`: host 0 is the controller and
the login host ``ctl`` (slurmctld runs there, and so does every client command given to
:meth:`SlurmCluster.run`), hosts 1..N are ``node1``..``nodeN``, one slurmd each. Every
daemon is started with ``nsenter --net=/run/netns/NS unshare --uts`` and given the
host's name (``ip netns exec`` remounts ``/sys``, and slurmd then finds no cgroup file
system); the tasks SLURM starts on a node inherit its namespaces, so they see its
address and name. Node names resolve nowhere, as on clusters whose ``NodeName`` is not
in DNS; SLURM reaches each node by its ``NodeAddr``. One munged in the caller's
namespace serves every host through its socket in ``workdir``.

Everything lives under ``workdir`` (configuration, key, spool, state, logs), the
lab's namespace names are unique, and each namespace has its own ports, so clusters of
concurrent test runs cannot meet. ``close()`` SIGKILLs every process in the lab's
namespaces (the daemons, and anything a job left there) and munged, by pid, then
deletes the namespaces. About 1.5 s from nothing to idle nodes on an idle machine.
Credentials live 10 s (``cred_expire``, SLURM's default 120 s), which is also how long a
requeued job waits before it starts again.

Needs root, iproute2, util-linux (nsenter, unshare) and the Debian packages
``slurm-wlm`` and ``munge`` (``scripts/cluster_packages.sh`` installs them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from tandem.testing.netns import NetnsLab, Unavailable, unavailable_reason

__all__ = ["SlurmCluster", "slurm_cluster", "slurm_unavailable", "namespace_command"]

_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scontrol", "sinfo", "nsenter",
          "unshare")
_UP_DEADLINE_S = 60.0


def slurm_unavailable() -> str:
    """Why a SLURM cluster cannot be made here (empty when it can)."""
    why = unavailable_reason()
    if why:
        return why
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return (f"SLURM's tools are missing ({', '.join(missing)}): install the Debian "
                f"packages slurm-wlm and munge (bash scripts/cluster_packages.sh)")
    return ""


def namespace_command(ns: str, hostname: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run in network namespace ``ns`` and a new UTS namespace named ``hostname``."""
    return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "sh", "-c",
            'hostname "$0"; exec "$@"', hostname, *argv]


def _conf(nodes: int, addrs: Sequence[str], d: Path, munge_socket: Path) -> str:
    node_lines = "\n".join(
        f"NodeName=node{n} NodeAddr={addrs[n]} NodeHostname=node{n} Sockets=1 "
        f"CoresPerSocket=2 ThreadsPerCore=1 State=UNKNOWN" for n in range(1, nodes + 1))
    return f"""\
ClusterName=tandemtest
SlurmctldHost=ctl({addrs[0]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
TmpFS={d}/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
MailProg=/bin/true
JobRequeue=1
KillWait=3
MinJobAge=600
SchedulerParameters=sched_interval=1
{node_lines}
PartitionName=debug Nodes=node[1-{nodes}] Default=YES State=UP MaxTime=INFINITE
"""


class SlurmCluster:
    """munged, slurmctld and ``nodes`` slurmd on a :class:`NetnsLab`; see the module docstring."""

    def __init__(self, nodes: int, workdir: Path) -> None:
        self.nodes = nodes
        self.workdir = workdir
        self.lab = NetnsLab(nodes + 1, workdir / "net")
        self.conf = workdir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.hostnames = ["ctl", *(f"node{n}" for n in range(1, nodes + 1))]
        self._daemons: list[subprocess.Popen[Any]] = []

    @property
    def node_addrs(self) -> list[str]:
        return self.lab.addrs[1:]

    def start(self) -> None:
        """Bring the daemons up and wait until every node is idle; :class:`Unavailable`."""
        d = self.workdir
        for sub in ("net", "state", "spool", "tmp"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for name in self.hostnames[1:]:
            (d / "spool" / name).mkdir(exist_ok=True)
            (d / "tmp" / name).mkdir(exist_ok=True)
        self.lab.setup()
        key, sock = d / "munge.key", d / "munge.sock"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(_conf(self.nodes, self.lab.addrs, d, sock))
        self._spawn(["munged", "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                     f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                     f"--seed-file={d}/munged.seed"], "munged")
        self._wait(lambda: sock.exists(), "munged's socket")
        self._spawn(namespace_command(self.lab.names[0], "ctl",
                                      ["slurmctld", "-D", "-f", str(self.conf)]), "slurmctld")
        for n in range(1, self.nodes + 1):
            self._spawn(namespace_command(self.lab.names[n], f"node{n}",
                                          ["slurmd", "-D", "-N", f"node{n}", "-f", str(self.conf)]),
                        f"slurmd-node{n}")
        self._wait(self._all_idle, f"{self.nodes} idle nodes in sinfo")

    def _spawn(self, argv: list[str], name: str) -> None:
        with open(self.workdir / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env,
                                    start_new_session=True)
        self._daemons.append(proc)

    def _all_idle(self) -> bool:
        done = self.run(["sinfo", "-h", "-N", "-o", "%T"], timeout=20, check=False)
        states = done.stdout.split()
        return len(states) == self.nodes and all(s == "idle" for s in states)

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _UP_DEADLINE_S
        while not ready():
            dead = [p.args for p in self._daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}"
                                 for f in sorted(self.workdir.glob("*.out"))
                                 + sorted(self.workdir.glob("*.log")))
                raise Unavailable(f"SLURM did not come up ({what}; exited: {dead}):\n{logs}")
            time.sleep(0.1)

    def command(self, argv: Sequence[str], host: int = 0) -> list[str]:
        """``argv`` as it runs on ``host`` (0: the login host ``ctl``)."""
        return namespace_command(self.lab.names[host], self.hostnames[host], argv)

    def run(self, argv: Sequence[str], timeout: float, check: bool = True,
            env: Mapping[str, str] | None = None, cwd: Path | None = None,
            ) -> subprocess.CompletedProcess[str]:
        """Run a client command (srun, sbatch, scontrol ...) on the login host."""
        done = subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, env={**self.env, **(env or {})}, cwd=cwd)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[str]:
        """Start a client command on the login host (killed by :meth:`close` if left)."""
        proc = subprocess.Popen(self.command(argv), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=cwd,
                                env={**self.env, **(env or {})}, start_new_session=True)
        self._daemons.append(proc)
        return proc

    def leftovers(self) -> dict[str, list[str]]:
        """Per node, the processes running there other than slurmd: ``pid command``."""
        found: dict[str, list[str]] = {}
        for host in range(1, self.nodes + 1):
            for pid in self.lab.pids(host):
                with contextlib.suppress(OSError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    text = cmd.decode(errors="replace").strip()
                    if text and not text.startswith(("slurmd ", "nsenter ", "sh -c", "unshare ")):
                        found.setdefault(self.hostnames[host], []).append(f"{pid} {text}")
        return found

    def wait_no_leftovers(self, timeout: float) -> dict[str, list[str]]:
        """:meth:`leftovers` once none are left, or at ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.leftovers()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def close(self) -> None:
        """SIGKILL everything in the lab's namespaces and every daemon; delete the lab."""
        try:
            self.lab.kill_all()
            for proc in self._daemons:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
            for proc in self._daemons:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        finally:
            self.lab.close()


@contextlib.contextmanager
def slurm_cluster(nodes: int, workdir: Path) -> Iterator[SlurmCluster]:
    """A running :class:`SlurmCluster`, closed on exit; :class:`Unavailable` says why not."""
    why = slurm_unavailable()
    if why:
        raise Unavailable(why)
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(nodes, workdir)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


if __name__ == "__main__":  # bring a cluster up by hand: python -m tandem.testing.slurm DIR
    with slurm_cluster(2, Path(sys.argv[1])) as c:
        print(c.run(["srun", "-N2", "--ntasks-per-node=2", "hostname"], timeout=30).stdout)
