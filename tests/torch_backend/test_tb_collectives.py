"""Every torch.distributed call over "tandem" gives what the same call gives over gloo.

Each rank joins torch with the backend "tandem" and builds a gloo group over the same
ranks; every case runs once on each, with the same inputs, and the outputs must be
bitwise equal. Inputs hold small integers, so sums are exact whatever order a backend
adds in. Calls gloo lacks (PREMUL_SUM) and tandem subgroups are checked against
answers computed here.

Run: ``python -m pytest tests/torch_backend/test_tb_collectives.py -q``.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from _tb_util import checked, init, results_on, same

pytestmark = pytest.mark.procs

R = dist.ReduceOp
Case = Callable[[Any, int, int], Any]  # (group, rank, world) -> outputs to compare


def _x(rank: int, n: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.arange(n) + 10 * rank + 1).to(dtype)


def _reduced(op: Any, dtype: torch.dtype = torch.float32) -> Case:
    def case(g: Any, rank: int, world: int) -> Any:
        t = _x(rank, dtype=dtype) if op != R.PRODUCT else _x(rank, dtype=dtype) % 3 + 1
        dist.all_reduce(t, op=op, group=g)
        return t
    return case


def _async_future(g: Any, rank: int, world: int) -> Any:
    t = _x(rank)
    work = dist.all_reduce(t, group=g, async_op=True)
    value = work.get_future().wait()
    return [t, value[0], value[0].data_ptr() == t.data_ptr()]


def _non_contiguous(g: Any, rank: int, world: int) -> Any:
    t = (torch.arange(12.0).view(3, 4) + rank).t()
    dist.all_reduce(t, group=g)
    return t


def _reduce(g: Any, rank: int, world: int) -> Any:
    t = _x(rank)
    dist.reduce(t, dst=1, group=g)
    return t if rank == 1 else None


def _broadcast(g: Any, rank: int, world: int) -> Any:
    t = _x(rank)
    dist.broadcast(t, src=1, group=g)
    return t


def _all_gather(g: Any, rank: int, world: int) -> Any:
    out = [torch.empty(6) for _ in range(world)]
    dist.all_gather(out, _x(rank), group=g)
    return out


def _all_gather_coalesced(n: int, numel: int, dtype: torch.dtype = torch.float32) -> Case:
    # torch passes one list per rank, each with one output per input
    def case(g: Any, rank: int, world: int) -> Any:
        ins = [_x(rank, numel + i if numel else 0, dtype) for i in range(n)]
        outs = [[torch.full_like(t, -1) for t in ins] for _ in range(world)]
        dist.all_gather_coalesced(outs, ins, group=g)
        return outs
    return case


def _all_gather_into_tensor(g: Any, rank: int, world: int) -> Any:
    out = torch.empty(6 * world)
    dist.all_gather_into_tensor(out, _x(rank), group=g)
    return out


def _private_bases(g: Any, rank: int, world: int) -> Any:
    # torch's older names, which call the backend's methods under their old names
    gathered, scattered = torch.empty(3 * world), torch.empty(2)
    dist._all_gather_base(gathered, _x(rank, 3), group=g)
    dist._reduce_scatter_base(scattered, _x(rank, 2 * world), group=g)
    return [gathered, scattered]


def _gather(g: Any, rank: int, world: int) -> Any:
    out = [torch.empty(6) for _ in range(world)] if rank == world - 1 else None
    dist.gather(_x(rank), out, dst=world - 1, group=g)
    return out


def _scatter(g: Any, rank: int, world: int) -> Any:
    out = torch.empty(6)
    dist.scatter(out, [_x(i) for i in range(world)] if rank == 1 else None, src=1, group=g)
    return out


def _reduce_scatter(g: Any, rank: int, world: int) -> Any:
    out = torch.empty(6)
    dist.reduce_scatter(out, [_x(rank + i) for i in range(world)], group=g)
    return out


def _reduce_scatter_tensor(op: Any) -> Case:
    def case(g: Any, rank: int, world: int) -> Any:
        out, inp = torch.empty(2), _x(rank, 2 * world)
        dist.reduce_scatter_tensor(out, inp, op=op, group=g)
        return [out, inp]
    return case


def _all_to_all(g: Any, rank: int, world: int) -> Any:
    ins = [torch.full((3,), float(10 * rank + j)) for j in range(world)]  # gloo: equal sizes
    outs = [torch.empty(3) for _ in range(world)]
    dist.all_to_all(outs, ins, group=g)
    return outs


def _all_to_all_single(g: Any, rank: int, world: int) -> Any:
    out = torch.empty(2 * world)
    dist.all_to_all_single(out, _x(rank, 2 * world), group=g)
    sizes_in = [rank + j + 1 for j in range(world)]  # rows this rank sends to rank j
    sizes_out = [j + rank + 1 for j in range(world)]
    uneven = torch.empty(sum(sizes_out), 2)
    dist.all_to_all_single(uneven, _x(rank, 2 * sum(sizes_in)).view(-1, 2), sizes_out,
                           sizes_in, group=g)
    return [out, uneven]


def _coalesced(g: Any, rank: int, world: int) -> Any:
    a, b = _x(rank), _x(rank + 5, 3)
    with dist._coalescing_manager(group=g, async_ops=True) as cm:
        dist.all_reduce(a, group=g)
        dist.all_reduce(b, group=g)
    cm.wait()
    gathered = [torch.empty(6 * world), torch.empty(3 * world)]
    with dist._coalescing_manager(group=g):
        dist.all_gather_into_tensor(gathered[0], _x(rank), group=g)
        dist.all_gather_into_tensor(gathered[1], _x(rank, 3), group=g)
    scattered = [torch.empty(2), torch.empty(1)]
    with dist._coalescing_manager(group=g):
        dist.reduce_scatter_tensor(scattered[0], _x(rank, 2 * world), group=g)
        dist.reduce_scatter_tensor(scattered[1], _x(rank, world), group=g)
    c, d = _x(rank), _x(rank + 2, 4)
    dist.all_reduce_coalesced([c, d], group=g)
    return [a, b, gathered, scattered, c, d]


def _coalesced_async(g: Any, rank: int, world: int) -> Any:
    # packed into one call (small pairs), also through torch's future and a strided output
    strided = torch.empty(4 * world)[::2]
    gathered = [torch.empty(5 * world), strided]
    ours = getattr(g or dist.group.WORLD, "tandem_group", None)
    seq = ours._seq if ours is not None else 0
    with dist._coalescing_manager(group=g, async_ops=True) as cm:
        dist.all_gather_into_tensor(gathered[0], _x(rank, 5), group=g)
        dist.all_gather_into_tensor(gathered[1], _x(rank, 2), group=g)
    cm.wait()
    assert ours is None or ours._seq == seq + 1, "the two pairs were not sent as one call"
    scattered = [torch.empty(3), torch.empty(1)]
    with dist._coalescing_manager(group=g, async_ops=True) as cm:
        dist.reduce_scatter_tensor(scattered[0], _x(rank, 3 * world), op=dist.ReduceOp.AVG,
                                   group=g)  # torch coalesces calls of one reduce op
        dist.reduce_scatter_tensor(scattered[1], _x(rank, world), op=dist.ReduceOp.AVG,
                                   group=g)
    cm.wait()
    g = g or dist.group.WORLD
    # one pair too big to pack (1 MiB of float32 per rank): each pair is its own call
    large = [_x(rank, world * (1 << 18)), _x(rank, 2 * world)]
    results = funcol.reduce_scatter_tensor_coalesced(large, "sum", [0, 0], g)
    return [gathered, scattered, [t.wait() if hasattr(t, "wait") else t for t in results]]


def _functional(g: Any, rank: int, world: int) -> Any:
    g = g or dist.group.WORLD  # functional collectives name their group

    def done(t: Any) -> torch.Tensor:
        return t.wait() if hasattr(t, "wait") else t
    return [done(funcol.all_reduce(_x(rank), "sum", g)),
            done(funcol.all_gather_tensor(_x(rank), 0, g)),
            done(funcol.reduce_scatter_tensor(_x(rank, 2 * world), "sum", 0, g)),
            done(funcol.all_to_all_single(_x(rank, 2 * world), None, None, g)),
            done(funcol.broadcast(_x(rank), 1, g)),
            [done(t) for t in funcol.all_gather_into_tensor_coalesced([_x(rank), _x(rank, 2)], g)]]


def _objects(g: Any, rank: int, world: int) -> Any:
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "data": list(range(rank))}, group=g)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(("from", rank), gathered, dst=0, group=g)
    sent = [f"object {rank}", rank * 1.5]
    dist.broadcast_object_list(sent, src=1, group=g)
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, [{"to": i} for i in range(world)] if rank == 0 else None,
                             src=0, group=g)
    p2p: list[Any] = [None]
    if rank == 0:
        dist.send_object_list([{"hello": 1}], dst=1, group=g)
    elif rank == 1:
        dist.recv_object_list(p2p, src=0, group=g)
    return [everyone, gathered, sent, mine, p2p]


def _p2p(g: Any, rank: int, world: int) -> Any:
    right, left = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(6)
    sent = dist.isend(_x(rank), right, group=g)
    dist.irecv(got, left, group=g).wait()
    sent.wait()
    ops = [dist.P2POp(dist.isend, _x(rank) * 2, right, group=g),
           dist.P2POp(dist.irecv, batch := torch.empty(6), left, group=g)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    anyone, sender = torch.empty(6), -1
    if rank == 1:
        dist.send(_x(rank) * 3, 0, group=g, tag=7)
    elif rank == 0:
        sender = dist.recv(anyone, group=g, tag=7)  # from any source
    return [got, batch, anyone if rank == 0 else None, sender]


def _barriers(g: Any, rank: int, world: int) -> Any:
    dist.barrier(group=g)
    dist.barrier(group=g, async_op=True).wait()
    if g is None:  # torch's monitored_barrier: gloo runs its own
        dist.barrier(timeout=datetime.timedelta(seconds=20))
    dist.monitored_barrier(group=g, timeout=datetime.timedelta(seconds=20), wait_all_ranks=True)
    return "passed"


COMPARED: dict[str, Case] = {
    **{f"all_reduce_{op}": _reduced(getattr(R, op))
       for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")},
    **{f"all_reduce_{op}_int64": _reduced(getattr(R, op), torch.int64)
       for op in ("BAND", "BOR", "BXOR", "SUM")},
    **{f"all_reduce_SUM_{d}": _reduced(R.SUM, getattr(torch, d))
       for d in ("float64", "int32", "bfloat16", "float16", "uint8")},
    "all_reduce_complex": _reduced(R.SUM, torch.complex64),
    "all_reduce_async_future": _async_future,
    "all_reduce_non_contiguous": _non_contiguous,
    "reduce": _reduce,
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_coalesced_1": _all_gather_coalesced(1, 4),
    "all_gather_coalesced_3": _all_gather_coalesced(3, 2),
    "all_gather_coalesced_empty": _all_gather_coalesced(3, 0),
    "all_gather_coalesced_complex": _all_gather_coalesced(2, 3, torch.complex64),
    "all_gather_into_tensor": _all_gather_into_tensor,
    "private_bases": _private_bases,
    "gather": _gather,
    "scatter": _scatter,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor_SUM": _reduce_scatter_tensor(R.SUM),
    "reduce_scatter_tensor_AVG": _reduce_scatter_tensor(R.AVG),
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "coalesced": _coalesced,
    "coalesced_async": _coalesced_async,
    "functional": _functional,
    "objects": _objects,
    "p2p": _p2p,
    "barriers": _barriers,
}


def _premul_sum(rank: int, world: int) -> Any:
    t = _x(rank)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    inp, out = _x(rank, 2 * world), torch.empty(2)
    dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(torch.tensor(2.0)))
    total = sum(_x(r) for r in range(world))
    pieces = sum(_x(r, 2 * world) for r in range(world)).split(2)
    assert same(t, total * 0.5), (t, total * 0.5)
    assert same(out, pieces[rank] * 2) and same(inp, _x(rank, 2 * world)), (out, inp)


def _mixed_dtypes_coalesced(rank: int, world: int) -> Any:
    a, b = _x(rank), _x(rank, 4, torch.int64)  # gloo refuses two dtypes in one call
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    assert same(a, sum(_x(r) for r in range(world)))
    assert same(b, sum(_x(r, 4, torch.int64) for r in range(world)))


def _subgroups(rank: int, world: int) -> Any:
    pair = dist.new_group([0, world - 1])
    rest = [list(range(2, world))] if world > 2 else []
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], *rest])
    t = _x(rank)
    if rank in (0, world - 1):
        dist.all_reduce(t, group=pair)
        assert same(t, _x(0) + _x(world - 1))
        assert dist.get_process_group_ranks(pair) == [0, world - 1]
    members = [0, 1] if rank < 2 else list(range(2, world))
    u = _x(rank)
    dist.all_reduce(u, group=mine)
    assert same(u, sum(_x(r) for r in members)), (u, members)
    assert dist.get_backend(mine) == "tandem" and dist.get_world_size(mine) == len(members)
    alone, _ = dist.new_subgroups(group_size=1)
    v = _x(rank)
    dist.all_reduce(v, group=alone)
    assert same(v, _x(rank)) and dist.get_world_size(alone) == 1


# cases whose arguments are group ranks, also run on a subgroup (the last two ranks)
ON_SUBGROUPS = [name for name in COMPARED if name.startswith("all_gather_coalesced")] + [
    "all_reduce_SUM", "all_reduce_complex", "all_gather", "all_gather_into_tensor",
    "private_bases", "reduce_scatter", "reduce_scatter_tensor_SUM", "all_to_all",
    "all_to_all_single", "coalesced"]


def compare(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    init(rank, world, store_dir)
    gloo = dist.new_group(backend="gloo")
    pair = [world - 2, world - 1]
    ours_pair, gloo_pair = dist.new_group(pair), dist.new_group(pair, backend="gloo")

    def against_gloo(case: Case, ours: Any = None, theirs: Any = gloo) -> Callable[[], Any]:
        def body() -> Any:
            if ours is not None and rank not in pair:
                return {"same": True}
            r, w = (pair.index(rank), 2) if ours is not None else (rank, world)
            mine, oracle = case(ours, r, w), case(theirs, r, w)
            return {"same": same(mine, oracle), "tandem": repr(mine), "gloo": repr(oracle)}
        return body

    cases = {name: against_gloo(case) for name, case in COMPARED.items()}
    cases.update({f"{name}_subgroup": against_gloo(COMPARED[name], ours_pair, gloo_pair)
                  for name in ON_SUBGROUPS})
    cases["premul_sum"] = lambda: {"same": _premul_sum(rank, world) is None}
    cases["subgroups"] = lambda: {"same": _subgroups(rank, world) is None}
    cases["mixed_dtypes_coalesced"] = lambda: {"same": _mixed_dtypes_coalesced(rank, world)
                                               is None}
    return checked(cases)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"{w}ranks")
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return results_on(request.param, compare, tmp_path_factory, 150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [*COMPARED, *(f"{n}_subgroup" for n in ON_SUBGROUPS),
                                  "premul_sum", "subgroups",
                                  "mixed_dtypes_coalesced"])
def test_call_over_tandem_equals_gloo(results: list[dict[str, Any]], case: str) -> None:
    for rank, result in enumerate(r[case] for r in results):
        assert "error" not in result, f"{case} failed on rank {rank}:\n{result['error']}"
        assert result["same"], (f"{case}, rank {rank} of {len(results)}:\n"
                                f"  tandem {result.get('tandem')}\n  gloo   {result.get('gloo')}")
