"""DDP on a group whose ranks span hosts: each bucket is one all-reduce, and training
still equals one process on the concatenated batch.

Threads over the loopback transport claim host identities (``run_threads(...,
hosts=...)``), so the group's topology is whatever a test says and the all-reduce
runs hierarchically, as it would across real hosts.

Run: ``python -m pytest tests/parallel/test_ddp_across_hosts.py -q``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tandem
from tandem.collectives.group import ProcessGroup
from tandem.parallel import DistributedDataParallel as DDP
from tandem.parallel._reducer import MAX_MESSAGE_BYTES, message_cap
from tandem.testing import run_threads

pytestmark = pytest.mark.timeout(300)

STEPS = 2
LOCAL_BATCH = 2
# one weight of 4.2 MiB: larger than a within-host piece, so it is cut there
WIDE = (MAX_MESSAGE_BYTES // 4) // 64 + 16


def _model() -> nn.Module:
    # built once, before the threads start: they share torch's global generator
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, WIDE))


def _train(group: ProcessGroup, world: int, initial: nn.Module) -> dict[str, Any]:
    torch.set_num_threads(1)
    rank = group.rank()
    oracle = copy.deepcopy(initial)
    model = DDP(copy.deepcopy(oracle), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    oracle_opt = torch.optim.SGD(oracle.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(1)
    calls = _all_reduce_calls(group)
    for _ in range(STEPS):
        x = torch.randn(world * LOCAL_BATCH, 8, generator=gen)
        y = torch.randn(world * LOCAL_BATCH, WIDE, generator=gen)
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        opt.zero_grad()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        oracle_opt.zero_grad()
        F.mse_loss(oracle(x), y).backward()
        oracle_opt.step()
    errors = {name: (p - q).abs().max().item() for (name, p), q
              in zip(model.module.named_parameters(), oracle.parameters())}
    return {"cap": model.reducer.max_message_bytes, "errors": errors,
            "calls": (_all_reduce_calls(group) - calls) // STEPS,
            "buckets": len(model.reducer.buckets)}


def _all_reduce_calls(group: ProcessGroup) -> int:
    done = tandem.stats(group)[group.group_name].get("all_reduce")
    return 0 if done is None else done.count


@pytest.mark.parametrize("hosts", ["aabb", "abab", "ab"])
def test_across_hosts_each_bucket_is_one_all_reduce_and_training_matches(hosts: str) -> None:
    for rank, got in enumerate(run_threads(len(hosts), _train, (len(hosts), _model()), timeout=90,
                                           hosts=list(hosts))):
        assert got["cap"] is None, (hosts, rank)
        assert got["calls"] == got["buckets"], (hosts, rank, got)
        worst = max(got["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 2e-5, (f"hosts {hosts}, rank {rank}: parameter '{worst[0]}' "
                                  f"differs from single-process training by {worst[1]:.3g}")


def test_within_one_host_a_large_bucket_is_cut_into_pieces() -> None:
    for rank, got in enumerate(run_threads(2, _train, (2, _model()), timeout=90, hosts=["a", "a"])):
        assert got["cap"] == MAX_MESSAGE_BYTES, rank
        assert got["calls"] > got["buckets"], (rank, got)
        worst = max(got["errors"].values())
        assert worst <= 2e-5, (rank, got["errors"])


def test_message_cap_ignores_ranks_of_unknown_host() -> None:
    caps = run_threads(2, lambda g: message_cap(g))
    assert caps == [MAX_MESSAGE_BYTES] * 2
