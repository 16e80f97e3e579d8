"""The main example (``train_chars.py``) on Ray: one Ray actor per rank, with tandem.ray.

    pip install 'tandem[ray]'
    python examples/ray_train_chars.py --workers 2 --quick          # Ray on this machine
    RAY_ADDRESS=HEAD:6379 python examples/ray_train_chars.py --workers 4 --strategy SPREAD --quick

Every flag but ``--workers``, ``--cpus`` and ``--strategy`` goes to ``train_chars.py``.
Without ``RAY_ADDRESS`` ``ray.init()`` starts Ray on this machine (and stops it at the
end). On a cluster, every node needs this repository at the same path (as with
``srun``); the actors work in this directory, so ``--out`` and ``runs/`` are found
there. Each rank's lines come back prefixed ``[rankN]:``; at the end every rank says
where it ran::

    ray_train_chars: rank 0 ran on node1 (local rank 0 of 2), rendezvous at 10.0.0.1
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

from tandem.ray import STRATEGIES, ScalingConfig, Trainer

EXAMPLES = str(Path(__file__).resolve().parent)


def train(config: dict[str, Any]) -> dict[str, Any]:
    """One rank: the main example's training, joined with init_process_group() alone."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    os.chdir(config["cwd"])
    import torch

    import tandem
    from train_chars.cli import parse
    from train_chars.trainer import RunConfig, train as train_run

    values, ns = parse(config["argv"])
    torch.set_num_threads(ns.threads)
    tandem.init_process_group()  # RANK, WORLD_SIZE, MASTER_ADDR ... come from tandem.ray
    try:
        train_run(RunConfig(**values))
        return {"rank": tandem.get_rank(), "host": socket.gethostname(),
                "local_rank": int(os.environ["LOCAL_RANK"]),
                "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
                "master_addr": os.environ["MASTER_ADDR"]}
    finally:
        tandem.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="ranks: one Ray actor each (2)")
    p.add_argument("--cpus", type=float, default=0.5, help="CPUs each actor reserves (0.5)")
    p.add_argument("--strategy", default="PACK", choices=STRATEGIES,
                   help="placement group strategy (PACK)")
    ns, rest = p.parse_known_args(argv)
    trainer = Trainer(train, train_loop_config={"argv": rest, "cwd": os.getcwd()},
                      scaling_config=ScalingConfig(num_workers=ns.workers,
                                                   cpus_per_worker=ns.cpus,
                                                   placement_strategy=ns.strategy))
    for r in trainer.fit():
        print(f"ray_train_chars: rank {r['rank']} ran on {r['host']} (local rank "
              f"{r['local_rank']} of {r['local_world_size']}), rendezvous at "
              f"{r['master_addr']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
