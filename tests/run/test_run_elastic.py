"""c10d rendezvous with --nnodes MIN:MAX: a job that grows when a node joins and shrinks
when one leaves (two agents on loopback)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from runkit import SCRIPTS, Launch, finish, process_alive, worker_pids

pytestmark = pytest.mark.procs

SECRET = {"TANDEM_SECRET": "shared-by-both-nodes"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def elastic(launch: Launch, port: int, *args: object, conf: str = "last_call_timeout=1",
            restarts: int = 0) -> subprocess.Popen[str]:
    return launch("--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", conf,
                  "--max-restarts", restarts, SCRIPTS / "elastic.py", *args, env=SECRET)


def wait_for(predicate: object, procs: list[subprocess.Popen[str]], what: str) -> None:
    deadline = time.monotonic() + 90
    while not predicate():  # type: ignore[operator]
        for p in procs:
            assert p.poll() is None, (what, p.communicate())
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def store_up(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def seen(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("seen_*")}


@pytest.mark.timeout(120)
def test_one_node_of_one_to_two_runs_alone_after_the_last_call(launch: Launch,
                                                                tmp_path: Path) -> None:
    res = finish(elastic(launch, free_port(), tmp_path, 2, "sleep"), 100)
    assert res.code == 0, res.err
    assert seen(tmp_path) == {"seen_ws2_rank0_restart0", "seen_ws2_rank1_restart0"}


@pytest.mark.timeout(180)
def test_a_joining_node_grows_the_job_without_using_a_restart(launch: Launch,
                                                              tmp_path: Path) -> None:
    port = free_port()
    first = elastic(launch, port, tmp_path, 4, "sleep")
    wait_for(lambda: len(seen(tmp_path)) == 2, [first], "the one-node round")
    second = elastic(launch, port, tmp_path, 4, "sleep")
    results = [finish(p, 150) for p in (first, second)]
    assert [r.code for r in results] == [0, 0], [r.err for r in results]
    assert seen(tmp_path) == {"seen_ws2_rank0_restart0", "seen_ws2_rank1_restart0"} | {
        f"seen_ws4_rank{r}_restart0" for r in range(4)}
    assert "a node is waiting to join" in results[0].err


@pytest.mark.timeout(240)
def test_a_leaving_node_shrinks_the_job(launch: Launch, tmp_path: Path) -> None:
    port = free_port()
    host = elastic(launch, port, tmp_path, 2, "tandem", 1, restarts=1)
    wait_for(lambda: store_up(port), [host], "the rendezvous store")
    leaver = elastic(launch, port, tmp_path, 2, "tandem", 1, restarts=1)
    wait_for(lambda: len([n for n in seen(tmp_path) if n.startswith("seen_ws4")]) == 4,
             [host, leaver], "the two-node round")
    wait_for(lambda: len(_workers_of(leaver.pid, tmp_path)) == 2, [host, leaver],
             "the leaving node's two workers")
    leaving_workers = _workers_of(leaver.pid, tmp_path)
    os.kill(leaver.pid, signal.SIGKILL)
    res = finish(host, 200)
    assert res.code == 0, res.err
    assert {"seen_ws2_rank0_restart1", "seen_ws2_rank1_restart1"} <= seen(tmp_path)
    assert "restart 1 of 1" in res.err
    assert [p for p in leaving_workers if process_alive(p)] == []


def _workers_of(agent: int, directory: Path) -> list[int]:
    """The workers an agent started: each one's parent is its supervisor
    (tandem/run/_worker.py), whose parent is the agent."""
    return [pid for pid in worker_pids(directory) if _parent(_parent(pid)) == agent]


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


@pytest.mark.timeout(300)
def test_a_killed_node_is_replaced_by_a_new_one(launch: Launch, tmp_path: Path) -> None:
    port = free_port()
    host = elastic(launch, port, tmp_path, 4, "tandem", 1, restarts=1)
    wait_for(lambda: store_up(port), [host], "the rendezvous store")
    doomed = elastic(launch, port, tmp_path, 4, "tandem", 1, restarts=1)
    wait_for(lambda: len([n for n in seen(tmp_path) if n.startswith("seen_ws4")]) == 4,
             [host, doomed], "the two-node round")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(10)
    wait_for(lambda: {"seen_ws2_rank0_restart1", "seen_ws2_rank1_restart1"} <= seen(tmp_path),
             [host], "the surviving node alone")
    replacement = elastic(launch, port, tmp_path, 4, "tandem", 1, restarts=1)
    results = [finish(p, 200) for p in (host, replacement)]
    assert [r.code for r in results] == [0, 0], [r.err for r in results]
    regrown = {n for n in seen(tmp_path) if n.startswith("seen_ws4") and
               not n.endswith("restart0")}
    assert len(regrown) == 4, sorted(seen(tmp_path))
