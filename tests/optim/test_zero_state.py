"""ZeroRedundancyOptimizer's state dicts and parameter groups, against the plain optimizer.

A consolidated state dict is the plain optimizer's: same state per parameter index,
same ``param_groups``; it loads into ``torch.optim.Adam`` and training continues
identically, and a plain optimizer's state dict loads into a ZeroRedundancyOptimizer
(each rank keeping its shard). ``add_param_group`` and several groups with their own
learning rates train like the plain optimizer. Misuse raises on the spot.

Run: ``python -m pytest tests/optim/test_zero_state.py -q``.
"""

from __future__ import annotations

import copy
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.errors import ArgumentError, StateError
from tandem.optim import ZeroRedundancyOptimizer
from tandem.parallel.ddp import DistributedDataParallel as DDP
from tandem.testing import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from test_ddp_training import LOCAL_BATCH, _inputs, mlp  # noqa: E402

pytestmark = pytest.mark.procs


def _steps(ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, first: int,
           count: int) -> None:
    lo = rank * LOCAL_BATCH
    for step in range(first, first + count):
        x, y = _inputs("mlp", LOCAL_BATCH * world, step)
        opt.zero_grad()
        F.mse_loss(ddp(x[lo:lo + LOCAL_BATCH]), y[lo:lo + LOCAL_BATCH]).backward()
        opt.step()


def _pair() -> tuple[DDP, DDP]:
    torch.manual_seed(2)
    model = mlp()
    return DDP(model), DDP(copy.deepcopy(model))


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.double() - y.double()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


def _state_diff(ours: dict[str, Any], theirs: dict[str, Any]) -> float:
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"])
    return max((ours["state"][i][k].double() - v.double()).abs().max().item()
               for i, s in theirs["state"].items() for k, v in s.items())


def consolidated_loads_into_plain(rank: int, world: int) -> dict[str, Any]:
    ours, ref = _pair()
    zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    _steps(ours, zero, rank, world, 0, 3)
    _steps(ref, plain, rank, world, 0, 3)
    to = world - 1
    zero.consolidate_state_dict(to=to)
    out: dict[str, Any] = {}
    if rank == to:
        sd = zero.state_dict()
        out["state_diff"] = _state_diff(sd, plain.state_dict())
        restored = torch.optim.Adam(ours.parameters(), lr=0.5)  # lr comes from the dict
        restored.load_state_dict(sd)
        out["lr"] = restored.param_groups[0]["lr"]
    else:
        try:
            zero.state_dict()
        except StateError as exc:
            out["error"] = str(exc)
    _steps(ours, zero, rank, world, 3, 1)
    if rank == to:
        try:
            zero.state_dict()
        except StateError as exc:
            out["stale"] = str(exc)
    return out


def plain_loads_into_zero(rank: int, world: int) -> dict[str, Any]:
    ours, ref = _pair()
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    _steps(ref, plain, rank, world, 0, 3)
    with torch.no_grad():
        for a, b in zip(ours.parameters(), ref.parameters()):
            a.copy_(b)
    saved = copy.deepcopy(plain.state_dict())  # as from a file: loading shares the tensors
    before = copy.deepcopy(saved)
    zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam, lr=0.3)
    zero.load_state_dict(saved)
    untouched = all(torch.equal(saved["state"][i][k], before["state"][i][k])
                    for i in before["state"] for k in before["state"][i]) and \
        saved["param_groups"] == before["param_groups"]
    _steps(ours, zero, rank, world, 3, 3)
    _steps(ref, plain, rank, world, 3, 3)
    return {"diff": _max_diff(ours.module, ref.module), "untouched": untouched,
            "lr": zero.param_groups[0]["lr"]}


def groups_like_plain(rank: int, world: int) -> dict[str, Any]:
    ours, ref = _pair()

    def groups(m: nn.Module) -> list[dict[str, Any]]:
        ps = list(m.parameters())
        return [{"params": ps[:2], "lr": 0.02}, {"params": ps[2:4]}]

    zero = ZeroRedundancyOptimizer(groups(ours), torch.optim.SGD, lr=0.05, momentum=0.9)
    plain = torch.optim.SGD(groups(ref), lr=0.05, momentum=0.9)
    _steps(ours, zero, rank, world, 0, 2)
    _steps(ref, plain, rank, world, 0, 2)
    for m, opt in ((ours, zero), (ref, plain)):
        opt.add_param_group({"params": list(m.parameters())[4:], "lr": 0.1})
    _steps(ours, zero, rank, world, 2, 4)
    _steps(ref, plain, rank, world, 2, 4)
    zero.consolidate_state_dict(to=0)
    state = _state_diff(zero.state_dict(), plain.state_dict()) if rank == 0 else 0.0
    owned = [sum(p.numel() for p in grp["params"]) for grp in zero.optim.param_groups]
    return {"diff": _max_diff(ours.module, ref.module), "state_diff": state, "owned": owned}


def misuse(rank: int, world: int) -> list[str]:
    ours, _ = _pair()
    attempts: list[Callable[[], Any]] = [
        lambda: ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam(
            ours.parameters())),  # an instance, not the class
        lambda: ZeroRedundancyOptimizer(next(ours.parameters()), torch.optim.Adam),
        lambda: ZeroRedundancyOptimizer(list(ours.parameters())[:2 + rank], torch.optim.Adam),
        lambda: ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam).consolidate_state_dict(
            to=world),
    ]
    out = []
    for attempt in attempts:
        try:
            attempt()
            out.append("no error")
        except ArgumentError as exc:
            out.append(str(exc))
    return out


class OddParams(nn.Module):
    """Parameters the exchange must handle: not contiguous, float64, 0-dim, one large
    enough to travel in place, and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(5, 3).t())
        self.b = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.c = nn.Parameter(torch.tensor(0.5))
        self.d = nn.Parameter(torch.randn(200, 100))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (((x @ self.a) ** 2).sum() * self.c + (self.b * x[0]).sum().float() ** 2
                + (self.d ** 2).mean() + self.frozen.sum())


def odd_params(rank: int, world: int) -> dict[str, float]:
    out = {}
    for view in (False, True):
        torch.manual_seed(6)
        ours = OddParams()
        ref = copy.deepcopy(ours)
        zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, lr=0.01,
                                       momentum=0.9, parameters_as_bucket_view=view)
        plain = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
        for step in range(3):  # the same batch everywhere: no gradient averaging needed
            x = torch.randn(7, 3, generator=torch.Generator().manual_seed(step))
            for m, opt in ((ours, zero), (ref, plain)):
                opt.zero_grad()
                m.loss(x).backward()
                opt.step()
        out[f"bucket_view={view}"] = _max_diff(ours, ref)
    return out


CASES = {"consolidated": consolidated_loads_into_plain, "plain": plain_loads_into_zero,
         "groups": groups_like_plain, "misuse": misuse, "odd": odd_params}


def run_all(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in CASES.items():
        try:
            out[name] = fn(rank, world)
        except Exception:  # noqa: BLE001 - reported per case to the test
            out[name] = {"crash": traceback.format_exc()}
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return spawn(request.param, run_all, timeout=150)


def _ok(results: list[dict[str, Any]], case: str) -> list[Any]:
    for rank, r in enumerate(results):
        assert "crash" not in r[case], f"{case} failed on rank {rank}:\n{r[case]['crash']}"
    return [r[case] for r in results]


def test_consolidated_state_dict_is_the_plain_optimizers_and_loads_into_it(
        results: list[dict[str, Any]]) -> None:
    *others, last = _ok(results, "consolidated")
    assert last["state_diff"] <= 1e-6, last
    assert last["lr"] == 0.01
    assert "stale" in last and "consolidate_state_dict" in last["stale"], last
    for r in others:
        assert "consolidate_state_dict(to=" in r["error"], r


def test_plain_state_dict_loads_into_zero_and_training_continues_identically(
        results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(_ok(results, "plain")):
        assert r["diff"] <= 1e-6, (rank, r)
        assert r["untouched"], f"rank {rank}: load_state_dict changed the caller's dict"
        assert r["lr"] == 0.01


def test_parameter_groups_and_add_param_group_train_like_the_plain_optimizer(
        results: list[dict[str, Any]]) -> None:
    rs = _ok(results, "groups")
    for rank, r in enumerate(rs):
        assert r["diff"] <= 1e-6, (rank, r)
    assert rs[0]["state_diff"] <= 1e-6
    # the partition, added group included, balances the ranks within one parameter
    totals = [sum(r["owned"]) for r in rs]
    assert sum(totals) == sum(p.numel() for p in mlp().parameters())
    assert max(totals) - min(totals) <= 32 * 32, totals


@pytest.mark.smoke("tandem.optim")
def test_misuse_is_refused_with_a_message(results: list[dict[str, Any]]) -> None:
    for rank, errors in enumerate(_ok(results, "misuse")):
        assert "optimizer_class" in errors[0], (rank, errors)
        assert "not one tensor" in errors[1], (rank, errors)
        assert "differs across ranks" in errors[2], (rank, errors)
        assert "to=" in errors[3], (rank, errors)


def test_odd_parameters_travel_intact(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(_ok(results, "odd")):
        for layout, diff in r.items():
            assert diff <= 1e-6, f"rank {rank}, {layout}: {diff}"
