"""Post-local SGD and model averaging train to torch's weights (gloo), on 4 ranks.

Each rank joins tandem and torch.distributed (gloo) and trains one model twice from
the same seeds and data: with tandem's ``PostLocalSGDOptimizer``, averagers and
``post_localSGD_hook``, and with torch's. The ranks see different data, so every
averaging step (and every step that skips one) shows in the weights; each case ends
on a step without global averaging, so the ranks' weights differ at the end.

Run: ``python -m pytest tests/algorithms/test_post_local_sgd.py -q``.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_hook
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import (
    hierarchical_model_averager as torch_hierarchical,
)
from torch.nn import functional as F

import tandem
from tandem.algorithms.ddp_comm_hooks import post_localSGD_hook as our_hook
from tandem.algorithms.model_averaging import averagers, hierarchical_model_averager
from tandem.optim import PostLocalSGDOptimizer

with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from test_ddp_torch_parity import each_case_with_gloo, spawn_with_gloo, twins  # noqa: E402
from test_ddp_training import BUILDERS, LOCAL_BATCH, _inputs, _scramble  # noqa: E402

pytestmark = pytest.mark.procs  # every test here starts processes

WARMUP = 2  # global gradient averaging for 2 steps, then averaging every PERIOD steps
PERIOD = 2


def _local_step(model: nn.Module, rank: int, world: int, step: int) -> None:
    x, y = _inputs("mlp", LOCAL_BATCH * world, step)
    lo = rank * LOCAL_BATCH
    F.mse_loss(model(x[lo:lo + LOCAL_BATCH]), y[lo:lo + LOCAL_BATCH]).backward()


def _train(ddp: nn.Module, opt: Any, rank: int, world: int, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        _local_step(ddp, rank, world, step)
        opt.step()


def _diff(ours: nn.Module, ref: nn.Module) -> dict[str, float]:
    a, b = ours.state_dict(), ref.state_dict()
    return {n: (a[n].double() - b[n].double()).abs().max().item() for n in b}


def _post_local(rank: int, world: int, gradient_allreduce: bool) -> dict[str, Any]:
    """DDP + post_localSGD_hook (subgroups of 2) + PostLocalSGDOptimizer(SGD, Periodic)."""
    ours, ref = twins("mlp", rank, {})
    our_sub, _ = tandem.new_subgroups(group_size=2)
    ref_sub, _ = tdist.new_subgroups(group_size=2)
    ours.register_comm_hook(our_hook.PostLocalSGDState(
        process_group=None, subgroup=our_sub, start_localSGD_iter=WARMUP,
        post_local_gradient_allreduce=gradient_allreduce), our_hook.post_localSGD_hook)
    ref.register_comm_hook(torch_hook.PostLocalSGDState(
        process_group=None, subgroup=ref_sub, start_localSGD_iter=WARMUP,
        post_local_gradient_allreduce=gradient_allreduce), torch_hook.post_localSGD_hook)
    opt = PostLocalSGDOptimizer(
        optim=torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
        averager=averagers.PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP))
    ref_opt = TorchPostLocalSGDOptimizer(
        optim=torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9),
        averager=torch_averagers.PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP))
    _train(ours, opt, rank, world, range(6))  # averages after steps 2 and 4, not 5
    _train(ref, ref_opt, rank, world, range(6))
    return {"torch": _diff(ours.module, ref.module), "step": opt.averager.step,
            "params": [p.detach().clone() for p in ours.parameters()]}


def _round_trip(rank: int, world: int) -> dict[str, Any]:
    """Three steps, then each side's state dict loaded into a new optimizer of the other
    (torch's format both ways), three more steps."""
    ours, ref = twins("mlp", rank, {})

    def make(model: nn.Module, theirs: bool) -> Any:
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if theirs:
            return TorchPostLocalSGDOptimizer(sgd, torch_averagers.PeriodicModelAverager(
                period=PERIOD, warmup_steps=WARMUP))
        return PostLocalSGDOptimizer(sgd, averagers.PeriodicModelAverager(
            period=PERIOD, warmup_steps=WARMUP))

    opt, ref_opt = make(ours, False), make(ref, True)
    _train(ours, opt, rank, world, range(3))
    _train(ref, ref_opt, rank, world, range(3))
    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    same_format = (set(saved) == set(ref_saved) and saved["step"] == ref_saved["step"] == 3
                   and saved["param_groups"] == ref_saved["param_groups"])
    state_diff = max((saved["state"][i]["momentum_buffer"]
                      - ref_saved["state"][i]["momentum_buffer"]).abs().max().item()
                     for i in ref_saved["state"])
    opt, ref_opt = make(ours, False), make(ref, True)
    opt.load_state_dict(copy.deepcopy(ref_saved))
    ref_opt.load_state_dict(copy.deepcopy(saved))
    resumed_step = opt.averager.step
    _train(ours, opt, rank, world, range(3, 6))  # averages after step 4 (the averager's 4th)
    _train(ref, ref_opt, rank, world, range(3, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        without_step = {k: v for k, v in saved.items() if k != "step"}
        make(ours, False).load_state_dict(without_step)
    return {"torch": _diff(ours.module, ref.module), "same_format": same_format,
            "state_diff": state_diff, "resumed_step": resumed_step,
            "warned": [str(w.message) for w in caught]}


def _hierarchical(rank: int, world: int) -> dict[str, Any]:
    """Local SGD without DDP; pairs average every 2 steps, all 4 ranks every 4."""
    torch.manual_seed(3)
    ours = BUILDERS["mlp"]()
    _scramble(ours, rank)  # the ranks start apart: only averaging brings them together
    ref = copy.deepcopy(ours)
    levels = OrderedDict([(2, 2), (4, 4)])
    averager = hierarchical_model_averager.HierarchicalModelAverager(
        period_group_size_dict=levels, warmup_steps=1, process_group=None)
    ref_averager = torch_hierarchical.HierarchicalModelAverager(
        period_group_size_dict=levels, warmup_steps=1, process_group=None)
    for model, avg in ((ours, averager), (ref, ref_averager)):
        for step in range(7):  # pairs after steps 2 and 6, everyone after step 4
            model.zero_grad()
            _local_step(model, rank, world, step)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad  # type: ignore[operator]
            avg.average_parameters(model.parameters())
    return {"torch": _diff(ours, ref), "params": [p.detach().clone() for p in ours.parameters()]}


CASES = {
    "post_local_sgd": lambda rank, world: _post_local(rank, world, True),
    "post_local_sgd_no_local_allreduce": lambda rank, world: _post_local(rank, world, False),
    "state_dict_round_trip": _round_trip,
    "hierarchical": _hierarchical,
}


def compare(rank: int, world: int, gloo_url: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return each_case_with_gloo(rank, world, gloo_url, list(CASES),
                               lambda case: CASES[case](rank, world))


@pytest.fixture(scope="module", params=[(4, "tcp")], ids=lambda p: f"{p[0]}ranks-{p[1]}")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_with_gloo(compare, request, tmp_path_factory, timeout=240)


def _case(results: list[dict[str, Any]], case: str) -> list[dict[str, Any]]:
    out = [r[case] for r in results]
    for rank, r in enumerate(out):
        assert "error" not in r, f"{case} failed on rank {rank}:\n{r['error']}"
    return out


def _assert_like_torch(results: list[dict[str, Any]], case: str) -> None:
    for rank, r in enumerate(_case(results, case)):
        name, worst = max(r["torch"].items(), key=lambda kv: kv[1])
        assert worst <= 1e-6, (f"{case}, rank {rank}: '{name}' differs from torch's by "
                               f"{worst:.3g}")


def _apart(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["post_local_sgd", "post_local_sgd_no_local_allreduce"])
def test_ddp_with_post_local_sgd_trains_like_torch(results: list[dict[str, Any]],
                                                   case: str) -> None:
    _assert_like_torch(results, case)
    r = _case(results, case)
    assert [x["step"] for x in r] == [6] * 4
    pairs_kept = case == "post_local_sgd"  # the last step's gradients averaged in pairs
    assert (_apart(r[0]["params"], r[1]["params"]) == 0.0) == pairs_kept
    assert _apart(r[0]["params"], r[2]["params"]) > 1e-4  # no global average after step 5


@pytest.mark.timeout(300)
def test_state_dict_is_torchs_format_and_resumes_the_averaging_schedule(
        results: list[dict[str, Any]]) -> None:
    _assert_like_torch(results, "state_dict_round_trip")
    for rank, r in enumerate(_case(results, "state_dict_round_trip")):
        assert r["same_format"], f"rank {rank}: state_dict keys or 'step' differ from torch's"
        assert r["state_diff"] <= 1e-6, f"rank {rank}: momentum differs by {r['state_diff']}"
        assert r["resumed_step"] == 3, f"rank {rank}: the averager resumed at {r['resumed_step']}"
        assert any("'step'" in w for w in r["warned"]), r["warned"]


@pytest.mark.timeout(300)
def test_hierarchical_averager_averages_subgroups_like_torch(
        results: list[dict[str, Any]]) -> None:
    _assert_like_torch(results, "hierarchical")
    r = _case(results, "hierarchical")
    # the last averaging (after step 6) was within pairs {0, 1} and {2, 3}
    assert _apart(r[0]["params"], r[1]["params"]) == 0.0
    assert _apart(r[2]["params"], r[3]["params"]) == 0.0
    assert _apart(r[0]["params"], r[2]["params"]) > 1e-4
