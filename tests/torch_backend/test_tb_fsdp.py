"""torch's FSDP2 (``fully_shard``), DeviceMesh and distributed checkpoint over "tandem".

* A small transformer, sharded with ``fully_shard`` over the default group ("tandem"),
  trains 10 steps with the same loss curve and final parameters as over a gloo group
  of the same ranks (to 1e-6).
* On 4 ranks, a 2x2 DeviceMesh shards over one dimension and replicates over the
  other (HSDP); it trains like the same mesh built from gloo groups.
* ``torch.distributed.checkpoint`` saves that sharded model and optimizer; fresh
  processes (a restart) load them and continue exactly where the first run stopped.

Run: ``python -m pytest tests/torch_backend/test_tb_fsdp.py -q``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

from tandem.bench.torch_backend import TinyTransformer

from _tb_util import checked, init, results_on

pytestmark = pytest.mark.procs

STEPS = 10
TOLERANCE = 1e-6
VOCAB, WIDTH, SEQ, BATCH = 64, 32, 8, 4


def _sharded(mesh: DeviceMesh, seed: int = 5) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyTransformer(VOCAB, WIDTH, layers=2)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    opt.zero_grad()
    loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return float(loss)


def _train(mesh: DeviceMesh, rank: int, steps: int = STEPS) -> dict[str, Any]:
    model, opt = _sharded(mesh)
    losses = [_step(model, opt, rank, s) for s in range(steps)]
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "shards": shards}


def _gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest difference between two runs' losses and parameter shards."""
    gaps = [abs(x - y) for x, y in zip(a["losses"], b["losses"])]
    gaps += [(a["shards"][n] - b["shards"][n]).abs().max().item() for n in a["shards"]
             if a["shards"][n].numel()]
    return max(gaps)


def _ours_vs_gloo_1d(rank: int, world: int) -> float:
    gloo = dist.new_group(backend="gloo")
    ours = _train(init_device_mesh("cpu", (world,)), rank)
    theirs = _train(DeviceMesh.from_group(gloo, "cpu"), rank)
    assert dist.get_backend(ours_group := dist.group.WORLD) == "tandem", ours_group
    return _gap(ours, theirs)


def fsdp_1d(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    init(rank, world, store_dir)
    return checked({"fsdp_vs_gloo": lambda: _ours_vs_gloo_1d(rank, world)})


def _gloo_2x2() -> DeviceMesh:
    rows, cols = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    shard = [dist.new_group(r, backend="gloo") for r in rows]  # every rank creates every group
    replicate = [dist.new_group(c, backend="gloo") for c in cols]
    me = dist.get_rank()
    return DeviceMesh.from_group([next(g for g, c in zip(replicate, cols) if me in c),
                                  next(g for g, r in zip(shard, rows) if me in r)], "cpu",
                                 mesh=torch.arange(4).view(2, 2),
                                 mesh_dim_names=("replicate", "shard"))


def _hsdp_and_save(rank: int, ckpt: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    assert all(dist.get_backend(mesh.get_group(d)) == "tandem" for d in range(2))
    ours = _train(mesh, rank, STEPS)
    theirs = _train(_gloo_2x2(), rank, STEPS)
    model, opt = _sharded(mesh)
    before = [_step(model, opt, rank, s) for s in range(3)]
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    after = _step(model, opt, rank, 3)  # what the restarted job must reproduce
    return {"gap": _gap(ours, theirs), "losses": ours["losses"], "before": before,
            "after": after}


def hsdp_2x2(rank: int, world: int, store_dir: str, ckpt: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    init(rank, world, store_dir)
    return checked({"hsdp": lambda: _hsdp_and_save(rank, ckpt)})


def _load_and_continue(rank: int, ckpt: str) -> float:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, opt = _sharded(mesh, seed=99)  # different weights until the checkpoint loads
    _step(model, opt, rank, 0)  # the optimizer gets state to load into
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    return _step(model, opt, rank, 3)


def restarted(rank: int, world: int, store_dir: str, ckpt: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    init(rank, world, store_dir)
    return checked({"resumed": lambda: _load_and_continue(rank, ckpt)})


def _ok(result: dict[str, Any], name: str, rank: int) -> Any:
    value = result[name]
    assert not (isinstance(value, dict) and "error" in value), (
        f"{name} failed on rank {rank}:\n{value['error']}")
    return value


@pytest.mark.timeout(200)
def test_fully_shard_trains_like_gloo(tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank, result in enumerate(results_on(2, fsdp_1d, tmp_path_factory, 170)):
        gap = _ok(result, "fsdp_vs_gloo", rank)
        assert gap <= TOLERANCE, f"rank {rank}: FSDP2 over tandem differs from gloo by {gap:.3g}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    ckpt = str(tmp_path_factory.mktemp("dcp") / "step3")
    return ckpt, [_ok(r, "hsdp", i) for i, r in
                  enumerate(results_on(4, hsdp_2x2, tmp_path_factory, 230, ckpt))]


@pytest.mark.timeout(260)
def test_2x2_mesh_shards_and_replicates_like_gloo(
        checkpoint: tuple[str, list[dict[str, Any]]]) -> None:
    for rank, run in enumerate(checkpoint[1]):
        assert run["gap"] <= TOLERANCE, f"rank {rank}: HSDP differs from gloo by {run['gap']:.3g}"
        assert run["losses"][-1] < run["losses"][0], f"rank {rank} did not learn: {run['losses']}"


@pytest.mark.timeout(260)
def test_checkpoint_resumes_after_a_restart(checkpoint: tuple[str, list[dict[str, Any]]],
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    ckpt, first = checkpoint
    for rank, result in enumerate(results_on(4, restarted, tmp_path_factory, 230, ckpt)):
        resumed = _ok(result, "resumed", rank)
        assert resumed == first[rank]["after"], (
            f"rank {rank}: the restarted job's next loss {resumed} differs from the original "
            f"job's {first[rank]['after']}")
