"""Open MPI's ``mpirun`` across simulated hosts: each host a network and UTS namespace.

    from tandem.testing.mpi import mpi_hosts

    with mpi_hosts(["a", "b"], workdir) as hosts:      # or Unavailable, saying why
        done = hosts.mpirun(["-np", "4", "--host", "a:2,b:2", "python", "train.py"],
                            timeout=60)

The hosts are a :class:`~tandem.testing.netns.NetnsLab`; ``mpirun`` runs on the first
one (so its address is the first host's, as when a job is started from one of its
nodes) with the given name as its hostname. It reaches the others through an rsh agent
(``workdir/agent``, in place of ssh) that maps a host name to its namespace and runs
the command there with ``nsenter --net=... unshare --uts`` under that host's name
(distinct names keep Open MPI's shared-memory transport from treating ranks of
different hosts as neighbours). MPI's own traffic stays on the lab's ``eth0``.
``close()`` SIGKILLs every process in the lab's namespaces, then deletes them.

Needs root, iproute2, util-linux and the Debian package ``openmpi-bin``
(``scripts/cluster_packages.sh``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from tandem.testing.netns import NetnsLab, Unavailable, unavailable_reason

__all__ = ["MpiHosts", "mpi_hosts", "mpi_unavailable"]

_AGENT = """#!/bin/sh
# rsh agent: AGENT [ssh options] HOST COMMAND...; runs COMMAND on HOST's namespace
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
ns=$(awk -v h="$host" '$1 == h {{print $2}}' {hosts})
[ -n "$ns" ] || {{ echo "rsh agent: unknown host $host" >&2; exit 255; }}
exec nsenter --net=/run/netns/$ns unshare --uts sh -c 'hostname "$0"; eval "$1"' "$host" "$*"
"""


def mpi_unavailable() -> str:
    """Why mpirun cannot be run across simulated hosts here (empty when it can)."""
    why = unavailable_reason()
    if why:
        return why
    missing = [t for t in ("mpirun", "nsenter", "unshare") if shutil.which(t) is None]
    if missing:
        return (f"missing {', '.join(missing)}: install the Debian package openmpi-bin "
                f"(bash scripts/cluster_packages.sh) and util-linux")
    return ""


class MpiHosts:
    """Named simulated hosts and an rsh agent for ``mpirun``; see the module docstring."""

    def __init__(self, names: Sequence[str], workdir: Path) -> None:
        self.names = list(names)
        self.workdir = workdir
        self.lab = NetnsLab(len(names), workdir / "net")
        self.agent = workdir / "agent"

    @property
    def addrs(self) -> dict[str, str]:
        return dict(zip(self.names, self.lab.addrs))

    def start(self) -> None:
        (self.workdir / "net").mkdir(parents=True, exist_ok=True)
        (self.workdir / "mpi").mkdir(exist_ok=True)
        self.lab.setup()
        hosts = self.workdir / "hosts"
        hosts.write_text("".join(f"{n} {ns}\n" for n, ns in zip(self.names, self.lab.names)))
        self.agent.write_text(_AGENT.format(hosts=hosts))
        self.agent.chmod(0o755)

    def mpirun(self, args: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
               cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """``mpirun ARGS`` on the first host; everything it started dies with the lab."""
        argv = ["mpirun", "--allow-run-as-root", "--mca", "plm_rsh_agent", str(self.agent),
                "--mca", "orte_tmpdir_base", str(self.workdir / "mpi"),
                "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
                *args]
        cmd = ["nsenter", f"--net=/run/netns/{self.lab.names[0]}", "unshare", "--uts", "sh",
               "-c", 'hostname "$0"; exec "$@"', self.names[0], *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env={**os.environ, **(env or {})})

    def close(self) -> None:
        try:
            self.lab.kill_all()
        finally:
            self.lab.close()


@contextlib.contextmanager
def mpi_hosts(names: Sequence[str], workdir: Path) -> Iterator[MpiHosts]:
    """Set-up :class:`MpiHosts`, closed on exit; :class:`Unavailable` says why not."""
    why = mpi_unavailable()
    if why:
        raise Unavailable(why)
    workdir.mkdir(parents=True, exist_ok=True)
    hosts = MpiHosts(names, workdir)
    try:
        hosts.start()
        yield hosts
    finally:
        hosts.close()
