"""DDP under ``Join`` with uneven inputs: no hang, and torch's result on the same data.

Each rank process joins tandem (by the harness) and torch.distributed with gloo, wraps
two copies of one model (ranks other than 0 scramble theirs first), and trains each
under its library's ``Join`` on BATCHES[rank] batches of its own. Every case ends with
the same parameters on every rank, equal to torch DDP's under torch's Join.
One spawn per (world, backend) runs every case: the shm backend reduces ``.grad`` in
place, tcp goes through buckets.

Run: ``python -m pytest tests/parallel/test_ddp_join.py -q``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.nn import functional as F

import tandem
from tandem.algorithms.join import Join

from test_ddp_torch_parity import each_case_with_gloo, spawn_with_gloo, twins
from test_ddp_training import LOCAL_BATCH, PlainSGD, _inputs

pytestmark = pytest.mark.procs

BATCHES = {2: [9, 5], 3: [5, 9, 6]}  # batches per rank: rank 0 leaves last or first

# case -> (model, DDP keyword arguments, Join keyword arguments)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "mlp": ("mlp", {}, {}),
    "mlp_divide_by_active": ("mlp", {}, {"divide_by_initial_world_size": False}),
    "mlp_small_buckets": ("mlp", {"bucket_cap_mb": 0.001}, {}),
    "batchnorm_buffers": ("batchnorm", {}, {}),
    "unused_find": ("unused", {"find_unused_parameters": True}, {}),
}


def _train(ddp: Any, join: Any, model: str, rank: int, world: int) -> None:
    opt = PlainSGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with join:
        for step in range(BATCHES[world][rank]):
            x, y = _inputs(model, LOCAL_BATCH * world, step)
            lo = rank * LOCAL_BATCH
            opt.zero_grad()
            F.mse_loss(ddp(x[lo:lo + LOCAL_BATCH]), y[lo:lo + LOCAL_BATCH]).backward()
            opt.step()


def compare(rank: int, world: int, gloo_url: str) -> dict[str, Any]:
    def run(case: str) -> dict[str, Any]:
        model_name, ddp_kw, join_kw = CASES[case]
        ours, ref = twins(model_name, rank, ddp_kw)
        _train(ours, Join([ours], **join_kw), model_name, rank, world)
        _train(ref, TorchJoin([ref], **join_kw), model_name, rank, world)
        return compare_states(ours.module, ref.module)

    return each_case_with_gloo(rank, world, gloo_url, list(CASES), run)


def compare_states(ours: torch.nn.Module, theirs: torch.nn.Module) -> dict[str, Any]:
    """Largest difference per tensor to ``theirs``, and to group rank 0's ``ours``."""
    a = {n: t.double() for n, t in ours.state_dict().items()}
    b = {n: t.double() for n, t in theirs.state_dict().items()}
    flat = torch.cat([t.reshape(-1) for t in a.values()])
    first = flat.clone()
    tandem.broadcast(first, src=0)
    return {"torch": {n: (a[n] - b[n]).abs().max().item() for n in b},
            "ranks": (flat - first).abs().max().item()}


@pytest.fixture(scope="module", params=[(2, "shm"), (2, "tcp"), (3, "shm"), (3, "tcp")],
                ids=lambda p: f"{p[0]}ranks-{p[1]}")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_with_gloo(compare, request, tmp_path_factory, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_uneven_inputs_end_like_torch_join_on_every_rank(results: list[dict[str, Any]],
                                                        case: str) -> None:
    for rank, r in enumerate(x[case] for x in results):
        assert "error" not in r, f"{case} failed on rank {rank}:\n{r['error']}"
        assert r["ranks"] == 0.0, f"{case}: rank {rank}'s parameters differ from rank 0's"
        name, worst = max(r["torch"].items(), key=lambda kv: kv[1])
        assert worst <= 1e-6, (f"{case}, rank {rank} of {len(results)}: '{name}' differs from "
                               f"torch DDP under torch's Join by {worst:.3g}")
