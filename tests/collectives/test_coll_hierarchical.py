"""Hierarchical all-reduce and broadcast, on threads whose loopback ranks claim to be on hosts.

``run_threads(..., hosts=[...])`` gives every rank a host identity, so the topology
(which ranks share a host) is whatever a test says. Inputs are exact (``_coll_util``),
so the hierarchical result must equal the naive oracle bit for bit, whatever order it
combines in; with random floats it must agree to rounding and be bit-identical on every
rank. Further tests check when ``auto`` picks it, and that only one rank per host sends
across hosts.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import tandem
from tandem.collectives import algorithms as algo
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.testing import run_threads

from _coll_util import (DTYPES, OPS, assert_equal, op_defined, rank_input, reduce_locally,
                        same_bits, short, watch_collective_sends)

pytestmark = pytest.mark.timeout(120)

TOPOLOGIES = {
    "2x2": list("aabb"),
    "3+1": list("aaab"),
    "interleaved": list("abab"),
    "1+4": list("abbbb"),
    "3-hosts": list("aabbbc"),
    "3-ranks": list("abb"),
}
SMALL_CHUNKS = Settings(chunk_bytes=4096)
# leaders use the ring from 4 KiB on: chunked, pipelined ring among the leaders
LEADER_RING = Settings(chunk_bytes=4096, ring_threshold=4096)
BIG = (3 << 20) + 5  # floats: larger than any ring chunk, not divisible by any rank count


def _all_reduce(group: ProcessGroup, x: torch.Tensor, op: tandem.ReduceOp,
                algorithm: str) -> torch.Tensor:
    group.algorithm_override["all_reduce"] = algorithm
    out = x.clone()
    tandem.all_reduce(out, op=op, group=group)
    return out


def _against_oracle(hosts: list[str], cases: list[tuple[str, torch.dtype, int]],
                    settings: Settings = SMALL_CHUNKS) -> None:
    """Run every case hierarchically and naively; both must equal the local reduction."""
    p = len(hosts)

    def body(group: ProcessGroup) -> list[dict[str, torch.Tensor]]:
        out = []
        for op, dtype, numel in cases:
            x = rank_input(op, dtype, numel, group.rank())
            redop = getattr(tandem.ReduceOp, op)
            out.append({a: _all_reduce(group, x, redop, a) for a in ("naive", "hierarchical")})
        return out

    results = run_threads(p, body, settings=settings, hosts=hosts)
    for c, (op, dtype, numel) in enumerate(cases):
        expected = reduce_locally(op, [rank_input(op, dtype, numel, r) for r in range(p)])
        for rank in range(p):
            what = (f"rank {rank} on hosts {''.join(hosts)}: all_reduce(hierarchical, {op}, "
                    f"{short(dtype)}, {numel} elements)")
            assert_equal(results[rank][c]["hierarchical"], expected, f"{what} vs local reduction")
            assert_equal(results[rank][c]["hierarchical"], results[rank][c]["naive"],
                         f"{what} vs the naive oracle")


@pytest.mark.parametrize("numel", [0, 1, 7, 1000, 100003])
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_hierarchical_agrees_with_naive_oracle_on_every_topology(topology: str, numel: int) -> None:
    cases = [("SUM", torch.float32, numel), ("MAX", torch.int32, numel),
             ("AVG", torch.float64, numel)]
    _against_oracle(TOPOLOGIES[topology], cases)


DEFINED = [(op, d) for op in OPS for d in DTYPES if op_defined(op, d)]


@pytest.mark.parametrize("op,dtype", DEFINED, ids=[f"{o}-{short(d)}" for o, d in DEFINED])
def test_every_reduce_op_and_dtype_is_exact(op: str, dtype: torch.dtype) -> None:
    # 3 hosts of 2, 1 and 2 ranks; 2053 elements: not divisible by 5 ranks or 3 leaders
    _against_oracle(list("aabcc"), [(op, dtype, 2053)])


@pytest.mark.parametrize("settings", [SMALL_CHUNKS, LEADER_RING], ids=["doubling", "ring"])
def test_leaders_all_reduce_with_doubling_or_ring(settings: Settings) -> None:
    cases = [(op, torch.float32, 10007) for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX")]
    cases += [(op, torch.int64, 10007) for op in ("BAND", "BOR", "BXOR")]
    _against_oracle(list("aabbbcc"), cases, settings)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_streamed_all_reduce_agrees_with_naive_oracle_on_every_topology(topology: str) -> None:
    # ring among the leaders from 4 KiB: the leaders' ring pulls and pushes local chunks
    cases = [("SUM", torch.float32, 100003), ("AVG", torch.float64, 20011),
             ("MAX", torch.int32, 20011), ("PRODUCT", torch.float32, 5003)]
    _against_oracle(TOPOLOGIES[topology], cases, LEADER_RING)


def test_streamed_random_floats_are_bit_identical_on_every_rank() -> None:
    hosts = list("aaabbc")

    def body(group: ProcessGroup) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(group.rank())
        return [_all_reduce(group, torch.randn(100003, generator=g), op, "hierarchical")
                for op in (tandem.ReduceOp.SUM, tandem.ReduceOp.AVG)]

    results = run_threads(len(hosts), body, settings=LEADER_RING, hosts=hosts)
    for rank in range(1, len(hosts)):
        for got, ref in zip(results[rank], results[0]):
            assert same_bits(got, ref), f"rank {rank} differs from rank 0"


def test_streamed_all_reduce_moves_a_large_buffer_within_a_host_in_the_rings_chunks() -> None:
    # not one whole-buffer message up and one down: each chunk goes up when the ring
    # needs it and comes down when it is final (2 leaders: 2 segments of 8 chunks)
    hosts = list("aabb")

    def body(group: ProcessGroup) -> list[tuple[int, int]]:
        seen: list[tuple[int, int]] = []
        me = group.transport.rank

        def note(peer: int, _header: Any, payload: memoryview) -> None:
            if hosts[peer] == hosts[me]:
                seen.append((peer, len(payload)))

        watch_collective_sends(group.transport, note)
        tandem.all_reduce(torch.ones(1 << 18), group=group)
        return seen

    within = run_threads(len(hosts), body, settings=LEADER_RING, hosts=hosts)
    for rank, leader in ((1, 0), (3, 2)):
        assert [p for p, _ in within[rank]] == [leader] * 16, within[rank]
        assert [p for p, _ in within[leader]] == [rank] * 16, within[leader]
        assert {n for _, n in within[rank]} == {(1 << 18) * 4 // 16}


@pytest.mark.parametrize("hosts", ["aaaaabbbbb", "aaabbbbbbc"])
def test_a_leader_takes_in_under_three_buffers_from_its_host_not_one_per_rank(hosts: str) -> None:
    # with three or more ranks on a host, the host reduces in a ring before its leader
    # sees anything: the leader takes in 3 (R-1)/R of the buffer from its host (ring
    # reduce-scatter, pieces up, ring all-gather), where taking every rank's whole
    # buffer was R-1 of them (7 x 16 MB at 8 ranks per host)
    numel = 1 << 16

    def body(group: ProcessGroup) -> tuple[int, torch.Tensor]:
        taken, me = [0], group.transport.rank

        def note(peer: int, _header: Any, payload: memoryview) -> None:
            if hosts[peer] == hosts[me] and hosts.index(hosts[peer]) == peer:  # its leader
                taken[0] += len(payload)

        watch_collective_sends(group.transport, note)
        x = rank_input("SUM", torch.float32, numel, group.rank())
        tandem.all_reduce(x, group=group)
        return taken[0], x

    results = run_threads(len(hosts), body, settings=LEADER_RING, hosts=list(hosts))
    expected = reduce_locally("SUM", [rank_input("SUM", torch.float32, numel, r)
                                      for r in range(len(hosts))])
    for rank, (_, got) in enumerate(results):
        assert_equal(got, expected, f"rank {rank} on hosts {hosts}: all_reduce")
    for host in sorted(set(hosts)):
        leader, count = hosts.index(host), hosts.count(host)
        if count < 3:
            continue
        sent_up = sum(results[r][0] for r in range(len(hosts)) if hosts[r] == host)
        assert sent_up < 3 * numel * 4, (
            f"host {host} ({count} ranks) sent its leader (rank {leader}) {sent_up} bytes "
            f"for a {numel * 4}-byte all_reduce; under three buffers were expected")


def test_three_million_and_five_floats() -> None:
    _against_oracle(list("aabb"), [("SUM", torch.float32, BIG), ("AVG", torch.float32, BIG)],
                    Settings())


def test_random_floats_are_bit_identical_on_every_rank_and_close_to_the_exact_sum() -> None:
    hosts = list("aaabbc")

    def inputs(rank: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(rank)
        return [torch.randn(100003, generator=g), torch.randn(5003, generator=g).bfloat16()]

    def body(group: ProcessGroup) -> list[torch.Tensor]:
        return [_all_reduce(group, x, tandem.ReduceOp.SUM, "hierarchical")
                for x in inputs(group.rank())]

    results = run_threads(len(hosts), body, settings=SMALL_CHUNKS, hosts=hosts)
    for rank in range(1, len(hosts)):
        for got, ref in zip(results[rank], results[0]):
            assert same_bits(got, ref), (
                f"rank {rank}: all_reduce(hierarchical, SUM, {short(got.dtype)}) differs from "
                f"rank 0 in {(got != ref).sum().item()} elements")
    exact = torch.stack([inputs(r)[0].double() for r in range(len(hosts))]).sum(0).float()
    torch.testing.assert_close(results[0][0], exact)


@pytest.mark.parametrize("hosts, numel, settings", [
    ("abba", 3001, Settings()),            # phases in a row
    ("aabbb", 30001, LEADER_RING),         # streamed through the leaders
], ids=["in-a-row", "streamed"])
def test_custom_reduce_op(hosts: str, numel: int, settings: Settings) -> None:
    gcd = tandem.ReduceOp.custom(torch.gcd, "GCD")
    inputs = [torch.randint(1, 10**6, (numel,), generator=torch.Generator().manual_seed(r)) * 6
              for r in range(len(hosts))]

    def body(group: ProcessGroup) -> torch.Tensor:
        return _all_reduce(group, inputs[group.rank()], gcd, "hierarchical")

    expected = inputs[0]
    for x in inputs[1:]:
        expected = torch.gcd(expected, x)
    for rank, got in enumerate(run_threads(len(hosts), body, settings=settings,
                                           hosts=list(hosts))):
        assert_equal(got, expected, f"rank {rank}: all_reduce(hierarchical, custom GCD)")


def _chosen(hosts: list[str] | None, p: int, numel: int = 10,
            override: str | None = None) -> list[str]:
    def body(group: ProcessGroup) -> str:
        if override:
            group.algorithm_override["all_reduce"] = override
        return algo.select_all_reduce(group, torch.zeros(numel))[0]

    return run_threads(p, body, hosts=hosts)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("numel", [10, 1 << 20])
def test_auto_picks_hierarchical_when_ranks_share_some_hosts(topology: str, numel: int) -> None:
    hosts = TOPOLOGIES[topology]
    assert _chosen(hosts, len(hosts), numel) == ["hierarchical"] * len(hosts)


@pytest.mark.parametrize("hosts", [None, list("aaaa"), list("abcd"), ["a", "a", "", "b"]],
                         ids=["unknown", "one-host", "one-rank-per-host", "one-unknown"])
def test_auto_keeps_the_flat_algorithms_otherwise(hosts: list[str] | None) -> None:
    assert set(_chosen(hosts, 4)) == {"doubling"}
    assert set(_chosen(hosts, 4, numel=1 << 20)) == {"ring"}


def test_a_forced_algorithm_wins_over_the_topology() -> None:
    assert set(_chosen(list("aabb"), 4, override="ring")) == {"ring"}


@pytest.mark.parametrize("hosts", [list("aaaa"), list("abcd")], ids=["one-host", "distinct"])
def test_forced_hierarchical_on_a_flat_topology_runs_the_flat_algorithm(hosts: list[str]) -> None:
    _against_oracle(hosts, [("SUM", torch.float32, 1001), ("AVG", torch.float64, 20000)])


def test_subgroup_uses_the_hosts_of_its_own_members() -> None:
    # world hosts aabbc; the group of global ranks [4, 1, 2, 3] is on hosts c, a, b, b:
    # group rank 0 is alone on c, and b holds group ranks 2 and 3
    hosts, members = list("aabbc"), [4, 1, 2, 3]

    def body(world: ProcessGroup) -> Any:
        if world.transport.rank not in members:
            return None
        g = ProcessGroup(world.transport, members, 7, "sub", world.timeout, world.settings,
                         "loopback")
        layout = algo.host_layout(g)
        x = rank_input("SUM", torch.float32, 999, g.rank())
        tandem.all_reduce(x, group=g)
        return layout, algo.select_all_reduce(g, x)[0], x

    expected = reduce_locally("SUM", [rank_input("SUM", torch.float32, 999, r) for r in range(4)])
    for rank, got in enumerate(run_threads(len(hosts), body, hosts=hosts)):
        if rank in members:
            layout, chosen, x = got
            assert layout == [[0], [1], [2, 3]], f"rank {rank}: layout {layout}"
            assert chosen == "hierarchical"
            assert_equal(x, expected, f"rank {rank}: all_reduce on subgroup {members}")


def _cross_host_senders(hosts: list[str], call: Callable[[ProcessGroup], None]) -> set[int]:
    """The ranks that sent collective data to another host while ``call`` ran."""

    def body(group: ProcessGroup) -> set[int]:
        senders: set[int] = set()
        me = group.transport.rank

        def note(peer: int, _header: Any, _payload: memoryview) -> None:
            if hosts[peer] != hosts[me]:
                senders.add(me)

        watch_collective_sends(group.transport, note)
        call(group)
        return senders

    return set().union(*run_threads(len(hosts), body, hosts=hosts))


def test_only_each_hosts_leader_sends_across_hosts() -> None:
    hosts = list("abababc")

    def call(group: ProcessGroup) -> None:
        for numel in (10, 100003):  # doubling and ring among the leaders
            tandem.all_reduce(torch.ones(numel), group=group)
        tandem.all_reduce(torch.ones(1 << 20), group=group)  # streamed through the leaders

    assert _cross_host_senders(hosts, call) == {0, 1, 6}


def _broadcast(group: ProcessGroup, buf: torch.Tensor, root: int) -> None:
    op = group.new_op("broadcast", f"broadcast root={root}", "test")
    group.run(op, lambda o: algo.hierarchical_broadcast(o, buf, root), False)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_hierarchical_broadcast_from_every_root(topology: str) -> None:
    hosts = TOPOLOGIES[topology]
    p = len(hosts)

    def body(group: ProcessGroup) -> list[torch.Tensor]:
        out = []
        for root in range(p):
            for numel in (0, 1, 1001):
                buf = rank_input("SUM", torch.float32, numel, group.rank(), salt=root)
                _broadcast(group, buf, root)
                out.append(buf)
        return out

    results = run_threads(p, body, hosts=hosts)
    for rank in range(p):
        got = iter(results[rank])
        for root in range(p):
            for numel in (0, 1, 1001):
                want = rank_input("SUM", torch.float32, numel, root, salt=root)
                assert_equal(next(got), want, f"rank {rank}: broadcast of {numel} from {root}")


def test_hierarchical_broadcast_crosses_hosts_once_per_host() -> None:
    hosts = list("aabbbc")

    def call(group: ProcessGroup) -> None:
        _broadcast(group, torch.ones(100), 3)  # root 3 hands it to its host's leader, 2

    senders = _cross_host_senders(hosts, call)
    # that leader sends the data to the leaders 0 and 5, which confirm to it
    assert senders == {0, 2, 5}, senders
