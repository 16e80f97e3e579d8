"""Rank and rendezvous information from cluster schedulers, for ``env://`` without a launcher.

Under ``srun`` (SLURM) or ``mpirun`` (Open MPI, MPICH/PMI) every process already
knows its rank and the job size; this module reads them so
``init_process_group()`` works without ``tandemrun``:

=================  ==========================================  =====================
scheduler          rank / world size / local rank               MASTER_ADDR default
=================  ==========================================  =====================
SLURM (srun)       SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID  first host of
                                                                SLURM_JOB_NODELIST
Open MPI           OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK   (must be set)
MPICH, Intel MPI   PMI_RANK / PMI_SIZE / MPI_LOCALRANKID        (must be set)
=================  ==========================================  =====================

``MASTER_PORT`` defaults, under SLURM only, to ``29500 + SLURM_JOB_ID % 1000`` so
concurrent jobs on shared nodes rarely collide; set it explicitly to be sure.
Variables already set (RANK, WORLD_SIZE, ...) always win.
"""

from __future__ import annotations

import re
from typing import Mapping

__all__ = ["cluster_env", "first_host"]

_SCHEDULERS = [
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
]


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,07],cpu1"`` -> ``"gpu03"``."""
    head = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if head is None:
        return nodelist
    prefix, ranges = head.group(1), head.group(3)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def cluster_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT filled in."""
    out = dict(env)
    for rank_var, size_var, local_var in _SCHEDULERS:
        if rank_var in env and size_var in env:
            out.setdefault("RANK", env[rank_var])
            out.setdefault("WORLD_SIZE", env[size_var])
            if local_var in env:
                out.setdefault("LOCAL_RANK", env[local_var])
            break
    if "SLURM_PROCID" in env:
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodes and not out.get("MASTER_ADDR"):
            out["MASTER_ADDR"] = first_host(nodes)
        job = env.get("SLURM_JOB_ID", "")
        if job.isdigit() and not out.get("MASTER_PORT"):
            out["MASTER_PORT"] = str(29500 + int(job) % 1000)
    return out
