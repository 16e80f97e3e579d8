"""Differentiable collectives (``tandem.nn.functional``) against one process.

Each rank r holds a leaf ``x_r`` and computes ``loss_r`` from the collective's outputs
with its own weights. The oracle runs the whole job in one process with plain torch ops
(an all_reduce is a sum of the x's, and so on) and differentiates the sum of every
rank's loss: rank r's gradient must equal the oracle's gradient of ``x_r``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import tandem
import tandem.nn.functional as F
from tandem.errors import ArgumentError
from tandem.testing import spawn

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]
WORLD = 3
SHAPE = (2, 3)


def _x(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(SHAPE, generator=g, dtype=torch.float64)


def _w(rank: int, k: int, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 10 * rank + k)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _weigh(rank: int, outs: Any) -> torch.Tensor:
    """rank's loss: a weighted sum of its outputs (a tensor, or a tuple of them)."""
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    return sum(((o * _w(rank, k, o.shape)).sum() for k, o in enumerate(outs)),
               torch.zeros((), dtype=torch.float64))


# per case: what rank r's outputs are, given every rank's x (the oracle), and the call
ORACLES: dict[str, Callable[[int, list[torch.Tensor]], Any]] = {
    "all_reduce_sum": lambda r, xs: sum(xs),
    "all_reduce_avg": lambda r, xs: sum(xs) / WORLD,
    "broadcast": lambda r, xs: xs[1],
    "reduce": lambda r, xs: sum(xs) if r == 2 else None,  # other ranks' output: undefined
    "all_gather": lambda r, xs: tuple(xs),
    "gather": lambda r, xs: tuple(xs) if r == 0 else None,
    "scatter": lambda r, xs: xs[2] * (r + 1),  # rank 2 sends part i = its x * (i + 1)
    "reduce_scatter_sum": lambda r, xs: sum(x * (r + 1) for x in xs),
    "reduce_scatter_avg": lambda r, xs: sum(x * (r + 1) for x in xs) / WORLD,
    "all_to_all": lambda r, xs: tuple(xs[j] * (r + 1) for j in range(WORLD)),
    # each rank sends row i of [x; 7 * x[0]] to rank i
    "all_to_all_single": lambda r, xs: torch.cat([_rows(xs[j])[r:r + 1] for j in range(WORLD)]),
}


def _rows(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x[:1] * 7])


def _call(case: str, rank: int, x: torch.Tensor) -> Any:
    if case == "all_reduce_sum":
        return F.all_reduce(x)
    if case == "all_reduce_avg":
        return F.all_reduce(x, op=tandem.ReduceOp.AVG)
    if case == "broadcast":
        return F.broadcast(x, src=1)
    if case == "reduce":
        out = F.reduce(x, dst=2)
        return out if rank == 2 else out * 0  # only dst's output is defined
    if case == "all_gather":
        return F.all_gather(x)
    if case == "gather":
        outs = F.gather(x, dst=0)
        return outs if rank == 0 else tuple(o * 0 for o in outs)
    if case == "scatter":
        return F.scatter([x * (i + 1) for i in range(WORLD)], src=2)
    if case.startswith("reduce_scatter"):
        op = tandem.ReduceOp.AVG if case.endswith("avg") else tandem.ReduceOp.SUM
        return F.reduce_scatter(torch.empty(SHAPE, dtype=torch.float64),
                                [x * (i + 1) for i in range(WORLD)], op=op)
    if case == "all_to_all":
        outs = [torch.empty(SHAPE, dtype=torch.float64) for _ in range(WORLD)]
        return F.all_to_all(outs, [x * (i + 1) for i in range(WORLD)])
    if case == "all_to_all_single":
        out = torch.empty(WORLD, SHAPE[1], dtype=torch.float64)
        return F.all_to_all_single(out, _rows(x))
    raise AssertionError(case)


def _job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in ORACLES:
        x = _x(rank).requires_grad_(True)
        got = _call(case, rank, x)
        _weigh(rank, got).backward()
        out[case] = {"value": [t.detach() for t in (got if isinstance(got, tuple) else (got,))],
                     "grad": x.grad.clone()}
    x = _x(rank).requires_grad_(True)
    for op in ("MAX", "PRODUCT"):
        try:
            F.all_reduce(x, op=getattr(tandem.ReduceOp, op))
            out[f"refused_{op}"] = ""
        except ArgumentError as exc:
            out[f"refused_{op}"] = str(exc)
    with torch.no_grad():
        out["max_no_grad"] = F.all_reduce(x, op=tandem.ReduceOp.MAX)
    out["input_kept"] = bool(torch.equal(x.detach(), _x(rank)))
    return out


def _oracle(case: str) -> tuple[list[Any], list[torch.Tensor]]:
    xs = [_x(r).requires_grad_(True) for r in range(WORLD)]
    outs = [ORACLES[case](r, xs) for r in range(WORLD)]
    sum(_weigh(r, o) for r, o in enumerate(outs) if o is not None).backward()
    return outs, [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return spawn(WORLD, _job, backend="tcp", timeout=90)


@pytest.mark.parametrize("case", list(ORACLES))
def test_gradients_equal_one_process(results: list[dict[str, Any]], case: str) -> None:
    outs, grads = _oracle(case)
    for rank in range(WORLD):
        got = results[rank][case]
        assert torch.allclose(got["grad"], grads[rank], atol=1e-12), (case, rank)
        if outs[rank] is not None:
            want = outs[rank] if isinstance(outs[rank], tuple) else (outs[rank],)
            assert all(torch.allclose(a, b.detach()) for a, b in zip(got["value"], want)), (
                case, rank)


def test_ops_without_a_gradient_are_refused_unless_none_is_needed(
        results: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(results):
        assert "ReduceOp.MAX has no gradient" in got["refused_MAX"], got["refused_MAX"]
        assert "ReduceOp.PRODUCT" in got["refused_PRODUCT"]
        assert torch.equal(got["max_no_grad"], torch.stack([_x(r) for r in range(WORLD)]).amax(0))
        assert got["input_kept"], rank


def test_tandem_nn_has_torchs_names() -> None:
    import torch.distributed.nn as tnn

    import tandem.nn

    for name in F.__all__:
        assert hasattr(tnn, name) and getattr(tandem.nn, name) is getattr(F, name), name
