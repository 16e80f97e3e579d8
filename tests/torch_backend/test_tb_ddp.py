"""torch's own DDP, ZeroRedundancyOptimizer and Join over "tandem" train bitwise like gloo.

Each rank wraps two copies of one model in torch's DistributedDataParallel: one on
the default group (backend "tandem"), one on a gloo group over the same ranks; both
train 10 steps on the same data and must end with bitwise equal parameters.

Float addition is commutative but not associative: two contributions sum alike in
any order, three may not, and gloo's ring adds them in a different order per chunk.
So with three ranks, one rank (a different one each step) scales its loss by zero:
every gradient element then sums two non-zero contributions and a zero, which gives
one result in every order, while every rank still contributes in two steps of three.

Run: ``python -m pytest tests/torch_backend/test_tb_ddp.py -q``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from _tb_util import checked, init, results_on

pytestmark = pytest.mark.procs

STEPS = 10
BATCH = 8


class Net(nn.Module):
    """An MLP with a branch that some steps leave unused."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)
        self.extra = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + self.extra(h) if use_extra else self.head(h)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def _weight(rank: int, world: int, step: int) -> float:
    return 0.0 if world > 2 and rank == step % world else 1.0  # see the module docstring


def _train(ddp: DDP, rank: int, world: int, mode: str) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        w = _weight(rank, world, step)
        opt.zero_grad()
        if mode == "no_sync":
            with ddp.no_sync():
                (w * F.mse_loss(ddp(x * 2), y)).backward()
        use_extra = mode != "unused" or (step + rank) % 2 == 0
        (w * F.mse_loss(ddp(x, use_extra), y)).backward()
        opt.step()


MODES: dict[str, tuple[dict[str, Any], str, Callable[..., Any] | None]] = {
    "plain": ({}, "plain", None),
    "small_buckets": ({"bucket_cap_mb": 0.005}, "plain", None),
    "no_sync": ({}, "no_sync", None),
    "find_unused_parameters": ({"find_unused_parameters": True}, "unused", None),
    "fp16_compress_hook": ({}, "plain", default_hooks.fp16_compress_hook),
}


def _ddp_case(rank: int, world: int, gloo: Any, mode: str) -> dict[str, Any]:
    kwargs, how, hook = MODES[mode]
    torch.manual_seed(7)
    model = Net()
    ours, theirs = DDP(model, **kwargs), DDP(copy.deepcopy(model), process_group=gloo, **kwargs)
    if hook is not None:
        ours.register_comm_hook(None, hook)
        theirs.register_comm_hook(gloo, hook)
    for ddp in (ours, theirs):
        _train(ddp, rank, world, how)
    return _differences(ours.module, theirs.module)


def _differences(a: nn.Module, b: nn.Module) -> dict[str, Any]:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return {n: (pa[n] - pb[n]).abs().max().item() if not torch.equal(pa[n], pb[n]) else 0.0
            for n in pa}


def _zero(rank: int, world: int, gloo: Any) -> dict[str, Any]:
    torch.manual_seed(11)
    model = Net()
    runs = []
    for group in (None, gloo):
        ddp = DDP(copy.deepcopy(model), process_group=group)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam,
                                      process_group=group, lr=0.01)
        for step in range(STEPS):
            x, y = _batch(rank, step)
            opt.zero_grad()
            (_weight(rank, world, step) * F.mse_loss(ddp(x), y)).backward()
            opt.step()
        runs.append(ddp.module)
    return _differences(*runs)


def _join(rank: int, world: int, gloo: Any) -> dict[str, Any]:
    torch.manual_seed(13)
    model = Net()
    runs = []
    for group in (None, gloo):
        ddp = DDP(copy.deepcopy(model), process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        with Join([ddp]):
            for step in range(4 + 3 * rank):  # uneven inputs: rank 0 runs out first
                x, y = _batch(rank, step)
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()
        runs.append(ddp.module)
    return _differences(*runs)


def compare(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    init(rank, world, store_dir)
    gloo = dist.new_group(backend="gloo")
    cases: dict[str, Callable[[], Any]] = {
        mode: (lambda m=mode: _ddp_case(rank, world, gloo, m)) for mode in MODES}
    cases["zero_redundancy_optimizer"] = lambda: _zero(rank, world, gloo)
    if world == 2:  # with three ranks a joined rank adds a third contribution
        cases["join_uneven_inputs"] = lambda: _join(rank, world, gloo)
    return checked(cases)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return results_on(request.param, compare, tmp_path_factory, 170)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", [*MODES, "zero_redundancy_optimizer", "join_uneven_inputs"])
def test_parameters_are_bitwise_equal_to_gloo(results: list[dict[str, Any]], case: str) -> None:
    if case not in results[0]:
        pytest.skip(f"{case} runs with two ranks only (see _join)")
    for rank, diffs in enumerate(r[case] for r in results):
        assert "error" not in diffs, f"{case} failed on rank {rank}:\n{diffs['error']}"
        differing = {n: d for n, d in diffs.items() if d != 0.0}
        assert not differing, (f"{case}, rank {rank} of {len(results)}: parameters differ from "
                               f"torch's DDP over gloo by {differing}")
