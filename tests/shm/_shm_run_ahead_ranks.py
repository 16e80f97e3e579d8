"""Rank body of the run-ahead test (importable by spawned children)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

import tandem as dist
from tandem.collectives.algorithms import shm_checks, shm_gather
from tandem.collectives.world import default_group
from tandem.transport._arena import _KEPT

AHEAD = 2 * _KEPT + 1  # calls a non-root runs ahead: past every announcement kept


def _late_verify(original: Callable[..., None]) -> Callable[..., None]:
    """Rank 0's check of a call, made only once rank 1 announced a call AHEAD later."""
    def late(op: Any, arena: Any, members: Any = None) -> None:
        deadline = time.monotonic() + 60
        while arena.latest(1)[0] < op.seq + AHEAD:  # rank 1 runs its gathers meanwhile
            assert time.monotonic() < deadline, "rank 1 never ran ahead"
            time.sleep(0.001)
        original(op, arena, members)
    return late


def run_ahead(rank: int, world_size: int, collective: str) -> dict[str, Any]:
    """``collective`` (all-gather or reduce-scatter) over shared memory, then AHEAD
    gathers to rank 0: rank 1, a non-root, returns from each gather without waiting, so
    it is AHEAD calls further when rank 0 checks the first call (made to happen: rank 0
    checks late)."""
    torch.set_num_threads(1)
    g = default_group()
    x = torch.full((256,), float(rank + 1))
    if rank == 0:
        late = _late_verify(shm_checks.verify)
        shm_gather.verify = late  # type: ignore[attr-defined]
    if collective == "all_gather_into_tensor":
        out = torch.empty(512)
        dist.all_gather_into_tensor(out, x)
        first = out.tolist() == [1.0] * 256 + [2.0] * 256
    else:
        out = torch.empty(128)
        dist.reduce_scatter_tensor(out, x)
        first = out.tolist() == [3.0] * 128
    parts = [torch.empty(256) for _ in range(2)]
    got = []
    for i in range(AHEAD):
        x.fill_(rank * 100 + i)
        dist.gather(x, parts if rank == 0 else None, dst=0)
        if rank == 0:
            got.append([parts[0][0].item(), parts[1][0].item()])
    dist.barrier()
    return {"first": first, "gathered": got, "shares": g.shares_memory}
