"""Ranks on simulated hosts: network namespaces on a private bridge (``tandem.testing.netns``).

Each namespace is one host to tandem: its own ``TANDEM_HOST_ID`` and its own address,
and, like a real host, its own abstract UNIX socket names, so shared memory between
namespaces cannot even be set up (tandem also tells namespaces apart by themselves). Runs (one spawn each, whose results serve several
tests):

* ``auto-2x2``: backend ``auto``, 2 hosts x 2 ranks, FileStore rendezvous in a shared
  directory, ``TANDEM_BIND_ADDR`` per host: shm within a host, tcp across;
* ``tcp-2x2``: backend ``tcp``, a TCPStore served by rank 0 on its host's address, each
  rank finding its own address from ``MASTER_ADDR`` as on a real cluster;
* ``auto-3-hosts``: 3 hosts holding 1, 2 and 1 ranks.

Every rank runs every collective and p2p pattern (``_netns_rank.battery``) and reports
digests, compared with digests computed from the inputs alone. Needs root and
iproute2; elsewhere every test skips, saying why. About 40 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

import tandem

from tandem._proc import process_alive
from tandem.testing.netns import PREFIX, RankRun, Unavailable, netns_lab, unavailable_reason
from _netns_rank import expected_for

# 150: the first run of a process also starts tandem.testing's process server (imports
# torch once for all its ranks), which took over 90 s at load 60
pytestmark = [pytest.mark.procs, pytest.mark.timeout(150)]

RANK_SCRIPT = Path(__file__).with_name("_netns_rank.py")


@dataclasses.dataclass(frozen=True)
class Spec:
    backend: str
    placement: list[int]  # host of each rank
    rendezvous: str  # "file" or "tcp"


RUNS = {
    "auto-2x2": Spec("auto", [0, 0, 1, 1], "file"),
    "tcp-2x2": Spec("tcp", [0, 0, 1, 1], "tcp"),
    "auto-3-hosts": Spec("auto", [0, 1, 1, 2], "file"),
}


def _launch(spec: Spec, workdir: Path, init_only: bool = False, host_ids: bool = True,
            grace: float = 5.0, bind_any: bool = False) -> list[RankRun]:
    """Run ``_netns_rank.py`` for each rank of ``spec`` in a fresh lab; skip if none can be made."""
    hosts = max(spec.placement) + 1
    secret = secrets.token_hex(16)
    try:
        with netns_lab(hosts, workdir) as lab:
            if spec.rendezvous == "file":
                rendezvous = f"file://{workdir}/store"
            else:
                rendezvous = f"tcp://{lab.addrs[0]}{workdir}/store-port"

            def args(rank: int) -> list[str]:
                return ["--rank", str(rank), "--world", str(len(spec.placement)),
                        "--backend", spec.backend, "--rendezvous", rendezvous,
                        "--out", str(workdir / f"result-{rank}.json"),
                        *(["--init-only"] if init_only else [])]

            def env(rank: int) -> dict[str, str]:
                host = spec.placement[rank]
                out = {"TANDEM_SECRET": secret, "TANDEM_CONNECT_TIMEOUT": "20"}
                if host_ids:
                    out["TANDEM_HOST_ID"] = f"nshost{host}"
                if spec.rendezvous == "file":
                    out["TANDEM_BIND_ADDR"] = lab.addrs[host]
                else:
                    out["MASTER_ADDR"] = lab.addrs[0]
                if bind_any:
                    out["TANDEM_BIND_ADDR"] = "0.0.0.0"
                return out

            # preloaded: a fresh interpreter per rank spent ~2 s of CPU importing torch;
            # at load 100 a rank got 2.5 s of CPU in 50 s and was killed still importing
            return lab.run([str(RANK_SCRIPT)], spec.placement, args, env, timeout=50,
                           grace=grace, preloaded=True)
    except Unavailable as exc:
        pytest.skip(f"network namespaces are unavailable: {exc}")


def _report(runs: list[RankRun]) -> str:
    return "\n".join(r.report() for r in runs if not r.ok)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    """``results(name)``: every rank's report for run ``name``, run once per module."""
    done: dict[str, list[dict[str, Any]]] = {}

    def get(name: str) -> list[dict[str, Any]]:
        if name not in done:
            workdir = tmp_path_factory.mktemp(name)
            runs = _launch(RUNS[name], workdir)
            assert all(r.ok for r in runs), f"{name}: ranks failed\n{_report(runs)}"
            done[name] = [json.loads((workdir / f"result-{r.rank}.json").read_text())
                          for r in runs]
        return done[name]

    return get


def _wrong(reports: list[dict[str, Any]]) -> list[str]:
    p = len(reports)
    return [f"rank {rank}: {key} is {got.get(key)}, expected {want}"
            for rank, got in enumerate(reports)
            for key, want in expected_for(rank, p).items() if got.get(key) != want]


@pytest.mark.parametrize("name", RUNS)
def test_every_collective_across_namespaces_gives_the_exact_result(results: Any,
                                                                   name: str) -> None:
    wrong = _wrong(results(name))
    assert not wrong, f"{name}: " + "\n".join(wrong)


@pytest.mark.parametrize("name", RUNS)
def test_each_namespace_is_a_host_and_all_reduce_goes_hierarchical(results: Any,
                                                                   name: str) -> None:
    spec = RUNS[name]
    hosts = [f"nshost{h}" for h in spec.placement]
    for rank, report in enumerate(results(name)):
        assert report["host_of"] == hosts, f"rank {rank}: {report['host_of']}"
        assert report["chosen"] == ["hierarchical", "hierarchical"], f"rank {rank}"
        if rank in (1, 2, 3):  # global ranks [1, 2, 3] span 2 hosts, one holding 2
            assert report["subgroup_chosen"] == "hierarchical", f"rank {rank}"


@pytest.mark.parametrize("name", ["auto-2x2", "auto-3-hosts"])
def test_auto_uses_shared_memory_only_within_a_namespace(results: Any, name: str) -> None:
    placement = RUNS[name].placement
    for rank, report in enumerate(results(name)):
        mates = [r for r, h in enumerate(placement) if h == placement[rank] and r != rank]
        kind = "MixedTransport" if mates else "TcpTransport"  # a rank alone needs no shm
        assert report["transport"] == kind, f"rank {rank}: {report['transport']}"
        assert report["shm_peers"] == mates, f"rank {rank}: shm peers {report['shm_peers']}"


def test_tcp_backend_uses_tcp_between_every_pair(results: Any) -> None:
    for rank, report in enumerate(results("tcp-2x2")):
        assert (report["transport"], report["shm_peers"]) == ("TcpTransport", []), rank


def test_ranks_listening_on_every_interface_are_reached_across_hosts(tmp_path: Path) -> None:
    # TANDEM_BIND_ADDR=0.0.0.0: each rank must publish its host's address, not 0.0.0.0
    # (which the other host would dial as itself)
    runs = _launch(Spec("tcp", [0, 1], "tcp"), tmp_path, init_only=True, bind_any=True)
    for r in runs:
        assert r.ok, r.report()


def test_without_host_ids_namespaces_are_still_told_apart(tmp_path: Path) -> None:
    # one host name and boot id for both namespaces: the namespace itself tells them
    # apart, so auto goes over tcp between them (shared-memory sockets do not cross)
    runs = _launch(Spec("auto", [0, 1], "file"), tmp_path, init_only=True, host_ids=False)
    for r in runs:
        assert r.ok, r.report()


def test_lab_leaves_nothing_behind(tmp_path: Path) -> None:
    why = unavailable_reason()
    if why:
        pytest.skip(f"network namespaces are unavailable: {why}")

    def state() -> tuple[str, str]:
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        return links.stdout, spaces.stdout

    try:
        before = state()
        with netns_lab(3, tmp_path) as lab:
            assert state()[0] == before[0], "the lab changed this namespace's interfaces"
            names = lab.names + [lab.switch]
            raise RuntimeError("a failing test")
    except Unavailable as exc:
        pytest.skip(f"network namespaces are unavailable: {exc}")
    except RuntimeError:
        pass
    links, spaces = state()
    assert links == before[0]
    assert not [n for n in names if n in spaces.split()], spaces


def test_namespaces_of_a_killed_run_are_removed_by_the_next_lab(tmp_path: Path) -> None:
    why = unavailable_reason()
    if why:
        pytest.skip(f"network namespaces are unavailable: {why}")
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid now names a process that no longer runs
    stale = f"{PREFIX}{gone.pid}-test-h0"
    made = subprocess.run(["ip", "netns", "add", stale], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"network namespaces are unavailable: {made.stderr.strip()}")
    # what the killed run left running in it (a link's delay process, a rank)
    left = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "120"])
    try:
        # until it runs in there: on a loaded machine `ip` can still be starting when the
        # lab looks, and enter the namespace after the lab has found it empty
        deadline = time.monotonic() + 30
        while str(left.pid) not in subprocess.run(["ip", "netns", "pids", stale],
                                                  capture_output=True, text=True).stdout.split():
            assert left.poll() is None, f"`ip netns exec` ended with {left.returncode}"
            assert time.monotonic() < deadline, "the stale run's process never entered it"
            time.sleep(0.05)
        with netns_lab(2, tmp_path):
            pass
        spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        assert stale not in spaces.stdout.split(), spaces.stdout
        assert left.wait(timeout=10) == -signal.SIGKILL, "the stale run's process still runs"
    finally:
        left.kill()
        left.wait()
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def _namespaces_of(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in listing.stdout.splitlines()
            if line.startswith(f"{PREFIX}{pid}-")]


def test_a_benchmark_stopped_with_sigterm_removes_its_hosts(tmp_path: Path) -> None:
    why = unavailable_reason()
    if why:
        pytest.skip(f"network namespaces are unavailable: {why}")
    bench = subprocess.Popen(
        [sys.executable, "-m", "tandem.bench", "collectives", "--hosts", "2",
         "--ranks-per-host", "1", "--link", "1gbit:0.2ms", "--ops", "all_reduce",
         "--sizes", "4K", "--rounds", "50"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(tandem.__file__).parent.parent)},
        start_new_session=True)
    inside: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and bench.poll() is None:
            spaces = _namespaces_of(bench.pid)
            # the hosts are up once a link's delay process runs in one of them
            inside = [int(p) for ns in spaces for p in subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
            if inside:
                break
            time.sleep(0.2)
        assert inside, f"the benchmark made no hosts: {bench.stderr.read() if bench.stderr else ''}"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=30) == 128 + signal.SIGTERM
        assert _namespaces_of(bench.pid) == []
        assert [p for p in inside if process_alive(p)] == [], "processes left in its hosts"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        for ns in _namespaces_of(bench.pid):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


_HOLD_A_LAB = """
import sys, time
from pathlib import Path
from tandem.testing.links import LinkShape
from tandem.testing.netns import netns_lab
with netns_lab(2, Path(sys.argv[1]), LinkShape(delay_s=0.0002)) as lab:
    print(" ".join(str(p.pid) for p in lab._helpers), flush=True)
    time.sleep(120)
"""


def test_a_lab_killed_outright_takes_its_delay_processes_with_it(tmp_path: Path) -> None:
    why = unavailable_reason()
    if why:
        pytest.skip(f"network namespaces are unavailable: {why}")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_A_LAB, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ,
                                   "PYTHONPATH": str(Path(tandem.__file__).parent.parent)})
    helpers: list[int] = []
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()  # the holder's own deadline: its sleep
        if not line:
            err = holder.stderr.read() if holder.stderr else ""
            if "Unavailable" in err:
                pytest.skip(f"links cannot be delayed here: {err[-500:]}")
            raise AssertionError(f"the lab did not start: {err[-2000:]}")
        helpers = [int(p) for p in line.split()]
        assert len(helpers) == 2 and all(process_alive(p) for p in helpers), line
        holder.kill()  # SIGKILL: no finally block runs in the holder
        holder.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(process_alive(p) for p in helpers):
            time.sleep(0.05)
        assert not [p for p in helpers if process_alive(p)], "delay processes outlived their lab"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        for p in helpers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        for ns in _namespaces_of(holder.pid):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


_STUCK = """
import sys, threading, time
from pathlib import Path
rank, workdir = int(sys.argv[1]), Path(sys.argv[2])
def wait_here_forever():
    threading.Event().wait()
if rank == 0:
    print("ready", flush=True)
    wait_here_forever()
deadline = time.monotonic() + 60
while "ready" not in (workdir / "rank0.log").read_text():  # rank 0 is in its wait
    assert time.monotonic() < deadline, "rank 0 never started"
    time.sleep(0.05)
sys.exit(3)
"""


@pytest.mark.parametrize("preloaded", [False, True])
def test_a_rank_killed_at_the_deadline_reports_what_it_was_doing(tmp_path: Path,
                                                                 preloaded: bool) -> None:
    # rank 1 fails once rank 0 waits, so rank 0 is killed after the grace period: the run
    # says it was a sleeping python using little CPU, and its log ends with its stack
    try:
        with netns_lab(2, tmp_path) as lab:
            runs = lab.run(["-c", _STUCK], [0, 1], lambda r: [str(r), str(tmp_path)],
                           lambda r: {}, timeout=120, grace=0.0, preloaded=preloaded)
    except Unavailable as exc:
        pytest.skip(f"network namespaces are unavailable: {exc}")
    assert runs[1].returncode == 3, runs[1].report()
    stuck = runs[0]
    assert stuck.returncode is None, stuck.report()
    assert re.fullmatch(r"killed after \d+\.\d s: python\S* state S( in \S+)?, 1 thread, "
                        r"\d+\.\d s of CPU, load \d+/\d+/\d+", stuck.killed), stuck.killed
    assert "wait_here_forever" in stuck.log, stuck.report()
    assert stuck.report().startswith(f"--- rank 0 on host 0: {stuck.killed} ---"), stuck.report()
