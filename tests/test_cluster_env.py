"""init_process_group() under srun / mpirun: ranks come from the scheduler's variables."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from tandem.collectives.cluster_env import cluster_env, first_host


def test_first_host_of_slurm_nodelists() -> None:
    assert first_host("gpu[03-05,07],cpu1") == "gpu03"
    assert first_host("a1,a2") == "a1"
    assert first_host("node[7]") == "node7"
    assert first_host("solo") == "solo"


def test_slurm_variables_give_rank_size_and_master() -> None:
    env = cluster_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                       "SLURM_JOB_NODELIST": "n[10-11]", "SLURM_JOB_ID": "12345"})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "1")
    assert env["MASTER_ADDR"] == "n10"
    assert env["MASTER_PORT"] == str(29500 + 12345 % 1000)


def test_open_mpi_and_pmi_variables() -> None:
    ompi = cluster_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert (ompi["RANK"], ompi["WORLD_SIZE"], ompi["LOCAL_RANK"]) == ("1", "2", "1")
    pmi = cluster_env({"PMI_RANK": "5", "PMI_SIZE": "8"})
    assert (pmi["RANK"], pmi["WORLD_SIZE"]) == ("5", "8")


def test_explicit_variables_win_over_the_scheduler() -> None:
    env = cluster_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "RANK": "0",
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
            env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank))
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
