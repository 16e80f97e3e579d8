"""Rank and rendezvous information from cluster schedulers, for ``env://`` without a launcher.

Under ``srun`` (SLURM) or ``mpirun`` (Open MPI, MPICH/PMI) every process already
knows its rank and the job size; :func:`cluster_env` reads them so that
``init_process_group()`` works with nothing else set::

    srun -N2 --ntasks-per-node=2 python train.py
    mpirun -np 4 --host a:2,b:2 python train.py

Each variable below is filled in only when it is not set already: anything exported
(RANK, MASTER_ADDR, MASTER_PORT, ...) always wins.

SLURM, one task per rank (the tasks of an ``srun`` step: a batch script's own shell is
no rank):

* ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` = ``SLURM_NTASKS``, ``LOCAL_RANK`` =
  ``SLURM_LOCALID``; the node rank ``GROUP_RANK`` = ``SLURM_NODEID`` and
  ``GROUP_WORLD_SIZE`` = ``SLURM_NNODES``; ``LOCAL_WORLD_SIZE`` is this node's entry of
  ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``: 2 tasks on each of 3 nodes, then 1).
* ``MASTER_ADDR``: the first host of the step's node list (``SLURM_STEP_NODELIST``, else
  ``SLURM_JOB_NODELIST``), in SLURM's hostlist syntax (``node[1-3,7],gpu[01-02]``:
  :func:`~tandem.collectives.hostlist.expand_hostlist`). SLURM puts task 0 on that
  node. Node names often do not resolve outside SLURM (``NodeName`` differs from
  ``NodeAddr``, no DNS entry): then SLURM is asked (``scontrol show node NAME``) and
  the node's ``NodeAddr`` is used.
* ``MASTER_PORT``: ``10000 + SLURM_JOB_ID % 20000``. Jobs with neighbouring ids get
  different ports, 20000 jobs pass before a port repeats, and the range stays below
  Linux's ephemeral ports (32768 and up), which the kernel hands out to outgoing
  connections. Two steps of one job running at once share it: set MASTER_PORT there.

Open MPI (``mpirun``): ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` from
``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/``_LOCAL_SIZE``; ``PMIX_RANK`` gives
the rank where only PMIx's variables are set. ``MASTER_ADDR``: set it (``mpirun -x
MASTER_ADDR=a``), else the host ``mpirun`` runs on (from ``OMPI_MCA_orte_hnp_uri``),
which must then be the first host, where rank 0 runs. ``MASTER_PORT``: set it, else
``10000 + (the job id in OMPI_MCA_ess_base_jobid) % 20000``.

MPICH, Intel MPI: ``PMI_RANK``/``PMI_SIZE``/``MPI_LOCALRANKID``; MASTER_ADDR and
MASTER_PORT must be set.
"""

from __future__ import annotations

import re
import socket
import subprocess
from typing import Callable, Mapping

from tandem.collectives.hostlist import expand_hostlist
from tandem.errors import ArgumentError

__all__ = ["cluster_env", "scheduler_task", "first_host", "slurm_node_address", "tasks_on_node",
           "port_from_id"]

# scheduler: (rank, world size, local rank), in the order they are looked for
_SCHEDULERS = {
    "SLURM": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "PMIx": ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "PMI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
}
_NAMES = [(name, rank, size) for name, (rank, size, _) in _SCHEDULERS.items()]
_SCONTROL_TIMEOUT_S = 10.0


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,07],cpu1"`` -> ``"gpu03"``."""
    return expand_hostlist(nodelist)[0]


def port_from_id(job_id: int) -> int:
    """The rendezvous port of job ``job_id`` (see the module docstring)."""
    return 10000 + job_id % 20000


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Node ``node``'s count in SLURM's ``2(x3),1`` notation; ``ArgumentError`` if absent."""
    seen = 0
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ArgumentError(f"tasks per node {tasks_per_node!r}: cannot read {item!r}")
        seen += int(m.group(2) or 1)
        if node < seen:
            return int(m.group(1))
    raise ArgumentError(f"tasks per node {tasks_per_node!r} has no entry for node {node}")


def slurm_node_address(name: str) -> str:
    """``name`` if it resolves, else its ``NodeAddr`` as SLURM knows it (``scontrol``)."""
    try:
        socket.getaddrinfo(name, None)
        return name
    except (socket.gaierror, UnicodeError):
        pass
    try:
        done = subprocess.run(["scontrol", "show", "node", name], capture_output=True,
                              text=True, timeout=_SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ArgumentError(f"SLURM node {name!r} (first of the job's nodes) does not resolve "
                            f"and `scontrol show node {name}` failed: {exc}; export "
                            f"MASTER_ADDR") from exc
    m = re.search(r"\bNodeAddr=(\S+)", done.stdout)
    if done.returncode != 0 or m is None:
        raise ArgumentError(f"SLURM node {name!r} (first of the job's nodes) does not resolve "
                            f"and `scontrol show node {name}` gave no NodeAddr "
                            f"({(done.stderr or done.stdout).strip()[:300]!r}); export "
                            f"MASTER_ADDR")
    return m.group(1)


def _fill_slurm(env: Mapping[str, str], out: dict[str, str],
                resolve: Callable[[str], str]) -> None:
    for name, var in (("GROUP_RANK", "SLURM_NODEID"), ("GROUP_WORLD_SIZE", "SLURM_NNODES")):
        if env.get(var):
            out.setdefault(name, env[var])
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node and env.get("SLURM_NODEID", "").isdigit():
        out.setdefault("LOCAL_WORLD_SIZE", str(tasks_on_node(per_node, int(env["SLURM_NODEID"]))))
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    if nodes and not out.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = resolve(first_host(nodes))
    job = env.get("SLURM_JOB_ID", "")
    if job.isdigit() and not out.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(port_from_id(int(job)))


def _fill_open_mpi(env: Mapping[str, str], out: dict[str, str]) -> None:
    if env.get("OMPI_COMM_WORLD_LOCAL_SIZE"):
        out.setdefault("LOCAL_WORLD_SIZE", env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    # "JOBID.VPID;tcp://10.0.0.1,10.1.0.1:PORT;...": mpirun's own addresses, first first
    hnp = re.search(r"tcp6?://\[?([^,:;\]]+)", env.get("OMPI_MCA_orte_hnp_uri", ""))
    if hnp and not out.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = hnp.group(1)
    job = env.get("OMPI_MCA_ess_base_jobid", "")
    if job.isdigit() and not out.get("MASTER_PORT"):
        out["MASTER_PORT"] = str(port_from_id(int(job)))


def scheduler_task(env: Mapping[str, str]) -> str:
    """The scheduler that started this process as one rank of a job ("" if none).

    A SLURM batch script's own shell also has ``SLURM_PROCID`` (0) and the job's
    ``SLURM_NTASKS``, but it is no rank: only the tasks of an ``srun`` step
    (``SLURM_STEP_ID``) count.
    """
    for name, rank_var, size_var in _NAMES:
        if rank_var in env and size_var in env and (name != "SLURM" or "SLURM_STEP_ID" in env):
            return name
    return ""


def cluster_env(env: Mapping[str, str],
                resolve: Callable[[str], str] = slurm_node_address) -> dict[str, str]:
    """``env`` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
    GROUP_WORLD_SIZE, MASTER_ADDR and MASTER_PORT filled in from the scheduler's
    variables (see the module docstring); ``resolve`` maps a SLURM node name to an
    address."""
    out = dict(env)
    task = scheduler_task(env)
    if not task:
        return out
    rank_var, size_var, local_var = _SCHEDULERS[task]
    out.setdefault("RANK", env[rank_var])
    out.setdefault("WORLD_SIZE", env[size_var])
    if local_var in env:
        out.setdefault("LOCAL_RANK", env[local_var])
    if task == "SLURM":
        _fill_slurm(env, out, resolve)
    elif task in ("Open MPI", "PMIx"):
        _fill_open_mpi(env, out)
    return out
