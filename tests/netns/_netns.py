"""Simulated hosts for tests: Linux network namespaces joined by a private bridge.

    with netns_lab(2, workdir) as lab:                 # raises Unavailable(reason)
        ranks = lab.run(script, placement=[0, 0, 1, 1], args=..., env=..., timeout=40)

Each simulated host is a network namespace with one veth (``eth0``, address
``lab.addrs[h]``) plugged into a bridge that lives in a further "switch" namespace.
Every interface is created directly inside a namespace of this lab, never in the
caller's own, so the machine's real interfaces are not touched; the subnet
``10.77.X.0/24`` is drawn at random per lab (labs are isolated from each other in any
case: each has its own switch). A rank runs as ``ip netns exec HOST python script``,
its output in ``workdir/rank<R>.log``; processes share the file system, so a FileStore
in ``workdir`` is a rendezvous every host reaches.

``close()`` (the context manager calls it, whatever happened) SIGKILLs every rank's
process group and deletes the namespaces, and with them their interfaces. Namespace
names carry the pid of the process that made them; a lab removes those whose maker is
dead (a test run killed outright), so nothing piles up.

Needs root and iproute2; :class:`Unavailable` says why not, for a skip message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

from tandem._proc import process_alive

__all__ = ["Unavailable", "NetnsLab", "RankRun", "netns_lab", "unavailable_reason"]

PREFIX = "tandem-lab-"
# inherited settings that would change what a rank does (and every TANDEM_*, the job
# secret included): each run passes its own
_SCRUB = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


class Unavailable(Exception):
    """Network namespaces cannot be used here; the message says why."""


@dataclasses.dataclass
class RankRun:
    rank: int
    host: int
    returncode: int | None  # None: killed at the deadline
    log: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def unavailable_reason() -> str:
    """Why namespaces cannot be made here (empty when they might be)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (platform {sys.platform})"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (euid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return ""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")


def _remove_stale() -> None:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    for line in listing.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):].partition("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not process_alive(int(pid)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


class NetnsLab:
    """``hosts`` namespaces on one bridge; see the module docstring."""

    def __init__(self, hosts: int, workdir: Path) -> None:
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.workdir = workdir
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{h}" for h in range(hosts)]
        subnet = random.randrange(256)
        self.addrs = [f"10.77.{subnet}.{h + 1}" for h in range(hosts)]
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []

    def setup(self) -> None:
        """Create the namespaces and the network; raise :class:`Unavailable` on failure."""
        _remove_stale()
        for ns in (self.switch, *self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
        _ip("link", "set", "br0", "up", ns=self.switch)
        for h, (ns, addr) in enumerate(zip(self.names, self.addrs)):
            port = f"p{h}"
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", port, "netns",
                self.switch, ns=ns)
            _ip("link", "set", port, "master", "br0", "up", ns=self.switch)
            _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)  # a host reaches its own address via lo
        probe = subprocess.run(["ip", "netns", "exec", self.names[0], "true"],
                               capture_output=True, text=True, timeout=20)
        if probe.returncode != 0:
            raise Unavailable(f"`ip netns exec` does not work here: {probe.stderr.strip()}")

    def run(self, script: Path, placement: Sequence[int], args: Callable[[int], list[str]],
            env: Callable[[int], dict[str, str]], timeout: float,
            grace: float = 5.0) -> list[RankRun]:
        """Run ``script`` once per rank, rank ``r`` on host ``placement[r]``; wait for all.

        Ranks still running ``timeout`` seconds after the start, or ``grace`` seconds
        after another rank failed, are killed (returncode None).
        """
        base = {k: v for k, v in os.environ.items()
                if k not in _SCRUB and not k.startswith("TANDEM_")}
        procs = []
        for rank, host in enumerate(placement):
            with open(self.workdir / f"rank{rank}.log", "wb") as log:
                cmd = ["ip", "netns", "exec", self.names[host], sys.executable, str(script),
                       *args(rank)]
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=self.workdir,
                                        env={**base, **env(rank)}, start_new_session=True)
            self._procs.append(proc)
            procs.append(proc)
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or time.monotonic() >= deadline:
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + grace)
            time.sleep(0.05)
        self.kill()
        return [RankRun(r, placement[r], codes[r],
                        (self.workdir / f"rank{r}.log").read_text(errors="replace"))
                for r in range(len(procs))]

    def kill(self) -> None:
        """SIGKILL every rank still running, with anything it started."""
        for p in self._procs:
            if p.poll() is None:  # not reaped yet, so the pid (= its group id) is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)

    def close(self) -> None:
        try:
            self.kill()
        finally:
            for ns in reversed(self._made):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
            self._made.clear()


@contextlib.contextmanager
def netns_lab(hosts: int, workdir: Path) -> Iterator[NetnsLab]:
    """A set-up :class:`NetnsLab`, closed on exit; :class:`Unavailable` if it cannot be made."""
    why = unavailable_reason()
    if why:
        raise Unavailable(why)
    workdir.mkdir(parents=True, exist_ok=True)
    lab = NetnsLab(hosts, workdir)
    try:
        lab.setup()
        yield lab
    finally:
        lab.close()
