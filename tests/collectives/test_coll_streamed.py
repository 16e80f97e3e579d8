"""all_gather and reduce_scatter across hosts, streamed through one leader per host.

Threads over loopback claim to be on hosts (``run_threads(..., hosts=...)``). When a
group spans hosts in blocks of consecutive ranks, the collectives go through the
hosts' leaders (``algorithms/streamed.py``); otherwise (interleaved hosts) through the
flat ring. Either way the result must be exact: inputs are exact (``_coll_util``), so
every reduction order gives the same bits.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import tandem
from tandem.collectives.algorithms._phases import PHASE
from tandem.collectives.group import Op, ProcessGroup
from tandem.config import Settings
from tandem.testing import run_threads
from tandem.transport.base import Slot

from _coll_util import assert_equal, rank_input, reduce_locally, watch_collective_sends

pytestmark = pytest.mark.timeout(120)

TOPOLOGIES = {
    "2x2": list("aabb"),
    "3+1": list("aaab"),
    "1+4": list("abbbb"),
    "3-hosts": list("aabbbc"),
    "interleaved": list("abab"),  # not consecutive: the flat ring
}
SETTINGS = Settings(chunk_bytes=4096, ring_threshold=4096)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("numel", [0, 1, 1001, 30011])
def test_all_gather_is_exact_on_every_topology(topology: str, numel: int) -> None:
    hosts = TOPOLOGIES[topology]
    p = len(hosts)

    def body(group: ProcessGroup) -> tuple[list[torch.Tensor], torch.Tensor]:
        mine = rank_input("SUM", torch.float32, numel, group.rank())
        outs = [torch.full((numel,), -1.0) for _ in range(p)]
        tandem.all_gather(outs, mine, group=group)
        into = torch.full((p * numel,), -1.0)
        tandem.all_gather_into_tensor(into, mine, group=group)
        return outs, into

    want = [rank_input("SUM", torch.float32, numel, r) for r in range(p)]
    for rank, (outs, into) in enumerate(run_threads(p, body, settings=SETTINGS, hosts=hosts)):
        for r in range(p):
            assert_equal(outs[r], want[r], f"rank {rank}: all_gather, piece of rank {r}")
        assert_equal(into, torch.cat(want), f"rank {rank}: all_gather_into_tensor")


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("op, dtype", [("SUM", torch.float32), ("AVG", torch.float64),
                                       ("MAX", torch.int32), ("PRODUCT", torch.float32),
                                       ("BXOR", torch.int64)])
def test_reduce_scatter_is_exact_on_every_topology(topology: str, op: str,
                                                   dtype: torch.dtype) -> None:
    hosts = TOPOLOGIES[topology]
    p, n = len(hosts), 5003
    redop = getattr(tandem.ReduceOp, op)

    def body(group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        x = rank_input(op, dtype, p * n, group.rank())
        out = torch.zeros(n, dtype=dtype)
        tandem.reduce_scatter_tensor(out, x, op=redop, group=group)
        listed = torch.zeros(n, dtype=dtype)
        tandem.reduce_scatter(listed, list(x.split(n)), op=redop, group=group)
        return out, listed

    total = reduce_locally(op, [rank_input(op, dtype, p * n, r) for r in range(p)])
    for rank, (out, listed) in enumerate(run_threads(p, body, settings=SETTINGS, hosts=hosts)):
        want = total[rank * n:(rank + 1) * n]
        assert_equal(out, want, f"rank {rank}: reduce_scatter_tensor({op})")
        assert_equal(listed, want, f"rank {rank}: reduce_scatter({op})")


def test_reduce_scatter_with_uneven_pieces_and_a_custom_op() -> None:
    hosts = list("aabbb")
    sizes = [3, 0, 4001, 17, 250]
    gcd = tandem.ReduceOp.custom(torch.gcd, "GCD")
    inputs = [[torch.randint(1, 10**6, (s,), generator=torch.Generator().manual_seed(10 * r + i))
               * 6 for i, s in enumerate(sizes)] for r in range(len(hosts))]

    def body(group: ProcessGroup) -> torch.Tensor:
        out = torch.zeros(sizes[group.rank()], dtype=torch.int64)
        tandem.reduce_scatter(out, inputs[group.rank()], op=gcd, group=group)
        return out

    for rank, got in enumerate(run_threads(len(hosts), body, settings=SETTINGS, hosts=hosts)):
        want = inputs[0][rank]
        for r in range(1, len(hosts)):
            want = torch.gcd(want, inputs[r][rank])
        assert_equal(got, want, f"rank {rank}: reduce_scatter(GCD) of {sizes[rank]} elements")


def _traffic(hosts: list[str], call: Callable[[ProcessGroup], None],
             settings: Settings = SETTINGS) -> list[list[tuple[int, int]]]:
    """Per rank: (peer, bytes) of every collective message it sent while ``call`` ran."""

    def body(group: ProcessGroup) -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []
        watch_collective_sends(group.transport,
                               lambda peer, _h, payload: seen.append((peer, len(payload))))
        call(group)
        return seen

    return run_threads(len(hosts), body, settings=settings, hosts=hosts)


def test_only_leaders_cross_hosts_and_each_host_sends_its_share_once() -> None:
    hosts, n = list("aabb"), 1 << 14  # floats per rank

    def call(group: ProcessGroup) -> None:
        outs = [torch.empty(n) for _ in hosts]
        tandem.all_gather(outs, torch.ones(n), group=group)
        tandem.reduce_scatter_tensor(torch.empty(n), torch.ones(len(hosts) * n), group=group)

    traffic = _traffic(hosts, call)
    across = {rank: sum(b for peer, b in sent if hosts[peer] != hosts[rank])
              for rank, sent in enumerate(traffic)}
    # all-gather: a host's two pieces; reduce-scatter: the other host's half, reduced
    assert across == {0: 2 * 4 * n + 2 * 4 * n, 1: 0, 2: 2 * 4 * n + 2 * 4 * n, 3: 0}
    down = {rank: sum(b for peer, b in sent if peer == rank + 1)
            for rank, sent in enumerate(traffic) if rank in (0, 2)}
    # all-gather: the 3 pieces the other rank lacks; reduce-scatter: its own piece
    assert down == {0: 3 * 4 * n + 4 * n, 2: 3 * 4 * n + 4 * n}


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter"])
def test_leaders_send_link_sized_pieces_across_hosts(collective: str) -> None:
    # pieces of link_chunk_bytes, not of the (larger) chunk_bytes of a ring on one host
    hosts, n = list("aabb"), 1 << 12  # floats per rank: 16 KiB, 4 pieces of 4 KiB per rank
    link = Settings(link_chunk_bytes=4096, ring_threshold=4096)

    def call(group: ProcessGroup) -> None:
        if collective == "all_reduce":
            tandem.all_reduce(torch.ones(n), group=group)
        elif collective == "all_gather":
            tandem.all_gather_into_tensor(torch.empty(len(hosts) * n), torch.ones(n),
                                          group=group)
        else:
            tandem.reduce_scatter_tensor(torch.empty(n), torch.ones(len(hosts) * n),
                                         group=group)

    for rank, sent in enumerate(_traffic(hosts, call, link)):
        across = [b for peer, b in sent if hosts[peer] != hosts[rank]]
        if rank in (0, 2):
            assert across and max(across) == 4096, (
                f"rank {rank}: {collective} sent {across} bytes at a time across hosts")
        else:
            assert not across, f"rank {rank} is no leader but sent {across} across hosts"


def test_interleaved_hosts_use_the_flat_ring() -> None:
    hosts, n = list("abab"), 1 << 12

    def call(group: ProcessGroup) -> None:
        outs = [torch.empty(n) for _ in hosts]
        tandem.all_gather(outs, torch.ones(n), group=group)

    traffic = _traffic(hosts, call)
    assert all({peer for peer, _ in sent} == {(rank + 1) % 4} for rank, sent in enumerate(traffic))


@pytest.mark.parametrize("topology", ["2x2", "3+1", "3-hosts"])
def test_ranks_send_pieces_up_in_the_order_their_leader_reads_them(
        topology: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A leader's first send across hosts waits for the first piece it reads from each of
    # its host's ranks; a rank that sent its pieces in buffer order would make the
    # leaders of all but one host wait for most of the buffer first (slower, same bits).
    hosts, n = TOPOLOGIES[topology], 1 << 14
    leader = {r: hosts.index(h) for r, h in enumerate(hosts)}
    sent: dict[int, list[int]] = {r: [] for r in range(len(hosts))}
    read: dict[int, list[int]] = {r: [] for r in range(len(hosts))}
    plain_wait = Op.wait

    def wait(self: Op, *slots: Slot) -> None:
        me = self.group.transport.rank
        for slot in slots:  # pieces sent up: lift steps, below the ring's PHASE
            peer, step = slot.key[0], slot.key[-1]
            if len(slots) == 1 and step < PHASE and peer != me and leader[peer] == me:
                read[peer].append(step)
        plain_wait(self, *slots)

    monkeypatch.setattr(Op, "wait", wait)

    def body(group: ProcessGroup) -> torch.Tensor:
        me = group.rank()

        def note(peer: int, header: Any, _payload: memoryview) -> None:
            if header.step < PHASE and peer == leader[me] != me:
                sent[me].append(header.step)

        watch_collective_sends(group.transport, note)
        x = torch.full((n,), float(me + 1))
        tandem.all_reduce(x, group=group)
        return x

    total = float(sum(range(1, len(hosts) + 1)))
    for rank, x in enumerate(run_threads(len(hosts), body, settings=SETTINGS, hosts=hosts)):
        assert_equal(x, torch.full((n,), total), f"rank {rank}: all_reduce")
    for rank in range(len(hosts)):
        if leader[rank] != rank:
            assert len(sent[rank]) > 2, f"rank {rank} sent {sent[rank]} up: not streamed"
            assert sent[rank] == read[rank], (
                f"rank {rank} sent its pieces up in the order {sent[rank]}; its leader, rank "
                f"{leader[rank]}, read them in the order {read[rank]}")
