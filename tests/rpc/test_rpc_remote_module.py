"""RemoteModule: a module built and run on another worker, used like a local one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tandem.rpc as rpc
from _rpc_workers import attempt, run
from tandem.nn import RemoteModule

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]


def seeded_linear(seed: int, n_in: int, n_out: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


def broken(*args: Any) -> nn.Module:
    raise RuntimeError("no module today")


def training_of(module: rpc.RRef[nn.Module]) -> bool:
    return module.local_value().training


def use_remotely(module: RemoteModule, x: torch.Tensor) -> list[float]:
    return module(x).sum(dim=1).tolist()


def _body(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        x = torch.randn(3, 4)
        local = seeded_linear(7, 4, 2)
        by_name = RemoteModule("worker1/cpu", seeded_linear, args=(7, 4, 2))
        by_rank = RemoteModule("rank:1", seeded_linear, kwargs={"seed": 7, "n_in": 4, "n_out": 2})
        r["forward"] = torch.allclose(by_name(x), local(x))
        r["forward_async"] = torch.allclose(by_rank.forward_async(x).wait(), local(x))
        params = by_name.remote_parameters()
        r["params"] = [p.to_here().shape for p in params] == [p.shape for p in local.parameters()]
        r["params_owner"] = {p.owner_name() for p in params}
        rref = by_name.get_module_rref()
        r["module_rref"] = (rref.owner_name(), type(rref.to_here()).__name__)
        r["train"] = (by_name.eval().training, rpc.rpc_sync("worker1", training_of, args=(rref,)))
        r["parameters"] = attempt(by_name.parameters)
        r["to"] = attempt(by_name.to, "cpu")
        r["broken"] = attempt(RemoteModule, "worker1/cpu", broken)
        r["cuda"] = attempt(RemoteModule, "worker1/cuda:0", seeded_linear, (1, 2, 2))
        r["travels"] = rpc.rpc_sync("worker1", use_remotely, args=(by_name, x))
        r["travels_expected"] = local(x).sum(dim=1).tolist()
        sequential = nn.Sequential(by_name, nn.ReLU())
        r["composes"] = torch.allclose(sequential(x), local(x).relu())
    rpc.shutdown()
    return r


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run(2, _body, tmp_path_factory.mktemp("remote_module"))[0]


@pytest.mark.smoke("tandem.nn")
def test_forward_runs_the_module_on_its_worker(results: dict[str, Any]) -> None:
    assert results["forward"] and results["forward_async"] and results["composes"]


def test_remote_parameters_are_rrefs_owned_by_the_module_worker(results: dict[str, Any]) -> None:
    assert results["params"] and results["params_owner"] == {"worker1"}
    assert results["module_rref"] == ("worker1", "Linear")


def test_train_and_eval_reach_the_remote_module(results: dict[str, Any]) -> None:
    assert results["train"] == (False, False)


def test_local_only_methods_say_what_to_use_instead(results: dict[str, Any]) -> None:
    for case in ("parameters", "to"):
        err = results[case]
        assert err["type"] == "StateError" and "remote_parameters()" in err["msg"], err


def test_construction_errors_and_accelerators_are_reported(results: dict[str, Any]) -> None:
    err = results["broken"]
    assert err["type"] == "RuntimeError" and "no module today" in err["msg"], err
    assert "worker 'worker1'" in err["msg"]
    assert results["cuda"]["type"] == "ArgumentError"


def test_a_remote_module_travels_through_rpc(results: dict[str, Any]) -> None:
    assert results["travels"] == pytest.approx(results["travels_expected"])
