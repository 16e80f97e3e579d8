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

A scheduler's variable that is used and is not a count in range (``SLURM_PROCID=abc``,
a rank not below the job size, ``SLURM_JOB_ID=x`` with no MASTER_PORT) is an
``ArgumentError`` naming that variable, not the one it would have filled in.
"""

from __future__ import annotations

import re
import socket
import subprocess
from typing import Callable, Mapping

from tandem.collectives.hostlist import expand_hostlist
from tandem.config import MAX_WORLD_SIZE
from tandem.errors import ArgumentError

__all__ = ["cluster_env", "env_int", "text_int", "scheduler_task", "first_host", "slurm_node_address",
           "tasks_on_node", "port_from_id"]

# scheduler: (rank, world size, local rank), in the order they are looked for
_SCHEDULERS = {
    "SLURM": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "PMIx": ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "PMI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
}
_NAMES = [(name, rank, size) for name, (rank, size, _) in _SCHEDULERS.items()]
_SCONTROL_TIMEOUT_S = 10.0


def env_int(env: Mapping[str, str], name: str, low: int, high: int, expected: str,
            default: int | None = None) -> int:
    """The integer in environment variable ``name``, in ``[low, high]``; else an
    ``ArgumentError`` naming the variable, its value and ``expected``. Unset or empty is
    ``default``, or an error if there is none."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is not None:
            return default
        raise ArgumentError(f"environment variable {name}={raw!r} is "
                            f"{'empty' if raw is not None else 'not set'}: expected {expected}")
    return text_int(raw, low, high, f"environment variable {name}", expected)


def text_int(raw: str, low: int, high: int, what: str, expected: str) -> int:
    """The integer written in ``raw`` (spaces around allowed), in ``[low, high]``; else an
    ``ArgumentError`` naming ``what``, the text and ``expected``."""
    text = raw.strip()
    if not re.fullmatch(r"[+-]?\d+", text):  # int() would also take "1_0" and "١"
        raise ArgumentError(f"{what}={raw!r} is not an integer: expected {expected}")
    value = int(text)
    if not low <= value <= high:
        raise ArgumentError(f"{what}={raw!r} is out of range: expected {expected}")
    return value


def _take(env: Mapping[str, str], out: dict[str, str], name: str, var: str, low: int,
          high: int, expected: str) -> int:
    """Fill ``name`` from the scheduler's ``var`` unless it is set already; ``var``,
    when used, must be an integer in ``[low, high]`` (else named). Returns its value,
    or -1 if not used."""
    if name in out:  # anything exported wins
        return -1
    value = env_int(env, var, low, high, expected)
    out[name] = str(value)
    return value


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"gpu[03-05,07],cpu1"`` -> ``"gpu03"``."""
    return expand_hostlist(nodelist)[0]


def port_from_id(job_id: int) -> int:
    """The rendezvous port of job ``job_id`` (see the module docstring)."""
    return 10000 + job_id % 20000


def tasks_on_node(tasks_per_node: str, node: int, what: str = "tasks per node") -> int:
    """Node ``node``'s count in SLURM's ``2(x3),1`` notation; ``ArgumentError`` naming
    ``what`` (the variable it came from) if unreadable or absent."""
    seen = 0
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ArgumentError(f"{what}={tasks_per_node!r}: cannot read {item!r}: expected "
                                f"counts per node as SLURM writes them, e.g. 2(x3),1")
        seen += int(m.group(2) or 1)
        if node < seen:
            return int(m.group(1))
    raise ArgumentError(f"{what}={tasks_per_node!r} has no entry for node {node}: expected "
                        f"counts per node as SLURM writes them, e.g. 2(x3),1")


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


def _job_port(env: Mapping[str, str], out: dict[str, str], var: str) -> None:
    """MASTER_PORT from the job id in ``var`` unless set; a job id that is no integer is
    named rather than left to a missing MASTER_PORT."""
    if out.get("MASTER_PORT") or var not in env:
        return
    job = env_int(env, var, 0, 2**63 - 1, "the job's id, a non-negative integer (or export "
                  "MASTER_PORT)")
    out["MASTER_PORT"] = str(port_from_id(job))


def _fill_slurm(env: Mapping[str, str], out: dict[str, str], size: int,
                resolve: Callable[[str], str]) -> None:
    nodes = size
    if env.get("SLURM_NNODES"):
        taken = _take(env, out, "GROUP_WORLD_SIZE", "SLURM_NNODES", 1, size,
                      f"the step's node count, 1..SLURM_NTASKS = {size}")
        nodes = taken if taken > 0 else size
    var = "SLURM_STEP_TASKS_PER_NODE" if env.get("SLURM_STEP_TASKS_PER_NODE") \
        else "SLURM_TASKS_PER_NODE"
    per_node = bool(env.get(var)) and "LOCAL_WORLD_SIZE" not in out
    if env.get("SLURM_NODEID") and ("GROUP_RANK" not in out or per_node):
        node = env_int(env, "SLURM_NODEID", 0, nodes - 1,
                       f"this node's index in the step, 0..{nodes - 1}")
        out.setdefault("GROUP_RANK", str(node))
        if per_node:
            out["LOCAL_WORLD_SIZE"] = str(tasks_on_node(env[var], node, var))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
        or env.get("SLURM_NODELIST")
    if nodelist and not out.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = resolve(first_host(nodelist))
    _job_port(env, out, "SLURM_JOB_ID")


def _fill_open_mpi(env: Mapping[str, str], out: dict[str, str], size: int) -> None:
    if env.get("OMPI_COMM_WORLD_LOCAL_SIZE"):
        _take(env, out, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", 1, size,
              f"the ranks on this node, 1..OMPI_COMM_WORLD_SIZE = {size}")
    # "JOBID.VPID;tcp://10.0.0.1,10.1.0.1:PORT;...": mpirun's own addresses, first first
    hnp = re.search(r"tcp6?://\[?([^,:;\]]+)", env.get("OMPI_MCA_orte_hnp_uri", ""))
    if hnp and not out.get("MASTER_ADDR"):
        out["MASTER_ADDR"] = hnp.group(1)
    _job_port(env, out, "OMPI_MCA_ess_base_jobid")


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
    size = _take(env, out, "WORLD_SIZE", size_var, 1, MAX_WORLD_SIZE,
                 f"the job's number of ranks, 1..{MAX_WORLD_SIZE}")
    if size < 0:  # WORLD_SIZE exported wins; the scheduler's rank is checked against it
        size = env_int(out, "WORLD_SIZE", 1, MAX_WORLD_SIZE,
                       f"the number of ranks, 1..{MAX_WORLD_SIZE}")
        size_var = "WORLD_SIZE"
    _take(env, out, "RANK", rank_var, 0, size - 1,
          f"this task's rank, 0..{size_var}-1 = {size - 1}")
    if local_var in env:
        _take(env, out, "LOCAL_RANK", local_var, 0, size - 1,
              f"this task's index on its node, 0..{size - 1}")
    if task == "SLURM":
        _fill_slurm(env, out, size, resolve)
    elif task in ("Open MPI", "PMIx"):
        _fill_open_mpi(env, out, size)
    return out
