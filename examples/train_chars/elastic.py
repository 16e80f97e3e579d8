"""``--elastic``: the training loop under ``tandem.elastic``, so a lost rank costs seconds.

Run it under tandemrun (``bash scripts/train.sh --elastic`` does)::

    python -m tandem.run --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/train_chars.py --elastic
    kill -9 <pid of a worker>              # from another terminal: training goes on

The state (model, AdamW, the step and the loss history) is committed in memory every
step. When a rank dies, the others roll back to the last commit, go on without it
(the global batch shrinks: each rank keeps its ``--batch-size``) and the launcher starts
a replacement, which runs the script up to here alone, then joins at a commit and
receives the state from a live rank. The data each rank takes per step comes from an
``ElasticSampler`` (shuffled by ``--seed``), so it follows the membership. Disk
checkpoints (``--save-every``) are still written, by the current rank 0.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import tandem as dist
from tandem.elastic import ElasticSampler, ElasticState, run_elastic

from train_chars.data import CharWindows
from train_chars.progress import Progress

__all__ = ["joining", "train_elastic", "COMMIT_EVERY"]

COMMIT_EVERY = 1  # steps between in-memory commits (the most a failure makes us redo)


def joining() -> bool:
    """Whether this worker is a replacement waiting to join (alone until admitted)."""
    return os.environ.get("TANDEM_ELASTIC_JOIN") == "1"


def train_elastic(cfg: Any, ddp: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  windows: CharWindows, step: int, history: list[Any], progress: Progress,
                  lr: Callable[[int], float], step_seed: Callable[[int, int], int],
                  mean: Callable[[torch.Tensor], float], save: Callable[[int, list[Any]], None],
                  run_dir: list[str]) -> tuple[int, list[Any]]:
    """Train from ``step`` to ``cfg.steps`` under ``run_elastic``; (step, history) at the end.

    ``run_dir[0]``: the run's directory; each membership takes rank 0's (a replacement
    starts without one)."""
    state = ElasticState(model=ddp, optimizer=optimizer, step=step, history=history)
    sampler = ElasticSampler(windows, state, cfg.batch_size, seed=cfg.seed)
    loader = DataLoader(windows, batch_sampler=sampler)  # kept across membership changes
    model = ddp.module

    @run_elastic(state)
    def loop(state: ElasticState) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        progress.enabled = rank == 0  # rank 0 may be another worker after a change
        infos: list[Any] = [None] * world
        dist.all_gather_object(infos, (os.getpid(), run_dir[0]))
        run_dir[0] = infos[0][1]  # rank 0 is always a worker that was there before
        if rank == 0:  # the pids, for whoever wants to try a kill -9
            print(f"train_chars: elastic, {world} ranks at step {state.step}: "
                  + ", ".join(f"rank {r} pid {pid}" for r, (pid, _) in enumerate(infos))
                  + " (kill -9 one: the others go on)", flush=True)
        first, started = state.step, time.monotonic()
        for x, y in loader:
            if state.step >= cfg.steps:
                return
            torch.manual_seed(step_seed(rank, state.step))  # dropout, if enabled
            for group in optimizer.param_groups:
                group["lr"] = lr(state.step)
            loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            state.step += 1
            state.history.append((state.step, mean(loss)))
            rate = (state.step - first) * cfg.batch_size * world / (time.monotonic() - started)
            progress.update(state.step, state.history[-1][1], rate)
            if cfg.save_every and state.step % cfg.save_every == 0 and state.step < cfg.steps:
                save(state.step, state.history)
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    loop()
    return state.step, state.history
