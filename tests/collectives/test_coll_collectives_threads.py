"""Every collective on 1 to 5 thread ranks, every root, against answers computed locally.

Complements ``test_coll_vs_gloo`` (2 and 3 processes): here world sizes that are not
powers of two and roots other than 0 exercise the trees, rings and direct algorithms.
"""

from __future__ import annotations

import pytest
import torch

import tandem
from tandem.config import Settings
from tandem.testing import run_threads

from _coll_util import assert_equal

pytestmark = pytest.mark.timeout(60)

WORLD_SIZES = [1, 2, 3, 4, 5]
SMALL_CHUNKS = Settings(chunk_bytes=4096)


def x(rank: int, n: int = 1500, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s data: distinct per rank and position, exact in float64."""
    return torch.arange(n, dtype=torch.float64) + 10_000 * rank + salt


def threads(ws: int, body):
    return run_threads(ws, body, settings=SMALL_CHUNKS)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_broadcast_from_every_root(ws: int) -> None:
    def body(g):
        out = []
        for root in range(ws):
            t = x(g.rank())
            tandem.broadcast(t, src=root, group=g)
            out.append(t)
        return out

    for rank, got in enumerate(threads(ws, body)):
        for root, t in enumerate(got):
            assert_equal(t, x(root), f"rank {rank}: broadcast(src={root}) on {ws} ranks")


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "PRODUCT"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_reduce_to_every_root(ws: int, op: str) -> None:
    def body(g):
        out = []
        for root in range(ws):
            t = x(g.rank()) % 7 + 1
            tandem.reduce(t, dst=root, op=getattr(tandem.ReduceOp, op), group=g)
            out.append(t)
        return out

    inputs = [x(r) % 7 + 1 for r in range(ws)]
    stacked = torch.stack(inputs)
    answer = {"SUM": stacked.sum(0), "AVG": stacked.sum(0) / ws, "MAX": stacked.amax(0),
              "PRODUCT": stacked.prod(0)}[op]
    for rank, got in enumerate(threads(ws, body)):
        for root, t in enumerate(got):
            where = f"rank {rank}: reduce({op}, dst={root}) on {ws} ranks"
            if rank == root:
                assert_equal(t, answer, where)
            else:
                assert_equal(t, inputs[rank], f"{where} changed a non-destination tensor")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_all_gather_and_all_gather_into_tensor(ws: int) -> None:
    def body(g):
        outs = [torch.empty(1500, dtype=torch.float64) for _ in range(ws)]
        tandem.all_gather(outs, x(g.rank()), group=g)
        flat = torch.empty(ws * 1500, dtype=torch.float64)
        tandem.all_gather_into_tensor(flat, x(g.rank()), group=g)
        return outs, flat

    for rank, (outs, flat) in enumerate(threads(ws, body)):
        for i, t in enumerate(outs):
            assert_equal(t, x(i), f"rank {rank}: all_gather slot {i} on {ws} ranks")
        assert_equal(flat, torch.cat([x(i) for i in range(ws)]),
                     f"rank {rank}: all_gather_into_tensor on {ws} ranks")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_all_gather_accepts_a_different_size_per_rank(ws: int) -> None:
    # torch's gloo refuses this; tandem's all_gather_object is built on it
    def body(g):
        outs = [torch.empty(100 * i + 1, dtype=torch.float64) for i in range(ws)]
        tandem.all_gather(outs, x(g.rank(), 100 * g.rank() + 1), group=g)
        return outs

    for rank, outs in enumerate(threads(ws, body)):
        for i, t in enumerate(outs):
            assert_equal(t, x(i, 100 * i + 1), f"rank {rank}: uneven all_gather slot {i}")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_gather_and_scatter_with_every_root(ws: int) -> None:
    def body(g):
        r, out = g.rank(), []
        for root in range(ws):
            lst = [torch.empty(1500, dtype=torch.float64) for _ in range(ws)] if r == root else None
            tandem.gather(x(r), lst, dst=root, group=g)
            got = torch.empty(1500, dtype=torch.float64)
            ins = [x(100 + i) for i in range(ws)] if r == root else None
            tandem.scatter(got, ins, src=root, group=g)
            out.append((lst, got))
        return out

    for rank, per_root in enumerate(threads(ws, body)):
        for root, (lst, got) in enumerate(per_root):
            if rank == root:
                for i, t in enumerate(lst):
                    assert_equal(t, x(i), f"rank {rank}: gather(dst={root}) slot {i}")
            assert_equal(got, x(100 + rank), f"rank {rank}: scatter(src={root})")


@pytest.mark.parametrize("op", ["SUM", "AVG", "MIN"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_reduce_scatter_and_reduce_scatter_tensor(ws: int, op: str) -> None:
    redop = getattr(tandem.ReduceOp, op)

    def body(g):
        r = g.rank()
        out = torch.empty(1500, dtype=torch.float64)
        tandem.reduce_scatter(out, [x(r, salt=7 * i) for i in range(ws)], op=redop, group=g)
        flat_in = torch.cat([x(r, salt=7 * i) for i in range(ws)])
        kept = flat_in.clone()
        out2 = torch.empty(1500, dtype=torch.float64)
        tandem.reduce_scatter_tensor(out2, flat_in, op=redop, group=g)
        return out, out2, torch.equal(flat_in, kept)

    for rank, (out, out2, untouched) in enumerate(threads(ws, body)):
        stacked = torch.stack([x(r, salt=7 * rank) for r in range(ws)])
        answer = {"SUM": stacked.sum(0), "AVG": stacked.sum(0) / ws, "MIN": stacked.amin(0)}[op]
        assert_equal(out, answer, f"rank {rank}: reduce_scatter({op}) on {ws} ranks")
        assert_equal(out2, answer, f"rank {rank}: reduce_scatter_tensor({op}) on {ws} ranks")
        assert untouched, f"rank {rank}: reduce_scatter_tensor modified its input"


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_all_to_all_and_all_to_all_single_with_uneven_splits(ws: int) -> None:
    def body(g):
        r = g.rank()
        outs = [torch.empty(i + r + 1, dtype=torch.float64) for i in range(ws)]
        tandem.all_to_all(outs, [x(r, r + j + 1, salt=j) for j in range(ws)], group=g)
        in_splits = [r + j for j in range(ws)]
        out_splits = [i + r for i in range(ws)]
        src = torch.cat([x(r, (r + j) * 2, salt=j) for j in range(ws)]).reshape(-1, 2)
        single = torch.empty(sum(out_splits), 2, dtype=torch.float64)
        tandem.all_to_all_single(single, src, out_splits, in_splits, group=g)
        return outs, single

    for rank, (outs, single) in enumerate(threads(ws, body)):
        for i, t in enumerate(outs):
            assert_equal(t, x(i, i + rank + 1, salt=rank), f"rank {rank}: all_to_all from {i}")
        expected = torch.cat([x(i, (i + rank) * 2, salt=rank) for i in range(ws)]).reshape(-1, 2)
        assert_equal(single, expected, f"rank {rank}: all_to_all_single, uneven splits")


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_barrier_returns_none_on_every_rank(ws: int) -> None:
    assert threads(ws, lambda g: tandem.barrier(group=g)) == [None] * ws
