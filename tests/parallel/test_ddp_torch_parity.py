"""tandem's DDP and torch's DDP (gloo) train to the same weights from the same seeds.

Each rank process joins both tandem (by the harness) and torch.distributed with gloo
(``file://`` rendezvous in the test's temporary directory, so no fixed port), wraps
two copies of one model, one in each DDP, and runs the same steps on the same data.

Run: ``python -m pytest tests/parallel/test_ddp_torch_parity.py -q``.
"""

from __future__ import annotations

import copy
import datetime
import socket
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from tandem.parallel.ddp import DistributedDataParallel as DDP
from tandem.testing import spawn

from test_ddp_training import BUILDERS, LOCAL_BATCH, PlainSGD, _inputs, _scramble, _use_extra

pytestmark = pytest.mark.procs

STEPS = 3

# case -> (model, keyword arguments for both DDPs, training mode)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "mlp": ("mlp", {}, "plain"),
    "cnn_small_buckets": ("cnn", {"bucket_cap_mb": 0.001}, "plain"),
    "transformer": ("transformer", {}, "plain"),
    "unused_find": ("unused", {"find_unused_parameters": True}, "unused"),
    "bucket_view": ("mlp", {"gradient_as_bucket_view": True}, "plain"),
    "no_sync": ("mlp", {}, "no_sync"),
    "batchnorm_buffers": ("batchnorm", {}, "plain"),
    "batchnorm_no_broadcast": ("batchnorm", {"broadcast_buffers": False}, "plain"),
}


def _train(ddp: nn.Module, mode: str, model: str, rank: int, world: int) -> None:
    opt = PlainSGD(ddp.parameters(), lr=0.05, momentum=0.9)
    lo, hi = rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH
    for step in range(STEPS):
        x, y = _inputs(model, LOCAL_BATCH * world, step)
        opt.zero_grad()
        if mode == "unused":
            F.mse_loss(ddp(x[lo:hi], _use_extra(rank, step)), y[lo:hi]).backward()
        elif mode == "no_sync":
            with ddp.no_sync():  # type: ignore[operator]
                F.mse_loss(ddp(x[lo:hi] * 2), y[lo:hi]).backward()
            F.mse_loss(ddp(x[lo:hi]), y[lo:hi]).backward()
        else:
            F.mse_loss(ddp(x[lo:hi]), y[lo:hi]).backward()
        opt.step()


def each_case_with_gloo(rank: int, world: int, gloo_url: str, cases: list[str],
                        run: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """``run(case)`` for every case inside one gloo process group; errors per case."""
    tdist.init_process_group("gloo", init_method=gloo_url, rank=rank, world_size=world,
                             timeout=datetime.timedelta(seconds=60))
    out: dict[str, Any] = {}
    try:
        for case in cases:
            try:
                out[case] = run(case)
            except Exception:  # noqa: BLE001 - reported per case to the test
                out[case] = {"error": traceback.format_exc()}
    finally:
        tdist.destroy_process_group()
    return out


def twins(model_name: str, rank: int, kwargs: dict[str, Any]) -> tuple[DDP, TorchDDP]:
    """One model (scrambled off rank 0) wrapped in tandem's DDP and a copy in torch's."""
    torch.manual_seed(3)
    model = BUILDERS[model_name]()
    _scramble(model, rank)
    theirs = copy.deepcopy(model)
    return DDP(model, **kwargs), TorchDDP(theirs, **kwargs)


def compare(rank: int, world: int, gloo_url: str) -> dict[str, Any]:
    def run(case: str) -> dict[str, Any]:
        model_name, kwargs, mode = CASES[case]
        ours, ref = twins(model_name, rank, kwargs)
        _train(ours, mode, model_name, rank, world)
        _train(ref, mode, model_name, rank, world)
        a = dict(ours.module.state_dict())
        b = dict(ref.module.state_dict())
        return {n: (a[n].double() - b[n].double()).abs().max().item() for n in b}

    return each_case_with_gloo(rank, world, gloo_url, list(CASES), run)


def spawn_with_gloo(fn: Callable[..., Any], request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory, timeout: float) -> list[Any]:
    """``fn(rank, world, gloo_url)`` on ranks joined to tandem (``request.param`` is
    (world size, tandem backend)) and able to join gloo at ``gloo_url``."""
    world, backend = request.param
    path: Path = tmp_path_factory.mktemp("gloo") / "rendezvous"
    return spawn(world, fn, (f"file://{path}",), timeout=timeout, env=_gloo_env(),
                 backend=backend)


@pytest.fixture(scope="module", params=[(2, "tcp"), (3, "tcp"), (2, "shm")],
                ids=lambda p: f"{p[0]}ranks-{p[1]}")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_with_gloo(compare, request, tmp_path_factory, timeout=150)


def _gloo_env() -> dict[str, str]:
    # gloo would otherwise pick the interface of the host name, which may not route
    if any(name == "lo" for _, name in socket.if_nameindex()):
        return {"GLOO_SOCKET_IFNAME": "lo"}
    return {}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torch_ddp_with_gloo(results: list[dict[str, Any]], case: str) -> None:
    for rank, diffs in enumerate(r[case] for r in results):
        assert "error" not in diffs, f"{case} failed on rank {rank}:\n{diffs['error']}"
        name, worst = max(diffs.items(), key=lambda kv: kv[1])
        assert worst <= 1e-5, (f"{case}, rank {rank} of {len(results)}: '{name}' differs "
                               f"from torch DDP by {worst:.3g}")
