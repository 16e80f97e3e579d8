"""Packed coalesced calls, in one process: the packing against per-pair collectives.

The oracle is the naive algorithm: every simulated rank's pairs are gathered or
reduce-scattered one pair at a time with plain tensor arithmetic, and the packed call
(its packed inputs combined the same way, then unpacked) must give the same outputs.
The multi-rank runs against gloo are in ``test_tb_collectives.py`` ("coalesced",
"coalesced_async", "functional").

Run: ``python -m pytest tests/torch_backend/test_tb_fused.py -q``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.collectives.work import Work
from tandem.errors import PeerLostError
from tandem.torch_backend._errors import TandemBackendError
from tandem.torch_backend._fused import FUSE_BYTES, packed_all_gather, packed_reduce_scatter
from tandem.torch_backend._work import TorchWork

WORLD = 3


def _inputs(rank: int, sizes: list[int], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [(torch.arange(n) * (rank + 2) + 100 * i).to(dtype) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_packed_all_gather_gives_each_pairs_gather(dtype: torch.dtype) -> None:
    sizes = [5, 1, 8]
    ins = [_inputs(r, sizes, dtype) for r in range(WORLD)]
    expected = [torch.cat([ins[r][i] for r in range(WORLD)]) for i in range(len(sizes))]
    outs = [[torch.full((WORLD * n,), -1).to(dtype) for n in sizes] for _ in range(WORLD)]
    outs[0][2] = torch.full((WORLD * 8 * 2,), -1).to(dtype)[::2]  # a strided output
    packs = [packed_all_gather(outs[r], ins[r], WORLD) for r in range(WORLD)]
    gathered = torch.cat([p.input for p in packs if p is not None])  # the collective
    for r, p in enumerate(packs):
        assert p is not None
        p.output.copy_(gathered)
        p.unpack()
        for got, want in zip(outs[r], expected):
            assert torch.equal(got, want), (r, got, want)


def test_packed_reduce_scatter_gives_each_pairs_reduction() -> None:
    sizes = [4, 2, 7]
    ins = [[t.view(WORLD, n).t().contiguous().t() if i == 1 else t  # a strided input
            for i, (t, n) in enumerate(zip(_inputs(r, [WORLD * n for n in sizes]), sizes))]
           for r in range(WORLD)]
    total = [sum(ins[r][i].reshape(-1) for r in range(WORLD)) for i in range(len(sizes))]
    outs = [[torch.empty(n) for n in sizes] for _ in range(WORLD)]
    outs[1][2] = torch.empty(2 * sizes[2])[::2]  # a strided output
    packs = [packed_reduce_scatter(outs[r], ins[r], WORLD) for r in range(WORLD)]
    summed = sum(p.input for p in packs if p is not None)  # the collective's reduction
    assert isinstance(summed, torch.Tensor)
    for r, p in enumerate(packs):
        assert p is not None
        p.output.copy_(summed.view(WORLD, -1)[r])
        p.unpack()
        for i, n in enumerate(sizes):
            assert torch.equal(outs[r][i], total[i][r * n:(r + 1) * n]), (r, i)


def test_packing_copies_the_inputs_as_of_the_call() -> None:
    inp = [torch.ones(2), torch.ones(3)]
    outs = [torch.empty(2 * WORLD), torch.empty(3 * WORLD)]
    packed = packed_all_gather(outs, inp, WORLD)
    assert packed is not None
    inp[0].fill_(7.0)  # a later change of the caller's input is not sent
    assert torch.equal(packed.input, torch.ones(5))


def test_what_does_not_pay_or_is_malformed_goes_pair_by_pair() -> None:
    big = FUSE_BYTES // 4  # float32 elements
    assert packed_all_gather([torch.empty(WORLD)], [torch.ones(1)], WORLD) is None  # one pair
    assert packed_all_gather([torch.empty(WORLD * big)] * 2, [torch.ones(big)] * 2,
                             WORLD) is None  # too big to copy
    assert packed_all_gather([torch.empty(WORLD), torch.empty(WORLD, dtype=torch.int64)],
                             [torch.ones(1), torch.ones(1, dtype=torch.int64)],
                             WORLD) is None  # two dtypes
    assert packed_all_gather([torch.empty(WORLD), torch.empty(2)], [torch.ones(1)] * 2,
                             WORLD) is None  # a wrong output size: the call says so
    assert packed_reduce_scatter([torch.empty(1)] * 2, [torch.ones(WORLD), torch.ones(2)],
                                 WORLD) is None
    assert packed_reduce_scatter([torch.empty(0)] * 2, [torch.ones(0)] * 2, WORLD) is None


def _done(error: BaseException | None = None) -> Work:
    work = Work("op")
    work._complete(error=error)
    return work


def test_torch_work_runs_after_once_before_the_result_is_seen() -> None:
    for see in ("wait", "future", "is_completed"):
        runs: list[str] = []

        def after() -> None:
            runs.append(threading.current_thread().name)

        work = TorchWork([_done()], ["out"], after=after)
        if see == "wait":
            assert work.wait() and work.wait()
        elif see == "future":
            assert work.get_future().wait() == ["out"]
            work.wait()
        else:
            assert work.is_completed() and work.is_completed()
        assert len(runs) == 1, (see, runs)


def test_torch_work_skips_after_when_the_call_failed() -> None:
    runs: list[int] = []
    work = TorchWork([_done(PeerLostError("rank 1 died", 1))], None, after=lambda: runs.append(1))
    with pytest.raises(TandemBackendError):
        work.wait()
    assert work.is_completed() and not work.is_success() and runs == []
