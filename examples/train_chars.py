"""Train a character-level transformer on Python's standard library with tandem DDP.

The text is the ``.py`` source of the running Python's stdlib (no download). Each
rank trains a replica wrapped in ``tandem.parallel.DistributedDataParallel`` on its
``DistributedSampler`` share; rank 0 shows progress (a tqdm bar on a terminal, a line
every tenth of the run elsewhere), evaluates, prints a generated sample and writes
``checkpoint.pt``, ``loss.png`` and ``metrics.json`` to the run's directory: a new
``runs/train_chars/run_NNN`` for each run, or ``--out DIR`` (see
``train_chars/checkpoint.py``: no run overwrites another's checkpoint).

Standalone — spawns ``--nproc`` local ranks (default 2) that meet through a FileStore
in a temporary directory::

    python examples/train_chars.py                      # ~100 s on 2 CPU cores
    python examples/train_chars.py --quick              # ~15 s smoke run
    python examples/train_chars.py --steps 600 --resume # continue the latest run

Under a launcher, which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
LOCAL_RANK (env:// rendezvous); every rank runs this file, and the launcher's flag sets
the number of ranks (``--nproc`` given to this file is then refused)::

    bash scripts/train.sh --nproc 4 --quick             # or NPROC=4: tandemrun underneath
    python -m tandem.run --nproc-per-node 2 examples/train_chars.py --quick
    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/train_chars.py &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python examples/train_chars.py

On a cluster, every rank runs this file as one task of the scheduler, or tandemrun runs
them (one per node); see ``examples/slurm/`` and ``examples/kubernetes/``::

    export TANDEM_SECRET=$(python -m tandem.secret)     # one secret for every node
    srun -N2 --ntasks-per-node=2 python examples/train_chars.py --quick
    srun -N2 --ntasks-per-node=1 tandemrun --nproc-per-node 2 examples/train_chars.py --quick
    mpirun -np 4 --host a:2,b:2 -x TANDEM_SECRET python examples/train_chars.py --quick

SIGUSR1 (SLURM's ``--signal=USR1@60`` preemption warning) makes every rank stop after the
same step, checkpoint and exit 0, leaving ``preempted.json`` in the run's directory;
``--resume`` continues (``train_chars/preempt.py``, ``examples/slurm/requeue.sbatch``).

Checkpoints (every ``--save-every`` steps and at the end) are written atomically with
``tandem.checkpoint``. When the launcher restarts the job after a failure
(``--max-restarts``), the ranks resume from the job's last checkpoint by themselves,
and end with the same parameters as a run that never failed::

    python -m tandem.run --nproc-per-node 2 --max-restarts 3 examples/train_chars.py --save-every 20

A run resumed with a different number of ranks says so: the global batch (``--batch-size``
per rank) changes with it.

Distributed optimizers and uneven inputs::

    python examples/train_chars.py --quick --zero            # ZeroRedundancyOptimizer(AdamW)
    python examples/train_chars.py --quick --shard-grads     # ... and sharded gradients (ZeRO-2)
    python examples/train_chars.py --quick --uneven 4        # rank r trains 4 x r steps fewer, Join

Measured on the 2-core development box (torch 2.13 CPU, 1 thread per rank, while other
jobs kept the load near 5.6): the default run (300 steps, global batch 32 x 128 chars,
0.6M parameters) took 206 s of training at ~47 samples/s (6k chars/s); train loss
4.58 -> 1.93, validation 4.55 -> 1.73. It used 134 s of CPU in all, so an idle
2-core box runs it in a bit over a minute. ``--quick`` takes 17-27 s, mostly
process start-up (importing torch, and torch.optim importing torch._dynamo).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import secrets
import sys
import tempfile
import time
import traceback
from typing import Any, Sequence

import torch

import tandem as dist
from tandem.collectives.cluster_env import scheduler_task

from train_chars.cli import parse
from train_chars.trainer import RunConfig, train

def parse_args(argv: Sequence[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    values, ns = parse(argv)
    return RunConfig(**values), ns


def run_rank(cfg: RunConfig, threads: int, init_method: str = "env://", rank: int = -1,
             world_size: int = -1) -> None:
    """Join the job, train, leave. ``env://`` reads RANK/WORLD_SIZE/MASTER_* (launchers)."""
    torch.set_num_threads(threads)
    dist.init_process_group(init_method=init_method, rank=rank, world_size=world_size)
    try:
        train(cfg)
    finally:
        dist.destroy_process_group()


def _local_rank(rank: int, world_size: int, cfg: RunConfig, threads: int, init: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        run_rank(cfg, threads, init, rank, world_size)
    except SystemExit as refusal:  # every rank refuses alike: one says why
        if rank == 0 and isinstance(refusal.code, str):
            sys.stderr.write(refusal.code + "\n")
        raise SystemExit(0 if refusal.code in (None, 0) else 1)
    except BaseException:
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        raise SystemExit(1)


def launch_local(cfg: RunConfig, nproc: int, threads: int) -> int:
    """Run ``nproc`` ranks as spawned processes; return the job's exit code.

    A rank that fails makes the others fail fast (tandem notices the closed
    connections); any still running 15 s later are killed.
    """
    os.environ.setdefault("TANDEM_SECRET", secrets.token_hex(16))  # inherited by the ranks
    with tempfile.TemporaryDirectory(prefix="train-chars-") as tmp:
        init = f"file://{tmp}/store"
        if nproc == 1:
            run_rank(cfg, threads, init, 0, 1)
            return 0
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_local_rank, args=(r, nproc, cfg, threads, init))
                 for r in range(nproc)]
        for proc in procs:
            proc.start()
        code, kill_at = 0, float("inf")
        try:
            while any(proc.is_alive() for proc in procs):
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed and not code:
                    code, kill_at = failed[0], time.monotonic() + 15
                if time.monotonic() > kill_at:
                    break
                time.sleep(0.2)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        codes: list[Any] = [p.exitcode for p in procs]
        for rank, c in enumerate(codes):
            if c:
                why = f"signal {-c}" if c < 0 else f"exit code {c}"
                sys.stderr.write(f"train_chars: rank {rank} ended with {why}\n")
        code = code or next((c for c in codes if c), 0)
        return 1 if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    cfg, ns = parse_args(argv)
    if ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or scheduler_task(os.environ):
        run_rank(cfg, ns.threads)  # started by a launcher, or as one task of srun / mpirun
        return 0
    if ns.elastic:
        sys.exit("train_chars: --elastic needs tandemrun, which replaces lost ranks: "
                 "bash scripts/train.sh --elastic, or python -m tandem.run --standalone "
                 "--nproc-per-node 2 --max-restarts 3 examples/train_chars.py --elastic")
    return launch_local(cfg, 2 if ns.nproc is None else ns.nproc, ns.threads)


if __name__ == "__main__":
    sys.exit(main())
