"""Several jobs per host, and several agents (nodes) per job, all on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from runkit import SCRIPTS, Launch, finish, process_alive, worker_pids

pytestmark = pytest.mark.procs

SECRET = {"TANDEM_SECRET": "shared-by-both-nodes"}


def free_port() -> int:
    """A port for the agents' store (the test cannot know one in advance)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_nodes(launch: Launch, *args: Any, backend: str = "static", extra: tuple = ()) -> list:
    port = free_port()
    procs = []
    for node in (0, 1):
        where = (["--node-rank", node, "--master-addr", "127.0.0.1", "--master-port", port]
                 if backend == "static" else
                 ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"])
        procs.append(launch("--nnodes", "2", "--nproc-per-node", "2", *where, *extra, *args,
                            env=SECRET))
    return [finish(p, 240) for p in procs]


@pytest.mark.timeout(300)
def test_two_standalone_jobs_on_one_host_do_not_collide(launch: Launch, tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    procs = [launch("--standalone", "--nproc-per-node", "2", SCRIPTS / "allreduce.py", d)
             for d in dirs]
    results = [finish(p, 240) for p in procs]
    assert [r.code for r in results] == [0, 0], [r.err for r in results]
    ports = {(d / f"rank{r}.sum").read_text() for d in dirs for r in (0, 1)}
    assert {p.split()[0] for p in ports} == {"3"} and len({p.split()[1] for p in ports}) == 2


@pytest.mark.timeout(300)
def test_two_agents_form_one_four_rank_job(launch: Launch, tmp_path: Path) -> None:
    results = two_nodes(launch, SCRIPTS / "allreduce.py", tmp_path)
    assert [r.code for r in results] == [0, 0], [r.err for r in results]
    assert "[rank0]: rank 0 of 4: sum 10" in results[0].out
    assert "[rank3]: rank 3 of 4: sum 10" in results[1].out
    assert {(tmp_path / f"rank{r}.sum").read_text().split()[0] for r in range(4)} == {"10"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_nodes_agree_on_ranks_master_and_run_id(launch: Launch, tmp_path: Path,
                                                backend: str) -> None:
    results = two_nodes(launch, SCRIPTS / "dump_env.py", tmp_path, backend=backend)
    assert [r.code for r in results] == [0, 0], [r.err for r in results]
    envs = [json.loads((tmp_path / f"env_{r}.json").read_text())["env"] for r in range(4)]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1"]
    for key in ("WORLD_SIZE", "ROLE_WORLD_SIZE"):
        assert {e[key] for e in envs} == {"4"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "TANDEM_RUN_ID", "TANDEM_SECRET"):
        assert len({e[key] for e in envs}) == 1, key
    assert envs[0]["GROUP_WORLD_SIZE"] == "2" and envs[0]["TANDEM_SECRET"] == SECRET["TANDEM_SECRET"]


@pytest.mark.timeout(120)
def test_a_failure_on_one_node_stops_and_is_reported_on_both(launch: Launch) -> None:
    results = two_nodes(launch, SCRIPTS / "raise_on_rank.py", "3")
    assert [r.code for r in results] == [1, 1]
    for r in results:
        assert "rank       : 3 (local_rank 1, node 1" in r.err, r.err
        assert "exception  : ValueError: bad batch on rank 3" in r.err


@pytest.mark.timeout(120)
def test_both_nodes_restart_together(launch: Launch, tmp_path: Path) -> None:
    results = two_nodes(launch, SCRIPTS / "fail_first_attempt.py", "2", tmp_path,
                        extra=("--max-restarts", "1"))
    assert [r.code for r in results] == [0, 0], [r.err for r in results]
    assert sorted(p.name for p in tmp_path.glob("attempt1_*")) == [
        f"attempt1_rank{r}" for r in range(4)]
    assert "restart 1 of 1" in results[0].err and "restart 1 of 1" in results[1].err


@pytest.mark.timeout(60)
def test_multi_node_needs_a_shared_secret(launch: Launch) -> None:
    res = finish(launch("--nnodes", "2", "--node-rank", "1", "--master-port", free_port(),
                        SCRIPTS / "dump_env.py", "."))
    assert res.code == 2 and "TANDEM_SECRET" in res.err


@pytest.mark.timeout(60)
def test_a_missing_node_times_out_the_rendezvous(launch: Launch) -> None:
    res = finish(launch("--nnodes", "2", "--node-rank", "0", "--master-port", free_port(),
                        "--rdzv-conf", "join_timeout=2", SCRIPTS / "dump_env.py", ".",
                        env=SECRET))
    assert res.code == 1
    assert "only 1 of 2 nodes joined attempt 0" in res.err and "join_timeout" in res.err


def notices(err: str) -> list[str]:
    return [line for line in err.splitlines() if "still waiting" in line]


@pytest.mark.timeout(60)
def test_a_node_alone_says_what_it_waits_for_before_the_timeout(launch: Launch) -> None:
    # join_timeout=8: notices after 2 and 4 s (a quarter of it, then doubling), none at 8
    res = finish(launch("--nnodes", "2", "--node-rank", "0", "--master-port", free_port(),
                        "--rdzv-conf", "join_timeout=8", SCRIPTS / "dump_env.py", ".",
                        env=SECRET))
    assert res.code == 1 and "only 1 of 2 nodes joined" in res.err, res.err
    said = notices(res.err)
    assert [line.split(" after ")[1].split("s:")[0] for line in said] == ["2", "4"], res.err
    assert all("1 of 2 joined round 0 of the rendezvous at" in line and "join_timeout" in line
               for line in said), res.err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["unresolvable", "nobody-listens"])
def test_a_node_that_cannot_reach_the_store_says_why_while_it_waits(
        launch: Launch, where: str) -> None:
    if where == "unresolvable":
        args = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "nohost.invalid:29400")
        why = "the host name 'nohost.invalid' does not resolve"
    else:
        args = ("--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", free_port())
        why = "node 0 serves it: is it started"
    res = finish(launch("--nnodes", "2", *args, "--rdzv-conf", "join_timeout=6",
                        SCRIPTS / "dump_env.py", ".", env=SECRET))
    assert res.code == 1 and "could not connect to the store" in res.err, res.err
    said = notices(res.err)
    assert said and all("still waiting for the rendezvous store at" in line and why in line
                        for line in said), res.err


@pytest.mark.timeout(120)
def test_losing_node_zero_ends_the_other_node_and_its_workers(launch: Launch,
                                                               tmp_path: Path) -> None:
    port = free_port()
    procs = [launch("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", node,
                    "--master-port", port, SCRIPTS / "wait_for_signal.py", tmp_path, env=SECRET)
             for node in (0, 1)]
    deadline = time.monotonic() + 60
    while len(worker_pids(tmp_path)) < 4:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    pids = worker_pids(tmp_path)
    os.kill(procs[0].pid, signal.SIGKILL)
    res = finish(procs[1], 60)
    assert res.code == 1 and "StoreError" in res.err
    deadline = time.monotonic() + 10
    while [p for p in pids if process_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if process_alive(p)] == []


@pytest.mark.timeout(120)
def test_a_node_whose_agent_dies_is_noticed_by_its_heartbeat(launch: Launch,
                                                             tmp_path: Path) -> None:
    port = free_port()
    procs = [launch("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", node,
                    "--master-port", port, "--rdzv-conf", "keep_alive_max_attempt=3",
                    SCRIPTS / "wait_for_signal.py", tmp_path, env=SECRET) for node in (0, 1)]
    deadline = time.monotonic() + 60
    while len(worker_pids(tmp_path)) < 4:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGKILL)  # node 0's workers never talk to node 1's
    start = time.monotonic()
    res = finish(procs[0], 60)
    assert res.code == 1
    assert time.monotonic() - start < 30
    assert "ranks      : all of node 1, from rank 2" in res.err
    assert "exception  : AgentLost: the agent of node 1" in res.err


@pytest.mark.timeout(120)
def test_master_addr_0000_on_node_zero_reaches_the_other_node_as_its_store_address(
        launch: Launch, tmp_path: Path) -> None:
    port = free_port()
    procs = [launch("--nnodes", "2", "--nproc-per-node", "2", "--node-rank", node,
                    "--master-addr", addr, "--master-port", port, SCRIPTS / "dump_env.py",
                    tmp_path, env=SECRET)
             for node, addr in ((0, "0.0.0.0"), (1, "127.0.0.1"))]
    results = [finish(p, 240) for p in procs]
    assert [r.code for r in results] == [0, 0], [r.err for r in results]
    envs = [json.loads((tmp_path / f"env_{r}.json").read_text())["env"] for r in range(4)]
    # node 0's rank 0 listens on every interface; node 1 must not dial 0.0.0.0 (itself)
    assert [e["MASTER_ADDR"] for e in envs] == ["0.0.0.0", "0.0.0.0", "127.0.0.1", "127.0.0.1"]
    assert "listens on every interface" in results[0].err  # node 0's store said so
