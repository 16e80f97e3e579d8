"""tandemrun: launch a distributed job, with torchrun's flags.

One node, two workers (ports picked for you; several jobs may share a host)::

    python -m tandem.run --standalone --nproc-per-node 2 train.py --lr 0.1
    tandemrun --nproc_per_node=2 train.py                 # same; either spelling
    PET_NPROC_PER_NODE=2 tandemrun -m my_pkg.train        # flags from PET_<FLAG> too

Two nodes (static rendezvous; the same secret on both)::

    export TANDEM_SECRET=...   # or TANDEM_SECRET_FILE=/shared/secret
    tandemrun --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 train.py
    tandemrun --nnodes 2 --node-rank 1 --master-addr node0 --master-port 29500 train.py

Elastic (c10d): 2 to 4 nodes, ranks by join order, nodes may join and leave::

    tandemrun --nnodes 2:4 --rdzv-backend c10d --rdzv-endpoint node0:29400 \
              --max-restarts 3 --rdzv-conf last_call_timeout=30 train.py

Restarts, logs and failures::

    tandemrun --max-restarts 3 --log-dir logs -t 3 --local-ranks-filter 0 train.py

Workers get RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... (see
:mod:`tandem.run.workerenv`), so ``tandem.init_process_group()`` (env://) just works.
An uncaught exception in a worker is recorded without any decorator; when the job
gives up, the launcher prints the first failing rank, its host, exit code or signal,
exception and traceback. Pieces: :mod:`~tandem.run.args` (command line),
:mod:`~tandem.run.agent` (the loop), :mod:`~tandem.run.rendezvous` and
:mod:`~tandem.run.multinode` (agreement between nodes), :mod:`~tandem.run.workers`
(processes), :mod:`~tandem.run.rootcause` (the summary), ``_worker.py`` (the bootstrap),
``_supervisor.py`` and :mod:`~tandem.run.containment` (nothing a job starts outlives it:
a supervisor per worker, the job's cgroup, its scratch directory),
:mod:`~tandem.run.dynamic` (c10d, MIN:MAX) and :mod:`~tandem.run.heartbeat` (lost nodes).
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    from tandem.errors import ArgumentError, TandemError
    from tandem.run.agent import Agent
    from tandem.run.args import parse

    try:
        cfg = parse(list(sys.argv[1:] if argv is None else argv))
        return Agent(cfg).run()
    except ArgumentError as exc:
        sys.stderr.write(f"tandemrun: error: {exc}\n")
        return 2
    except TandemError as exc:  # rendezvous: store lost, nodes missing, wrong secret
        sys.stderr.write(f"tandemrun: error: {type(exc).__name__}: {exc}\n")
        return 1
