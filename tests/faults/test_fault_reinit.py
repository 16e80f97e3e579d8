"""``destroy_process_group`` then ``init_process_group`` again in the same processes.

Each init on a store gets the next generation's namespace (``tandem/<generation>/...``),
so a re-init never reads the addresses of the previous incarnation. Under ``env://`` and
``tcp://`` each incarnation has its own store server on the same port: a rank that
re-inits first waits for the next server instead of joining the closing one, and rank 0
keeps its server until the others have left it (notebooks and test suites loop so).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, values
from tandem.collectives.world import world
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]


def _all_reduce_once(rank: int, offset: float) -> dict[str, Any]:
    t = torch.full((4,), float(rank + 1) + offset)
    dist.all_reduce(t)
    sub = dist.new_group([0, 1])
    u = torch.full((2,), float(rank))
    dist.all_reduce(u, group=sub)
    return {"sum": t.tolist(), "sub": u.tolist(), "generation": world().generation}


def _reinit(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, name in enumerate(["a", "b"]):  # a fresh rendezvous file each time
        dist.init_process_group("tcp", init_method=f"file://{tmp}/{name}", rank=rank,
                                world_size=world_size, timeout=20)
        out[name] = _all_reduce_once(rank, 10.0 * i)
        dist.destroy_process_group()
        out[f"{name}_after"] = attempt(dist.all_reduce, torch.ones(1))
    for i in range(2):  # the same rendezvous file, a new FileStore each time: generations
        store = dist.FileStore(f"{tmp}/shared", -1)
        dist.init_process_group("tcp", store=store, rank=rank, world_size=world_size, timeout=20)
        out[f"shared{i}"] = _all_reduce_once(rank, 100.0 * i)
        dist.barrier()
        dist.destroy_process_group()
    # the same Store object twice, as torch allows; last, since it may fail
    mine = dist.FileStore(f"{tmp}/same", -1)
    for i in range(2):
        r = attempt(dist.init_process_group, "tcp", store=mine, rank=rank,
                    world_size=world_size, timeout=20)
        out[f"same{i}"] = r
        if not r["ok"]:
            break
        out[f"same{i}_sum"] = _all_reduce_once(rank, 0.0)["sum"]
        dist.barrier()
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def reinit(tmp_path_factory: Any) -> dict[int, Any]:
    tmp = str(tmp_path_factory.mktemp("reinit"))
    outcomes = launch(2, _reinit, (tmp,), init=False, timeout=60,
                      env={"TANDEM_CONNECT_TIMEOUT": "5"})
    return values(outcomes, [0, 1])


def test_reinit_with_a_fresh_store_path_works(reinit: Any) -> None:
    for rank in (0, 1):
        assert reinit[rank]["a"]["sum"] == [3.0] * 4, reinit[rank]
        assert reinit[rank]["b"]["sum"] == [23.0] * 4, reinit[rank]
        assert reinit[rank]["a"]["sub"] == reinit[rank]["b"]["sub"] == [1.0, 1.0]


def test_collectives_between_destroy_and_init_raise_state_error(reinit: Any) -> None:
    for rank in (0, 1):
        for name in ("a_after", "b_after"):
            r = reinit[rank][name]
            assert not r["ok"] and r["type"] == "StateError", (rank, r)
            assert "init_process_group" in r["msg"], (rank, r)


def test_reinit_on_the_same_rendezvous_file_uses_the_next_generation(reinit: Any) -> None:
    for rank in (0, 1):
        first, second = reinit[rank]["shared0"], reinit[rank]["shared1"]
        assert (first["generation"], second["generation"]) == (0, 1), (rank, reinit[rank])
        assert first["sum"] == [3.0] * 4 and second["sum"] == [203.0] * 4, reinit[rank]


def test_reinit_with_the_same_store_object_works(reinit: Any) -> None:
    for rank in (0, 1):
        assert reinit[rank]["same0"]["ok"], reinit[rank]["same0"]
        assert reinit[rank]["same1"]["ok"], reinit[rank]["same1"]
        assert reinit[rank]["same1_sum"] == [3.0] * 4


# -- the whole cycle, many times, on a TCP store re-hosted on the same port --------------
# Above, each incarnation rendezvouses through a file; under env:// and tcp:// rank 0
# hosts the store, so every destroy closes a server and the next init starts one on the
# same port, while the other rank may already be knocking.

CYCLES = 20
BACKENDS = (None, "shm", "tcp")  # None: auto


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cycle(rank: int, world_size: int, scheme: str, port: int) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    sums: list[float] = []
    for i in range(CYCLES):
        backend = BACKENDS[i % len(BACKENDS)]
        if scheme == "env":
            r = attempt(dist.init_process_group, backend, init_method="env://", timeout=30)
        else:
            r = attempt(dist.init_process_group, backend, init_method=f"tcp://127.0.0.1:{port}",
                        rank=rank, world_size=world_size, timeout=30)
        if not r["ok"]:
            return {"cycles": i, "error": r, "sums": sums}
        t = torch.full((2,), float(rank + i))
        dist.all_reduce(t)
        sums.append(t[0].item())
        dist.destroy_process_group()
    return {"cycles": CYCLES, "error": None, "sums": sums}


@pytest.mark.parametrize("scheme", ["env", "tcp"])
def test_init_all_reduce_destroy_twenty_times_on_one_address(scheme: str) -> None:
    outcomes = launch(2, _cycle, (scheme, _free_port()), init=False, timeout=85,
                      env={"TANDEM_CONNECT_TIMEOUT": "20"})
    done = values(outcomes, [0, 1])
    for rank in (0, 1):
        assert done[rank]["error"] is None, (rank, done[rank]["cycles"], done[rank]["error"])
        assert done[rank]["sums"] == [float(1 + 2 * i) for i in range(CYCLES)], done[rank]
