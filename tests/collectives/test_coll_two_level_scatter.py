"""A large reduce_scatter across hosts reduces within each host in a ring first.

Before, every large reduce_scatter on hosts of consecutive ranks went through the
leaders alone: each leader set aside one receive area per other rank of its host, the
whole message each ((ranks per host - 1) x the message per call: 7 x 16 MB at 2 hosts
x 8), and reduced them by itself. Now, from ``hierarchical.TWO_LEVEL_THRESHOLDS`` ring
thresholds on a host of three ranks or more, each host runs a ring reduce-scatter among
its ranks, each rank copies its reduced piece up to its leader, and only the leaders'
ring crosses hosts (``streamed.two_level_reduce_scatter``).

Threads over loopback claim to be on hosts. Inputs are exact, so every order of
combination gives the naive oracle's bits.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import tandem
from tandem.collectives.algorithms import select
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.testing import run_threads

from _coll_util import assert_equal, rank_input, reduce_locally

pytestmark = pytest.mark.timeout(300)

# small thresholds: two-level from 16 x 4 KB = 64 KB
SMALL = Settings(chunk_bytes=4096, ring_threshold=4096)
TOPOLOGIES = {
    "2x4": list("aaaabbbb"),
    "uneven": list("aaabbbbbc"),  # 3, 5 and a host of one
    "5+3": list("aaaaabbb"),
}


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("op, dtype", [("SUM", torch.float32), ("AVG", torch.float64),
                                       ("MAX", torch.int32), ("BXOR", torch.int64)])
def test_two_level_reduce_scatter_agrees_with_the_naive_oracle(topology: str, op: str,
                                                                dtype: torch.dtype) -> None:
    hosts = TOPOLOGIES[topology]
    p, n = len(hosts), 20011  # odd: no piece nor block splits evenly
    redop = getattr(tandem.ReduceOp, op)
    sizes = [n - 7 * (r % 3) for r in range(p)]  # uneven pieces for the list form

    def body(group: ProcessGroup) -> tuple[str, torch.Tensor, torch.Tensor]:
        name, _ = select.select_reduce_scatter(group, [n] * p, dtype)
        x = rank_input(op, dtype, p * n, group.rank())
        out = torch.zeros(n, dtype=dtype)
        tandem.reduce_scatter_tensor(out, x, op=redop, group=group)
        y = rank_input(op, dtype, sum(sizes), group.rank())
        listed = torch.zeros(sizes[group.rank()], dtype=dtype)
        tandem.reduce_scatter(listed, list(y.split(sizes)), op=redop, group=group)
        return name, out, listed

    total = reduce_locally(op, [rank_input(op, dtype, p * n, r) for r in range(p)])
    total_listed = reduce_locally(op, [rank_input(op, dtype, sum(sizes), r) for r in range(p)])
    starts = [sum(sizes[:r]) for r in range(p)]
    for rank, (name, out, listed) in enumerate(run_threads(p, body, settings=SMALL,
                                                           hosts=hosts, timeout=250,
                                                           op_timeout=200)):
        assert name == "two_level", f"rank {rank} chose {name}"
        assert_equal(out, total[rank * n:(rank + 1) * n], f"rank {rank}: {op} tensor")
        want = total_listed[starts[rank]:starts[rank] + sizes[rank]]
        assert_equal(listed, want, f"rank {rank}: {op} list")


def test_a_leader_makes_far_less_than_one_area_per_other_rank_at_16_mb() -> None:
    """At 2 hosts x 4, 16 MB in per rank, default settings: what a leader allocates for
    the call (receive areas and working memory) stays under one message, where it was
    3 x 16 MB of receive areas (48 MB) beside the leaders' ring's 8 MB."""
    hosts = list("aaaabbbb")
    p, nbytes = len(hosts), 16 << 20
    numel = nbytes // 4
    made: dict[int, int] = {}
    lock = threading.Lock()
    real_empty = torch.empty

    def counting_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        with lock:
            ident = threading.get_ident()
            made[ident] = made.get(ident, 0) + t.numel() * t.element_size()
        return t

    def body(group: ProcessGroup) -> tuple[int, int, bool]:
        x = torch.full((numel,), float(group.rank() + 1))  # 16 MB in, a p-th of it out
        out = torch.zeros(numel // p)
        with lock:
            made[threading.get_ident()] = 0
        tandem.reduce_scatter_tensor(out, x, group=group)
        with lock:
            mine = made[threading.get_ident()]
        return mine, group.scratch_kept(), bool(torch.all(out == sum(range(1, p + 1))))

    torch.empty = counting_empty  # type: ignore[assignment]
    try:
        results = run_threads(p, body, hosts=hosts, timeout=250, op_timeout=200)
    finally:
        torch.empty = real_empty  # type: ignore[assignment]
    assert all(ok for _, _, ok in results), "the reduce_scatter itself went wrong"
    for leader in (0, 4):
        allocated, kept, _ = results[leader]
        assert allocated <= nbytes, f"leader {leader} made {allocated} B for a {nbytes} B call"
        assert kept <= nbytes, f"leader {leader} keeps {kept} B"
