"""Process groups over "tandem": shared connections, lifetimes, refusals.

* Subgroups (``new_group``, DeviceMesh dimensions) run on the default group's
  transport instead of connecting a second mesh; a subgroup that asks for another
  transport (``pg_options``) gets its own.
* Destroying a subgroup leaves the others working; destroying everything closes the
  connections, and the processes can join again.
* A tandem subgroup under another default backend (gloo) gets a transport over its
  own members, and names global ranks.
* What this path cannot serve is refused with a message saying what to use, and the
  group still works afterwards.

Run: ``python -m pytest tests/torch_backend/test_tb_groups.py -q``.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from _tb_util import attempt, checked, init, results_on

pytestmark = [pytest.mark.procs, pytest.mark.timeout(150)]


def _sum_of_ranks(group: Any = None) -> float:
    t = torch.full((4,), float(dist.get_rank()))
    dist.all_reduce(t, group=group)
    return float(t[0])


def _shared_transport(rank: int, world: int) -> Any:
    from tandem.torch_backend import Options

    world_pg = dist.group.WORLD
    pair = dist.new_group([0, 2])
    tcp = dist.new_group([0, 1, 2], pg_options=Options(transport="tcp"))
    out = {"world": _sum_of_ranks(), "tcp": _sum_of_ranks(tcp)}
    for group in [None, tcp] + ([pair] if rank in (0, 2) else []):  # engines, future threads
        dist.all_reduce(torch.ones(1), group=group, async_op=True).get_future().wait()
    if rank in (0, 2):
        out["pair"] = _sum_of_ranks(pair)
        out["pair_shares_world_transport"] = (pair.tandem_group.transport is
                                              world_pg.tandem_group.transport)
    out["tcp_has_own_transport"] = tcp.tandem_group.transport is not world_pg.tandem_group.transport
    dist.destroy_process_group(tcp)
    out["world_after_destroying_a_subgroup"] = _sum_of_ranks()
    return out


def _tandem_threads() -> list[str]:
    """tandem's threads still running, after a grace period to finish."""
    prefixes = ("tandem-read", "tandem-write", "tandem-accept", "tandem-shm", "tandem-engine",
                "tandem-futures")
    deadline = time.monotonic() + 3.0
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _rejoin(rank: int, world: int, store_dir: str) -> Any:
    from tandem.torch_backend import _fabric

    dist.destroy_process_group()
    closed = {"fabrics": len(_fabric._fabrics), "threads": _tandem_threads()}
    init(rank, world, store_dir, store="again")
    return {"closed": closed, "sum_after_rejoin": _sum_of_ranks()}


def _under_gloo(rank: int, world: int, store_dir: str) -> Any:
    dist.destroy_process_group()
    init(rank, world, store_dir, backend="gloo", store="gloo")
    pair = dist.new_group([1, 2], backend="tandem")
    if rank == 0:
        out: dict[str, Any] = {"member": False}
    else:
        out = {"member": True, "sum": _sum_of_ranks(pair), "global_ranks": pair.global_ranks(),
               "backend": dist.get_backend(pair)}
    # nobody leaves before all have joined: a rank that destroys its gloo group while a
    # peer is still in gloo's connectFullMesh fails that peer ("Connection closed by peer")
    dist.barrier()
    return out


def lifetimes(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    init(rank, world, store_dir)
    return checked({"shared": lambda: _shared_transport(rank, world),
                    "rejoin": lambda: _rejoin(rank, world, store_dir),
                    "under_gloo": lambda: _under_gloo(rank, world, store_dir)})


@pytest.fixture(scope="module")
def lives(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return results_on(3, lifetimes, tmp_path_factory, 120)


def _case(results: list[dict[str, Any]], name: str) -> list[Any]:
    for rank, r in enumerate(results):
        assert "error" not in r[name], f"{name} failed on rank {rank}:\n{r[name]['error']}"
    return [r[name] for r in results]


@pytest.mark.smoke("tandem.torch_backend")
def test_subgroups_share_the_default_groups_connections(lives: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(_case(lives, "shared")):
        assert r["world"] == r["tcp"] == r["world_after_destroying_a_subgroup"] == 3.0, r
        assert r["tcp_has_own_transport"], "a subgroup asking for tcp got the shared transport"
        if rank in (0, 2):
            assert r["pair"] == 2.0 and r["pair_shares_world_transport"], r


def test_destroying_everything_closes_connections_and_allows_a_new_job(
        lives: list[dict[str, Any]]) -> None:
    for r in _case(lives, "rejoin"):
        assert r == {"closed": {"fabrics": 0, "threads": []}, "sum_after_rejoin": 3.0}, r


def test_tandem_subgroup_under_a_gloo_default_group(lives: list[dict[str, Any]]) -> None:
    first, *members = _case(lives, "under_gloo")
    assert first == {"member": False}
    for r in members:
        assert r == {"member": True, "sum": 3.0, "global_ranks": [1, 2], "backend": "tandem"}, r


# -- refusals ------------------------------------------------------------------------------

def _refusals(rank: int) -> dict[str, Any]:
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (4,))
    calls: dict[str, Callable[[], Any]] = {
        "accelerator_tensor": lambda: dist.all_reduce(torch.ones(4, device="meta")),
        "sparse_tensor": lambda: dist.all_reduce(sparse),
        "barrier_device_ids": lambda: dist.barrier(device_ids=[0]),
        "per_device_backend": lambda: dist.group.WORLD._get_backend(torch.device("cpu")),
        "foreign_pg_options": lambda: dist.new_group([0, 1], pg_options=object()),
        "root_tensor": lambda: dist.group.WORLD.broadcast([torch.ones(1)], _root_tensor_1()),
    }
    out = {name: attempt(call) for name, call in calls.items()}
    out["still_works"] = _sum_of_ranks()
    return out


def _root_tensor_1() -> Any:
    opts = dist.BroadcastOptions()
    opts.rootTensor = 1
    return opts


def refusals(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    init(rank, world, store_dir)
    return checked({"refusals": lambda: _refusals(rank)})


def mixed_devices(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    init(rank, world, store_dir, backend="cpu:tandem,cuda:nccl")
    return checked({"first_call": lambda: attempt(dist.all_reduce, torch.ones(1)),
                    "barrier": lambda: attempt(dist.barrier,
                                               timeout=datetime.timedelta(seconds=20))})


REFUSED = {
    "accelerator_tensor": "moves CPU tensors",
    "sparse_tensor": "only dense tensors",
    "barrier_device_ids": "drop device_ids",
    "per_device_backend": "use the process group's own methods",
    "foreign_pg_options": "tandem.torch_backend.Options",
    "root_tensor": "must be 0",
}


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return [r["refusals"] for r in results_on(2, refusals, tmp_path_factory, 90)]


@pytest.mark.parametrize("case", list(REFUSED))
def test_unservable_call_is_refused_with_what_to_do(refused: list[dict[str, Any]],
                                                    case: str) -> None:
    for rank, r in enumerate(refused):
        assert "error" not in r, r
        result = r[case]
        assert not result["ok"] and "ValueError" in result["types"], (rank, result)
        assert REFUSED[case] in result["msg"], (rank, result["msg"])
        assert r["still_works"] == 1.0, f"rank {rank}: the group broke after a refusal"


def test_cpu_tandem_cuda_nccl_is_refused_at_the_first_call(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    for rank, r in enumerate(results_on(2, mixed_devices, tmp_path_factory, 90)):
        for name in ("first_call", "barrier"):
            assert not r[name]["ok"] and "cuda:nccl never existed" in r[name]["msg"], (rank, r)
