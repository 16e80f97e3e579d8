"""DDP + ZeroRedundancyOptimizer under ``Join`` with uneven inputs, against torch.

The ranks hold 9/5 (2 ranks) or 5/9/6 (3 ranks) batches. tandem trains DDP +
ZeroRedundancyOptimizer(SGD with momentum, or Adam) under ``Join([ddp, zero])``:
a joined rank shadows DDP's reductions, steps its own shard with the gradients of the
ranks still training, and sends its parameters like them. torch trains DDP + the
plain optimizer under torch's Join on the same data (gloo): its last rank to join
updates every parameter itself. Both must end with the same parameters, on every rank,
in every mode of the optimizer (plain step, overlap, sharded gradients, both).

Run: ``python -m pytest tests/optim/test_zero_join.py -q``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.algorithms.join import Join as TorchJoin
from torch.nn import functional as F

from tandem.algorithms.join import Join

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from test_ddp_join import BATCHES, compare_states  # noqa: E402
from test_ddp_torch_parity import each_case_with_gloo, spawn_with_gloo, twins  # noqa: E402
from test_ddp_training import LOCAL_BATCH, _inputs  # noqa: E402

from test_zero_training import MODES, OPTIMIZERS, zero_for  # noqa: E402

pytestmark = pytest.mark.procs

CASES = {f"{o}-{m}": (o, spec) for o in ("sgd", "adam") for m, spec in MODES.items()}
CASES["sgd-sharded-divide_by_active"] = ("sgd", {"shard": True, "divide": False})


def _train(ddp: Any, opt: Any, join: Any, rank: int, world: int, steps_itself: bool) -> None:
    lo = rank * LOCAL_BATCH
    with join:
        for step in range(BATCHES[world][rank]):
            x, y = _inputs("mlp", LOCAL_BATCH * world, step)
            opt.zero_grad()
            F.mse_loss(ddp(x[lo:lo + LOCAL_BATCH]), y[lo:lo + LOCAL_BATCH]).backward()
            if steps_itself:
                opt.step()


def compare(rank: int, world: int, gloo_url: str) -> dict[str, Any]:
    def run(case: str) -> dict[str, Any]:
        opt_name, spec = CASES[case]
        ours, ref = twins("mlp", rank, {"bucket_cap_mb": 0.002})
        zero = zero_for(ours, opt_name, spec)
        cls, kwargs = OPTIMIZERS[opt_name]
        divide = spec.get("divide", True)
        _train(ours, zero, Join([ours, zero], divide_by_initial_world_size=divide), rank, world,
               steps_itself=not spec.get("overlap"))
        _train(ref, cls(ref.parameters(), **kwargs),
               TorchJoin([ref], divide_by_initial_world_size=divide), rank, world, True)
        return compare_states(ours.module, ref.module)

    return each_case_with_gloo(rank, world, gloo_url, list(CASES), run)


@pytest.fixture(scope="module", params=[(2, "shm"), (3, "tcp")],
                ids=lambda p: f"{p[0]}ranks-{p[1]}")
def results(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn_with_gloo(compare, request, tmp_path_factory, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CASES))
def test_zero_under_join_ends_like_torch_ddp_with_the_plain_optimizer(
        results: list[dict[str, Any]], case: str) -> None:
    for rank, r in enumerate(x[case] for x in results):
        assert "error" not in r, f"{case} failed on rank {rank}:\n{r['error']}"
        assert r["ranks"] == 0.0, f"{case}: rank {rank}'s parameters differ from rank 0's"
        name, worst = max(r["torch"].items(), key=lambda kv: kv[1])
        assert worst <= 1e-6, (f"{case}, rank {rank} of {len(results)}: '{name}' differs from "
                               f"torch DDP + {case.split('-')[0]} under torch's Join by "
                               f"{worst:.3g}")
