"""Simulated hosts: Linux network namespaces joined by a private bridge, links optionally shaped.

    from tandem.testing.links import LinkShape
    from tandem.testing.netns import netns_lab

    with netns_lab(2, workdir, LinkShape.parse("1gbit:0.2ms")) as lab:   # or Unavailable
        lab.ping(0, 1)                    # round trips, seconds
        lab.throughput(0, 1)              # TCP payload bits/s from host 0 to host 1
        ranks = lab.run([str(script)], placement=[0, 0, 1, 1], args=..., env=..., timeout=40)

Each simulated host is a network namespace with one veth (``eth0``, address
``lab.addrs[h]``) plugged into a bridge that lives in a further "switch" namespace.
Every interface is created directly inside a namespace of this lab, never in the
caller's own, so the machine's real interfaces are not touched; the subnet
``10.77.X.0/24`` is drawn at random per lab (labs are isolated from each other in any
case: each has its own switch). A rank runs as ``ip netns exec HOST python PROGRAM``
(or, ``preloaded``, forked with torch imported and moved into HOST with ``setns``),
its output in ``workdir/rank<R>.log``; processes share the file system, so a FileStore
in ``workdir`` is a rendezvous every host reaches. A rank still running at its
deadline is sent SIGABRT first, so its log ends with its threads' stacks.

A :class:`~tandem.testing.links.LinkShape` shapes every host's link (see there): a
``tbf`` on both ends of its veth for the rate, and a delay process
(``tandem.testing._delay``) in each host for delay and loss. Traffic between ranks of
one host stays on its loopback, unshaped, as on a real machine.

``close()`` (the context manager calls it, whatever happened) SIGKILLs every rank's
and helper's process group and deletes the namespaces, and with them their
interfaces, qdiscs and rules. Namespace names carry the pid of the process that made
them; a lab removes those whose maker is dead (a test run killed outright), so nothing
piles up.

Needs root and iproute2; :class:`Unavailable` says why not, for a skip message.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import faulthandler
import json
import os
import random
import resource
import runpy
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from tandem.testing import _mp
from tandem.testing.links import LinkShape
from tandem._proc import process_alive
from tandem._words import counted

__all__ = ["Unavailable", "LabError", "NetnsLab", "RankRun", "netns_lab", "unavailable_reason",
           "PREFIX"]

PREFIX = "tandem-lab-"
# inherited settings that would change what a rank does (and every TANDEM_*, the job
# secret included): each run passes its own
_SCRUB = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_HELPER_START_S = 20.0
_STACKS_S = 10.0  # for ranks sent SIGABRT at the deadline to write their stacks and exit


class Unavailable(Exception):
    """Network namespaces cannot be used here; the message says why."""


class LabError(RuntimeError):
    """The lab broke while in use (a link's delay process died, a probe failed)."""


@dataclasses.dataclass
class RankRun:
    rank: int
    host: int
    returncode: int | None  # None: killed at the deadline; negative: the signal that killed it
    log: str
    pid: int = 0
    ended: float | None = None  # wall clock time its end was seen (None: killed by the lab)
    # for a rank killed at the deadline: what it was doing (state, CPU it had, load);
    # the stacks of its threads then end its log
    killed: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def report(self, tail: int = 6000) -> str:
        """How the rank ended and the end of its log, for a failing test's message."""
        how = f"exit {self.returncode}" if self.returncode is not None else self.killed
        return f"--- rank {self.rank} on host {self.host}: {how} ---\n{self.log[-tail:]}"


def unavailable_reason() -> str:
    """Why namespaces cannot be made here (empty when they might be)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (platform {sys.platform})"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (euid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return ""


def _cmd(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")


def _ip(*args: str, ns: str | None = None) -> None:
    _cmd(["ip", *(["-n", ns] if ns else []), *args])


def _remove_stale() -> None:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    for line in listing.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = name[len(PREFIX):].partition("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not process_alive(int(pid)):
            # a run killed outright (SIGKILL) leaves its delay processes and ranks running
            # in its namespaces: they go first, or they would hold the namespace alive
            inside = subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                    text=True, timeout=20)
            for left in inside.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(left), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def _process_state(pid: int) -> str:
    """What process ``pid`` is doing, from /proc: program, state, kernel wait, CPU used."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        return "already gone"
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()  # state is field 3 of proc(5)
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    threads = int(fields[17])
    wait = f" in {wchan}" if wchan not in ("", "0") else ""
    return (f"{comm} state {fields[0]}{wait}, {counted(threads, 'thread')}, "
            f"{cpu:.1f} s of CPU")


def _read_line(proc: subprocess.Popen[bytes], deadline: float, what: str) -> str:
    """The first line ``proc`` prints, within ``deadline`` (a monotonic time)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    got = b""
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise LabError(f"{what} printed nothing in time")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise LabError(f"{what} exited: {proc.wait(5)}")
        got += chunk
    return got.decode().strip()


class NetnsLab:
    """``hosts`` namespaces on one bridge; see the module docstring."""

    def __init__(self, hosts: int, workdir: Path, link: LinkShape | None = None) -> None:
        tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.workdir = workdir
        self.link = link or LinkShape()
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{h}" for h in range(hosts)]
        subnet = random.randrange(256)
        self.addrs = [f"10.77.{subnet}.{h + 1}" for h in range(hosts)]
        self._made: list[str] = []
        self._procs: list[Any] = []  # subprocess.Popen or _Forked
        self._helpers: list[subprocess.Popen[bytes]] = []

    def setup(self) -> None:
        """Create the namespaces, the network and its shaping; raise :class:`Unavailable`."""
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
            if self.link.rate_bits:  # what the host sends, and what the switch sends it
                _cmd(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf",
                      *self.link.tbf_args()])
                _cmd(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", "tbf",
                      *self.link.tbf_args()])
        probe = subprocess.run(["ip", "netns", "exec", self.names[0], "true"],
                               capture_output=True, text=True, timeout=20)
        if probe.returncode != 0:
            raise Unavailable(f"`ip netns exec` does not work here: {probe.stderr.strip()}")
        if self.link.delay_s or self.link.loss:
            self._start_delays()

    def _start_delays(self) -> None:
        deadline = time.monotonic() + _HELPER_START_S
        for h, ns in enumerate(self.names):
            cmd = [*self._exec(h), "-m", "tandem.testing._delay", "--iface", "eth0",
                   "--delay", repr(self.link.delay_s), "--loss", repr(self.link.loss),
                   "--seed", str(h), "--parent", str(os.getpid())]
            log = open(self.workdir / f"delay-h{h}.log", "wb")
            with log:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self._helpers.append(proc)
        for h, proc in enumerate(self._helpers):
            try:
                _read_line(proc, deadline, f"the delay process of host {h}")
            except LabError as exc:
                err = (self.workdir / f"delay-h{h}.log").read_text(errors="replace")
                raise Unavailable(f"links cannot be delayed here: {exc}\n{err[-2000:]}") from exc

    def _exec(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], sys.executable]

    def check(self) -> None:
        """Raise :class:`LabError` if a link's delay process is gone (links unshaped)."""
        dead = [h for h, p in enumerate(self._helpers) if p.poll() is not None]
        if dead:
            raise LabError(f"the delay process of host(s) {dead} exited; see "
                           f"{self.workdir}/delay-h*.log")

    # -- measuring the links ---------------------------------------------------------
    def ping(self, src: int, dst: int, count: int = 20, timeout: float = 60.0,
             wait: float = 1.0) -> list[float | None]:
        """Round trips in seconds of ``count`` pings from host ``src`` to host ``dst``
        (None: no reply within ``wait`` seconds)."""
        cmd = [*self._exec(src), "-m", "tandem.testing._probe", "ping", self.addrs[dst],
               "--count", str(count), "--wait", repr(wait)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise LabError(f"ping from host {src} to {dst} failed: {done.stderr[-2000:]}")
        self.check()
        rtts: list[float | None] = json.loads(done.stdout)
        return rtts

    def throughput(self, src: int, dst: int, seconds: float = 2.0,
                   timeout: float = 60.0) -> float:
        """TCP payload bits per second from host ``src`` to host ``dst`` (one stream)."""
        deadline = time.monotonic() + timeout
        sink = subprocess.Popen([*self._exec(dst), "-m", "tandem.testing._probe", "sink",
                                 "--seconds", str(timeout)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        self._procs.append(sink)  # killed by close() like a rank, whatever happens
        try:
            port = _read_line(sink, deadline, f"the throughput sink on host {dst}")
            source = subprocess.run([*self._exec(src), "-m", "tandem.testing._probe", "source",
                                     self.addrs[dst], port, "--seconds", str(seconds)],
                                    capture_output=True, text=True,
                                    timeout=max(1.0, deadline - time.monotonic()))
            if source.returncode != 0:
                raise LabError(f"throughput source on host {src} failed: {source.stderr[-2000:]}")
            out, err = sink.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if sink.returncode != 0:
                raise LabError(f"throughput sink on host {dst} failed: {err.decode()[-2000:]}")
        finally:
            self._kill([sink])
        self.check()
        got = json.loads(out.decode().splitlines()[-1])
        if got["seconds"] <= 0:
            raise LabError(f"the throughput test from host {src} to {dst} was too short")
        return float(got["bytes"]) * 8 / float(got["seconds"])

    # -- running ranks ---------------------------------------------------------------
    def run(self, program: Sequence[str], placement: Sequence[int],
            args: Callable[[int], list[str]], env: Callable[[int], dict[str, str]],
            timeout: float, grace: float = 5.0, preloaded: bool = False) -> list[RankRun]:
        """Run ``python PROGRAM ARGS(rank)`` once per rank, rank ``r`` on host
        ``placement[r]``; wait for all. ``PROGRAM`` is e.g. ``[script]`` or ``["-m", mod]``.

        ``preloaded``: each rank is forked from :mod:`tandem.testing`'s process server,
        which has imported torch and tandem, and enters its host's namespace itself,
        instead of starting a fresh ``python`` there (whose import of torch was most of
        the CPU a short run needs: ~2 s a rank).

        Ranks still running ``timeout`` seconds after the start, or ``grace`` seconds
        after another rank failed, are killed (returncode None). Raises
        :class:`LabError` if the links lost their shaping meanwhile.
        """
        base = {k: v for k, v in os.environ.items()
                if k not in _SCRUB and not k.startswith("TANDEM_")}
        # a rank still running at the deadline is sent SIGABRT first: Python then writes
        # every thread's stack to its log, which says where it was stuck
        base["PYTHONFAULTHANDLER"] = "1"
        procs: list[Any] = []
        for rank, host in enumerate(placement):
            log_path = self.workdir / f"rank{rank}.log"
            if preloaded:
                proc: Any = _Forked(self.names[host], [*program, *args(rank)],
                                    {**base, **env(rank)}, self.workdir, log_path)
            else:
                with open(log_path, "wb") as log:
                    proc = subprocess.Popen([*self._exec(host), *program, *args(rank)],
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.workdir,
                                            env={**base, **env(rank)}, start_new_session=True)
            self._procs.append(proc)
            procs.append(proc)
        started = time.monotonic()
        deadline = started + timeout
        ended: list[float | None] = [None] * len(procs)
        while True:
            codes = [p.poll() for p in procs]
            now = time.time()
            ended = [e if e is not None or c is None else now for e, c in zip(ended, codes)]
            if all(c is not None for c in codes) or time.monotonic() >= deadline:
                break
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + grace)
            if any(h.poll() is not None for h in self._helpers):
                break  # reported by check() below, after the ranks are stopped
            time.sleep(0.05)
        killed = self._stop_with_stacks(procs, time.monotonic() - started)
        self._kill(procs)
        self.check()
        return [RankRun(r, placement[r], codes[r],
                        (self.workdir / f"rank{r}.log").read_text(errors="replace"),
                        procs[r].pid, ended[r], killed.get(r, ""))
                for r in range(len(procs))]

    @staticmethod
    def _stop_with_stacks(procs: Sequence[Any],
                          ran: float) -> dict[int, str]:
        """Describe each rank still running and make it write its stacks (SIGABRT);
        return the descriptions by rank."""
        load = "/".join(f"{x:.0f}" for x in os.getloadavg())
        out = {r: f"killed after {ran:.1f} s: {_process_state(p.pid)}, load {load}"
               for r, p in enumerate(procs) if p.poll() is None}
        for r in out:
            with contextlib.suppress(ProcessLookupError, OSError):
                # no core file of a rank in the test's directory
                resource.prlimit(procs[r].pid, resource.RLIMIT_CORE, (0, 0))
                os.kill(procs[r].pid, signal.SIGABRT)
        deadline = time.monotonic() + _STACKS_S  # writing stacks takes milliseconds
        for r in out:
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[r].wait(max(0.0, deadline - time.monotonic()))
        return out

    @staticmethod
    def _kill(procs: Sequence[Any]) -> None:
        """SIGKILL each process still running, with anything it started."""
        for p in procs:
            if p.poll() is None:  # not reaped yet, so the pid (= its group id) is still ours
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):  # a fork not yet in its group
                    os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()

    def kill(self) -> None:
        """SIGKILL every rank still running, with anything it started."""
        self._kill(self._procs)

    def pids(self, host: int) -> list[int]:
        """Every process in host ``host``'s network namespace, whoever started it there."""
        done = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True,
                              text=True, timeout=20)
        return [int(p) for p in done.stdout.split() if p.isdigit()]

    def kill_all(self) -> None:
        """SIGKILL every process in the lab's namespaces: daemons started there with
        ``nsenter``, and whatever they started (the lab's own ranks included)."""
        for host in range(len(self.names)):  # a namespace not made yet lists nobody
            for pid in self.pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        try:
            self._kill(self._procs + self._helpers)
        finally:
            for ns in reversed(self._made):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
            self._made.clear()


class _Forked:
    """A rank forked from tandem.testing's preloaded process server, with the part of
    ``subprocess.Popen``'s interface that :meth:`NetnsLab.run` uses."""

    stdout = stderr = None

    def __init__(self, netns: str, argv: list[str], env: dict[str, str], cwd: Path,
                 log: Path) -> None:
        self._process = _mp().Process(target=_forked_rank,
                                      args=(netns, argv, env, str(cwd), str(log)))
        self._process.start()
        self.pid: int = self._process.pid

    def poll(self) -> int | None:
        code: int | None = self._process.exitcode
        return code

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
        return int(code)


_CLONE_NEWNET = 0x40000000


def _forked_rank(netns: str, argv: list[str], env: dict[str, str], cwd: str,
                 log: str) -> None:
    """In a forked rank: enter host ``netns`` and run ``python *argv`` as that would."""
    os.setsid()  # its own group, as a started rank: killed with what it starts
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/run/netns/{netns}") as ns:
        if libc.setns(ns.fileno(), _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into network namespace {netns}")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    faulthandler.enable()  # what PYTHONFAULTHANDLER does for a started interpreter
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a fork ends with os._exit; an interpreter runs these


@contextlib.contextmanager
def netns_lab(hosts: int, workdir: Path, link: LinkShape | None = None) -> Iterator[NetnsLab]:
    """A set-up :class:`NetnsLab`, closed on exit; :class:`Unavailable` if it cannot be made."""
    why = unavailable_reason()
    if why:
        raise Unavailable(why)
    if link is not None and link.rate_bits and shutil.which("tc") is None:
        raise Unavailable("shaping a link's rate needs the `tc` command (iproute2)")
    workdir.mkdir(parents=True, exist_ok=True)
    lab = NetnsLab(hosts, workdir, link)
    try:
        lab.setup()
        yield lab
    finally:
        lab.close()
