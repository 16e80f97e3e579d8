"""What each worker is started with: its environment, command line and file paths.

The environment is the launcher's own plus, for every worker::

    RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE
    ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT
    TANDEM_RESTART_COUNT TANDEM_MAX_RESTARTS TANDEM_RUN_ID TANDEM_ERROR_FILE
    TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID  (the same
                       values under torch's names, for ported scripts that read them)
    TANDEM_SECRET      (a fresh per-job secret, unless TANDEM_SECRET/_FILE is set)
    TANDEM_TRACE_DIR   (with per-rank log files and unless set: <attempt dir>/trace)
    OMP_NUM_THREADS=1  (only if unset and more than one worker per node, as torchrun)
    TANDEM_TRACEBACK_ONCE  <attempt dir>/traceback_shown: the first rank to create it
                       prints its traceback, the others one line (``_tracebacks.py``)
    TANDEM_DUMP_NOTICE=0   (unless set: the launcher names every rank's dump in one line)
    TANDEM_TTY=1, COLUMNS  (only for workers whose stderr reaches the launcher's
                       console when that is a terminal: see :func:`streams.terminal_env`)

Two of torchrun's variables stay unset: ``TORCHELASTIC_ERROR_FILE`` (the bootstrap
records uncaught errors itself, and ``record`` is torch's decorator only when it is set)
and ``TORCHELASTIC_USE_AGENT_STORE`` (torch's ``init_process_group`` would then connect
to a store the launcher does not serve at ``MASTER_PORT``).
"""

from __future__ import annotations

import os
from typing import Mapping

from tandem.run.config import LaunchConfig, Std
from tandem.run.rendezvous import Assignment
from tandem.run.streams import terminal_env
from tandem.run.workers import WorkerSpec, python_argv

__all__ = ["worker_env", "worker_specs", "attempt_dir"]


def worker_env(cfg: LaunchConfig, a: Assignment, local_rank: int, base: Mapping[str, str],
               extra: Mapping[str, str], error_file: str) -> dict[str, str]:
    """The full environment of local rank ``local_rank`` in assignment ``a``."""
    env = dict(base)
    env.update(extra)
    env.update({
        "RANK": str(a.rank_offset + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(a.world_size),
        "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node),
        "GROUP_RANK": str(a.node_rank),
        "GROUP_WORLD_SIZE": str(a.nnodes),
        "ROLE_RANK": str(a.role_rank_offset + local_rank),
        "ROLE_WORLD_SIZE": str(a.role_world_size),
        "ROLE_NAME": cfg.role,
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port),
        "TANDEM_RESTART_COUNT": str(a.restart_count),
        "TANDEM_MAX_RESTARTS": str(cfg.max_restarts),
        "TANDEM_RUN_ID": a.run_id,
        "TANDEM_ERROR_FILE": error_file,
        # a torch script typically resumes from its checkpoint when the restart count
        # is above 0; without these it would read a KeyError, or restart from scratch
        "TORCHELASTIC_RESTART_COUNT": str(a.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(cfg.max_restarts),
        "TORCHELASTIC_RUN_ID": a.run_id,
    })
    return env


def attempt_dir(root: str, a: Assignment) -> str:
    """``<root>/<run_id>/attempt_<n>``: one attempt's logs and error files."""
    return os.path.join(root, a.run_id, f"attempt_{a.attempt}")


def worker_specs(cfg: LaunchConfig, a: Assignment, *, base: Mapping[str, str],
                 extra: Mapping[str, str], files_root: str, keep_logs: bool,
                 supervisor: tuple[str, ...], cgroup: str = "") -> list[WorkerSpec]:
    """One :class:`WorkerSpec` per local rank; creates their directories under ``files_root``.

    ``supervisor`` holds the options of each worker's supervisor (``_worker.py``);
    ``cgroup`` is the job's cgroup, if it has one.
    """
    specs = []
    claim = os.path.join(attempt_dir(files_root, a), "traceback_shown")
    terminal = terminal_env()
    argv = python_argv(cfg.entrypoint, cfg.args, module=cfg.module, no_python=cfg.no_python,
                       supervisor=supervisor)
    for local_rank in range(cfg.nproc_per_node):
        rank = a.rank_offset + local_rank
        rank_dir = os.path.join(attempt_dir(files_root, a), f"rank_{rank}")
        os.makedirs(rank_dir, exist_ok=True)
        error_file = os.path.join(rank_dir, "error.json")
        for stale in (error_file, claim):  # left by an earlier launch with the same run id
            if os.path.exists(stale):
                os.unlink(stale)
        env = worker_env(cfg, a, local_rank, base, extra, error_file)
        env["TANDEM_TRACEBACK_ONCE"] = claim
        env.setdefault("TANDEM_DUMP_NOTICE", "0")
        if cfg.console_for(local_rank, Std.ERR):
            env.update(terminal)
        if keep_logs and not env.get("TANDEM_TRACE_DIR"):  # flight recorders beside the logs
            env["TANDEM_TRACE_DIR"] = os.path.join(attempt_dir(files_root, a), "trace")
        specs.append(WorkerSpec(
            rank=rank, local_rank=local_rank, argv=argv,
            env=env,
            error_file=error_file, log_dir=rank_dir if keep_logs else None,
            stdout_console=cfg.console_for(local_rank, Std.OUT),
            stderr_console=cfg.console_for(local_rank, Std.ERR), cgroup=cgroup))
    return specs
