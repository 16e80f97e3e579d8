"""Flat algorithms across hosts move data in link-sized pieces (``link_chunk``).

A group whose ranks are on several hosts, one per host, pipelines its ring in pieces
of ``link_chunk_bytes`` and swaps recursive doubling's buffers in pieces too, so a
link's delay is hidden behind the next piece; on one host nothing changes. Results
must still agree with the naive oracle bit for bit on every rank (exact inputs, see
``_coll_util``). Threads over the loopback transport, whose ranks report the host
names given to ``run_threads``.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tandem
from tandem.collectives.algorithms.ring import link_chunk
from tandem.collectives.group import Op, ProcessGroup
from tandem.config import Settings
from tandem.errors import TandemError
from tandem.testing import run_threads
from tandem.transport.base import Slot

from _coll_util import DTYPES, assert_equal, op_defined, rank_input, reduce_locally, short

pytestmark = pytest.mark.timeout(60)

LINK = Settings(link_chunk_bytes=4096)
HOSTS = {2: ["a", "b"], 3: ["a", "b", "c"], 4: ["a", "b", "c", "d"], 5: list("abcde")}


def _sends(world_size: int, numel: int, algorithm: str, hosts: list[str] | None,
           monkeypatch: pytest.MonkeyPatch, settings: Settings = LINK) -> int:
    """How many messages group rank 0 sends in one all-reduce."""
    count = [0]
    rank0 = threading.local()
    send = Op.send

    def counted(self: Op, to: int, step: int, view: memoryview) -> Slot:
        if getattr(rank0, "on", False):
            count[0] += 1
        return send(self, to, step, view)

    monkeypatch.setattr(Op, "send", counted)

    def body(group: ProcessGroup) -> None:
        group.algorithm_override["all_reduce"] = algorithm
        rank0.on = group.rank() == 0
        tandem.all_reduce(torch.ones(numel), group=group)

    run_threads(world_size, body, settings=settings, hosts=hosts)
    return count[0]


def test_link_chunk_applies_only_to_groups_spanning_hosts() -> None:
    def body(group: ProcessGroup) -> int | None:
        return link_chunk(group)

    assert run_threads(3, body, settings=LINK) == [None] * 3  # hosts unknown
    assert run_threads(3, body, settings=LINK, hosts=["a"] * 3) == [None] * 3
    assert run_threads(3, body, settings=LINK, hosts=HOSTS[3]) == [4096] * 3
    # never above chunk_bytes
    both = Settings(link_chunk_bytes=1 << 20, chunk_bytes=8192)
    assert run_threads(2, body, settings=both, hosts=HOSTS[2]) == [8192] * 2


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_across_hosts_sends_link_sized_pieces(world_size: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # 6 KiB per segment: two 4 KiB pieces across hosts, one chunk on one host
    numel = world_size * 6 * 1024 // 4
    steps = 2 * (world_size - 1)
    assert _sends(world_size, numel, "ring", HOSTS[world_size], monkeypatch) == steps * 2
    assert _sends(world_size, numel, "ring", ["a"] * world_size, monkeypatch) == steps


def test_1mb_ring_across_4_hosts_sends_one_link_sized_piece_per_segment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # default settings: a 256 KiB segment goes whole (one stream per link, one message
    # per step); four pieces per segment measured slower at 1 Gbit/s, 0.2 ms
    numel = (1 << 20) // 4
    assert _sends(4, numel, "ring", HOSTS[4], monkeypatch, Settings()) == 2 * 3


def test_ring_across_hosts_keeps_at_most_eight_pieces_per_segment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _sends(3, 3 * (1 << 18), "ring", HOSTS[3], monkeypatch) == 2 * 2 * 8


@pytest.mark.parametrize("world_size,rounds", [(2, 1), (4, 2)])
def test_doubling_across_hosts_swaps_in_pieces(world_size: int, rounds: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    numel = 3 * 4096 // 4  # three pieces of 4 KiB
    assert _sends(world_size, numel, "doubling", HOSTS[world_size], monkeypatch) == 3 * rounds
    assert _sends(world_size, numel, "doubling", None, monkeypatch) == rounds


CASES = [(op, d) for op in ("SUM", "AVG", "MAX", "PRODUCT", "BXOR") for d in DTYPES
         if op_defined(op, d)]


@pytest.mark.parametrize("numel", [0, 1, 1000, 5003])
@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ["doubling", "ring"])
def test_all_reduce_across_hosts_agrees_with_naive_oracle(algorithm: str, world_size: int,
                                                          numel: int) -> None:
    def body(group: ProcessGroup) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for op, dtype in CASES:
            x = rank_input(op, dtype, numel, group.rank())
            mine, oracle = x.clone(), x.clone()
            group.algorithm_override["all_reduce"] = algorithm
            tandem.all_reduce(mine, op=getattr(tandem.ReduceOp, op), group=group)
            group.algorithm_override["all_reduce"] = "naive"
            tandem.all_reduce(oracle, op=getattr(tandem.ReduceOp, op), group=group)
            out.append((mine, oracle))
        return out

    results = run_threads(world_size, body, settings=LINK, hosts=HOSTS[world_size])
    for c, (op, dtype) in enumerate(CASES):
        expected = reduce_locally(op, [rank_input(op, dtype, numel, r)
                                       for r in range(world_size)])
        for rank, per_case in enumerate(results):
            got, oracle = per_case[c]
            what = f"rank {rank}: {algorithm} all_reduce({op}, {short(dtype)}, {numel})"
            assert_equal(got, oracle, f"{what} vs the naive oracle")
            assert_equal(got, expected, f"{what} vs the locally computed reduction")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_and_reduce_scatter_across_hosts_are_exact(world_size: int) -> None:
    numel = world_size * 3001  # several 4 KiB pieces per rank's part

    def body(group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        r = group.rank()
        gathered = torch.empty(numel * world_size)
        tandem.all_gather_into_tensor(gathered, torch.arange(numel) + 1e6 * r, group=group)
        part = torch.empty(numel // world_size)
        tandem.reduce_scatter_tensor(part, rank_input("SUM", torch.float32, numel, r),
                                     group=group)
        return gathered, part

    results = run_threads(world_size, body, settings=LINK, hosts=HOSTS[world_size])
    gathered = torch.cat([torch.arange(numel) + 1e6 * r for r in range(world_size)])
    total = reduce_locally("SUM", [rank_input("SUM", torch.float32, numel, r)
                                   for r in range(world_size)])
    for rank, (got, part) in enumerate(results):
        assert_equal(got, gathered, f"rank {rank}: all_gather_into_tensor across hosts")
        assert_equal(part, total.chunk(world_size)[rank],
                     f"rank {rank}: reduce_scatter_tensor across hosts")


@pytest.mark.parametrize("algorithm", ["ring", "doubling"])
def test_a_call_that_fails_leaves_no_receive_posted(algorithm: str) -> None:
    # rank 2 never calls: the others fail (timeout, or the abort that follows it) with
    # receives for later pieces and steps already posted; each must be withdrawn (the
    # group's abort does), or a late message could land in scratch memory or a tensor
    # that a later call uses
    def body(group: ProcessGroup) -> int | None:
        if group.rank() == 2:
            return None
        group.algorithm_override["all_reduce"] = algorithm
        with pytest.raises(TandemError):
            tandem.all_reduce(torch.ones(3 * 4096), group=group)
        return len(group.transport.mailbox._posted)

    assert run_threads(3, body, settings=LINK, hosts=HOSTS[3], op_timeout=1.0)[:2] == [0, 0]
