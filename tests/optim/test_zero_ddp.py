"""ZeroRedundancyOptimizer attached to DDP: sharded gradients keep DDP's meaning, misuse fails.

* Gradient accumulation (``no_sync``, and no ``zero_grad`` between steps, with
  ``set_to_none`` either way) with sharded gradients trains like plain DDP + SGD.
* ``zero.clip_grad_norm_`` with sharded gradients gives the norm and the update of
  ``torch.nn.utils.clip_grad_norm_`` on plain DDP.
* ``hook_with_zero_step`` around another hook (``fp16_compress_hook``) reduces with it.
* Attaching wrongly raises at once, naming the problem.

Run: ``python -m pytest tests/optim/test_zero_ddp.py -q``.
"""

from __future__ import annotations

import copy
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.nn import functional as F

from tandem.errors import ArgumentError, StateError
from tandem.optim import ZeroRedundancyOptimizer, hook_with_zero_step, shard_gradients
from tandem.parallel.comm_hooks import allreduce_hook, fp16_compress_hook
from tandem.parallel.ddp import DistributedDataParallel as DDP
from tandem.testing import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from test_ddp_training import LOCAL_BATCH, _inputs, mlp  # noqa: E402

pytestmark = pytest.mark.procs


def _pair(**ddp_kw: Any) -> tuple[DDP, DDP]:
    torch.manual_seed(4)
    model = mlp()
    return DDP(model, **ddp_kw), DDP(copy.deepcopy(model), **ddp_kw)


def _batch(rank: int, world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _inputs("mlp", LOCAL_BATCH * world, step)
    lo = rank * LOCAL_BATCH
    return x[lo:lo + LOCAL_BATCH], y[lo:lo + LOCAL_BATCH]


def _diff(a: DDP, b: DDP) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def accumulation(rank: int, world: int, set_to_none: bool) -> float:
    ours, ref = _pair(bucket_cap_mb=0.002)
    zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    shard_gradients(ours, zero)
    plain = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(8):
        for ddp, opt in ((ours, zero), (ref, plain)):
            if step % 3 == 0:  # otherwise the last step's gradients stay and accumulate
                opt.zero_grad(set_to_none=set_to_none)
            x, y = _batch(rank, world, step)
            with ddp.no_sync():  # type: ignore[operator]
                F.mse_loss(ddp(x * 2), y).backward()
            F.mse_loss(ddp(x), y).backward()
            opt.step()
    return _diff(ours, ref)


def clipping(rank: int, world: int) -> dict[str, float]:
    ours, ref = _pair()
    zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.Adam, lr=0.01)
    shard_gradients(ours, zero)
    plain = torch.optim.Adam(ref.parameters(), lr=0.01)
    norms = []
    for step in range(4):
        x, y = _batch(rank, world, step)
        for ddp, opt in ((ours, zero), (ref, plain)):
            opt.zero_grad()
            F.mse_loss(ddp(x) * 50, y).backward()
            clip = zero.clip_grad_norm_ if opt is zero else (
                lambda m: torch.nn.utils.clip_grad_norm_(ref.parameters(), m))
            norms.append(float(clip(0.5)))
            opt.step()
    return {"norm": max(abs(a - b) / b for a, b in zip(norms[::2], norms[1::2])),
            "params": _diff(ours, ref)}


def fp16_overlap(rank: int, world: int) -> dict[str, Any]:
    ours, ref = _pair(bucket_cap_mb=0.002)
    zero = ZeroRedundancyOptimizer(ours.parameters(), torch.optim.SGD, overlap_with_ddp=True,
                                   lr=0.05)
    ours.register_comm_hook(None, hook_with_zero_step(fp16_compress_hook, ours, zero))
    plain = torch.optim.SGD(ref.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            x, y = _batch(rank, world, step)
            for ddp, opt in ((ours, zero), (ref, plain)):
                opt.zero_grad()
                F.mse_loss(ddp(x), y).backward()
                opt.step()  # a no-op with a warning for the overlapped one, as in torch
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    return {"diff": _diff(ours, ref), "flat": flat,
            "warned": any("does nothing" in str(w.message) for w in caught)}


def misuse(rank: int, world: int) -> list[str]:
    def after_backward() -> None:
        ddp, _ = _pair()
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
        F.mse_loss(ddp(_batch(rank, world, 0)[0]), _batch(rank, world, 0)[1]).backward()
        shard_gradients(ddp, zero)

    def hook_after_sharding() -> None:
        ddp, _ = _pair()
        shard_gradients(ddp, ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1))
        ddp.register_comm_hook(None, fp16_compress_hook)

    def subset() -> None:
        ddp, _ = _pair()
        shard_gradients(ddp, ZeroRedundancyOptimizer(list(ddp.parameters())[:2],
                                                     torch.optim.SGD, lr=0.1))

    def no_overlap() -> None:
        ddp, _ = _pair()
        hook_with_zero_step(allreduce_hook, ddp,
                            ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1))

    def extra_params() -> None:
        ddp, other = _pair()
        params = list(ddp.parameters()) + list(other.parameters())[:1]
        zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))

    def clip_with_overlap() -> None:
        ddp, _ = _pair()
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, overlap_with_ddp=True,
                                       lr=0.1)
        zero.clip_grad_norm_(1.0)

    out = []
    cases: list[Callable[[], None]] = [after_backward, hook_after_sharding, subset, no_overlap,
                                       extra_params, clip_with_overlap]
    for case in cases:
        try:
            case()
            out.append("no error")
        except (ArgumentError, StateError) as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def run_all(rank: int, world: int) -> dict[str, Any]:
    cases: dict[str, Callable[[], Any]] = {
        "accumulate_none": lambda: accumulation(rank, world, True),
        "accumulate_zeroed": lambda: accumulation(rank, world, False),
        "clipping": lambda: clipping(rank, world),
        "fp16_overlap": lambda: fp16_overlap(rank, world),
        "misuse": lambda: misuse(rank, world),
    }
    out: dict[str, Any] = {}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - reported per case to the test
            out[name] = {"crash": traceback.format_exc()}
    return out


@pytest.fixture(scope="module", params=[(2, "shm"), (3, "tcp")],
                ids=lambda p: f"{p[0]}ranks-{p[1]}")
def results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    world, backend = request.param
    return spawn(world, run_all, timeout=150, backend=backend)


def _ok(results: list[dict[str, Any]], case: str) -> list[Any]:
    for rank, r in enumerate(results):
        assert not (isinstance(r[case], dict) and "crash" in r[case]), \
            f"{case} failed on rank {rank}:\n{r[case]['crash']}"
    return [r[case] for r in results]


@pytest.mark.parametrize("case", ["accumulate_none", "accumulate_zeroed"])
def test_accumulating_sharded_gradients_trains_like_plain_ddp(results: list[dict[str, Any]],
                                                               case: str) -> None:
    for rank, diff in enumerate(_ok(results, case)):
        assert diff <= 1e-6, f"{case}, rank {rank}: parameters differ from plain DDP by {diff}"


def test_clip_grad_norm_with_sharded_gradients_matches_torch(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(_ok(results, "clipping")):
        assert r["norm"] <= 1e-5 and r["params"] <= 1e-6, (rank, r)


def test_overlap_reduces_with_the_hook_it_wraps(results: list[dict[str, Any]]) -> None:
    rs = _ok(results, "fp16_overlap")
    for rank, r in enumerate(rs):
        assert torch.equal(r["flat"], rs[0]["flat"]), f"rank {rank} differs from rank 0"
        assert 0 < r["diff"] < 1e-2, (rank, r["diff"])  # float16 rounding, nothing more
        assert r["warned"], "step() with overlap_with_ddp=True did not warn"


def test_attaching_wrongly_is_refused_with_a_message(results: list[dict[str, Any]]) -> None:
    for rank, errors in enumerate(_ok(results, "misuse")):
        assert errors[0].startswith("StateError") and "before the first backward" in errors[0]
        assert errors[1].startswith("ArgumentError") and "sharded" in errors[1], errors[1]
        assert "does not hold" in errors[2], errors[2]
        assert "overlap_with_ddp=True" in errors[3], errors[3]
        assert "does not train" in errors[4], errors[4]
        assert errors[5].startswith("StateError") and "inside backward" in errors[5], errors[5]
