"""init_process_group() under srun / mpirun: ranks come from the scheduler's variables."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tandem.collectives.cluster_env import cluster_env, first_host, slurm_node_address, tasks_on_node
from tandem.collectives.hostlist import expand_hostlist
from tandem.config import load_secret
from tandem.errors import ArgumentError


def test_first_host_of_slurm_nodelists() -> None:
    assert first_host("gpu[03-05,07],cpu1") == "gpu03"
    assert first_host("a1,a2") == "a1"
    assert first_host("node[7]") == "node7"
    assert first_host("solo") == "solo"


@pytest.mark.parametrize("text, hosts", [
    ("node[1-3,7],gpu[01-02]", ["node1", "node2", "node3", "node7", "gpu01", "gpu02"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),            # the low end's width is kept
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("a,b[2],c", ["a", "b2", "c"]),
    (" x1 ", ["x1"]),
    ("n[9-10]x", ["n9x", "n10x"]),
    ("a,,b,", ["a", "b"]),
])
def test_hostlists_expand_as_scontrol_show_hostnames(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text, problem", [
    ("n[1-3", "never closed"), ("n1-3]", "without '['"), ("n[[1]]", "nested"),
    ("n[3-1]", "backwards"), ("n[a-b]", "neither a number"), ("n[1-99999999]", "more than"),
    ("", "no host"), ("n[]", "neither a number"),
])
def test_bad_hostlists_are_refused_by_name(text: str, problem: str) -> None:
    with pytest.raises(ArgumentError, match=re.escape(problem)):
        expand_hostlist(text)


def test_tasks_per_node_notation() -> None:
    assert [tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ArgumentError, match="no entry for node 4"):
        tasks_on_node("2(x3),1", 4)


SLURM_TASK = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
              "SLURM_STEP_NUM_NODES": "2",
              "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
              "SLURM_JOB_NODELIST": "n[10-11]", "SLURM_JOB_ID": "12345"}


def test_slurm_variables_give_ranks_nodes_and_the_rendezvous() -> None:
    env = cluster_env(SLURM_TASK, resolve=lambda name: name)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("1", "2", "2")
    assert env["MASTER_ADDR"] == "n10"
    assert env["MASTER_PORT"] == str(10000 + 12345 % 20000)


def test_a_batch_scripts_own_shell_is_no_rank() -> None:
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
             "SLURM_JOB_NODELIST": "n[10-11]", "SLURM_JOB_ID": "7"}  # sbatch's shell, no srun
    assert cluster_env(batch, resolve=lambda n: n) == batch


def test_the_step_nodelist_wins_over_the_jobs() -> None:
    env = cluster_env({**SLURM_TASK, "SLURM_STEP_NODELIST": "n11"}, resolve=lambda n: n)
    assert env["MASTER_ADDR"] == "n11"  # srun -N1 in a 2-node job: task 0 is on n11


@pytest.mark.procs
def test_a_node_name_that_does_not_resolve_is_asked_of_slurm(tmp_path: Path) -> None:
    # a fake scontrol on PATH answers as SLURM does for a node with its own NodeAddr
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho \"NodeName=$3 Arch=x86_64 CoresPerSocket=2\"\n"
                    "echo \"   NodeAddr=10.9.8.7 NodeHostName=$3 Version=22.05\"\n")
    fake.chmod(0o755)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{tmp_path}:{old}"
    try:
        assert slurm_node_address("no-such-node-x7.invalid") == "10.9.8.7"
        assert slurm_node_address("localhost") == "localhost"  # resolves: kept
        fake.write_text("#!/bin/sh\necho 'Node no-such was not found' >&2; exit 1\n")
        with pytest.raises(ArgumentError, match="export MASTER_ADDR"):
            slurm_node_address("no-such-node-x7.invalid")
    finally:
        os.environ["PATH"] = old


def test_multi_node_jobs_without_a_secret_are_refused(tmp_path: Path) -> None:
    home = {"XDG_CONFIG_HOME": str(tmp_path)}
    with pytest.raises(ArgumentError, match=r"step spans 2 nodes.*python -m tandem.secret"):
        load_secret({**SLURM_TASK, **home})
    with pytest.raises(ArgumentError, match="2 of its 4 ranks on this host"):
        load_secret({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", **home})
    assert load_secret({**SLURM_TASK, "TANDEM_SECRET": "s"}) == b"s"
    assert load_secret({**SLURM_TASK, "SLURM_STEP_NUM_NODES": "1", **home})  # one node: per-user file


@pytest.mark.procs
def test_python_m_tandem_secret_prints_a_fresh_secret() -> None:
    made = [subprocess.run([sys.executable, "-m", "tandem.secret"], capture_output=True,
                           text=True, check=True).stdout.strip() for _ in range(2)]
    assert made[0] != made[1] and all(len(m) == 64 and int(m, 16) >= 0 for m in made)


def test_open_mpi_and_pmi_variables() -> None:
    ompi = cluster_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (ompi["RANK"], ompi["WORLD_SIZE"], ompi["LOCAL_RANK"]) == ("1", "2", "1")
    pmi = cluster_env({"PMI_RANK": "5", "PMI_SIZE": "8"})
    assert (pmi["RANK"], pmi["WORLD_SIZE"]) == ("5", "8")
    pmix = cluster_env({"PMIX_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"})
    assert (pmix["RANK"], pmix["WORLD_SIZE"]) == ("2", "4")


def test_open_mpi_rendezvous_defaults_to_mpiruns_host_and_job() -> None:
    env = cluster_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                       "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "2745761793",
                       "OMPI_MCA_orte_hnp_uri": "2745761792.0;tcp://10.77.3.1,172.17.0.2:41523"})
    assert (env["MASTER_ADDR"], env["LOCAL_WORLD_SIZE"]) == ("10.77.3.1", "2")
    assert env["MASTER_PORT"] == str(10000 + 2745761793 % 20000)


def test_explicit_variables_win_over_the_scheduler() -> None:
    env = cluster_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0", "RANK": "0",
                       "MASTER_ADDR": "10.0.0.1", "SLURM_JOB_NODELIST": "n1"})
    assert env["RANK"] == "0" and env["MASTER_ADDR"] == "10.0.0.1"


WORKER = textwrap.dedent("""
    import torch, tandem
    torch.set_num_threads(1)
    tandem.init_process_group()
    t = torch.tensor([float(tandem.get_rank() + 1)])
    tandem.all_reduce(t)
    print(tandem.get_rank(), tandem.get_world_size(), t.item())
    tandem.destroy_process_group()
""")


@pytest.mark.procs
@pytest.mark.timeout(60)
@pytest.mark.parametrize("style", ["slurm", "openmpi"])
def test_processes_started_like_srun_or_mpirun_form_a_job(style: str) -> None:
    with socket.socket() as probe:  # a free port for the store, chosen by the kernel
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TANDEM_SECRET="cluster-test")
        if style == "slurm":
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                       SLURM_STEP_ID="0")
        else:
            env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=45) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err}"
        assert out.split() == [str(rank), "2", "3.0"], f"rank {rank} printed {out!r}"
