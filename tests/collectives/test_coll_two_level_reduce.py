"""A large reduce across hosts: rings within each host and among the leaders.

Before, from ``select.LEADERS_BELOW_BYTES`` on a reduce across hosts ran the binomial tree
over all ranks: the whole message crossed log2(ranks) links in a row, and every inner rank
of the tree made two message-sized buffers per call (0.48x gloo at 8 hosts x 8, 16 MB).
Now each host reduces in a ring among its ranks, each rank's reduced piece goes up to its
leader, the leaders' ring reduce-scatters one block per host, and the blocks gather on the
root's host's leader, which hands them to the root (``streamed.two_level_reduce``).

Threads over loopback claim to be on hosts. Inputs are exact, so every order of
combination gives the naive oracle's bits.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

import tandem
from tandem.collectives.algorithms import select
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.testing import run_threads

from _coll_util import assert_equal, rank_input, reduce_locally, same_bits

pytestmark = pytest.mark.timeout(300)

# many small pieces: 4 KB chunks, two-level from 16 KB
SMALL = Settings(chunk_bytes=4096, ring_threshold=4096)
TOPOLOGIES = {
    "2x4": list("aaaabbbb"),
    "uneven": list("aaabbbbbc"),  # 3, 5 and a host of one
    "interleaved": list("aabbbcab"),  # a=[0, 1, 6], b=[2, 3, 4, 7], c=[5]
}
CASES = [("SUM", torch.float32), ("AVG", torch.float64), ("PRODUCT", torch.float64),
         ("MIN", torch.int32), ("MAX", torch.float16), ("BAND", torch.int64),
         ("BOR", torch.uint8), ("BXOR", torch.int16), ("SUM", torch.bfloat16),
         ("SUM", torch.complex64), ("MAX", torch.bool)]


def _roots(hosts: list[str]) -> list[int]:
    """A leader, a non-leader of the first host, and the last rank."""
    return sorted({0, 1, len(hosts) - 1})


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("op, dtype", CASES)
def test_two_level_reduce_agrees_with_the_naive_oracle(topology: str, op: str,
                                                       dtype: torch.dtype,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(select, "LEADERS_BELOW_BYTES", 16 << 10)
    hosts = TOPOLOGIES[topology]
    p, n = len(hosts), 20011  # odd: no piece nor block splits evenly
    redop = getattr(tandem.ReduceOp, op)
    roots = _roots(hosts)

    def body(group: ProcessGroup) -> list[tuple[str, torch.Tensor, bool]]:
        out = []
        for k, root in enumerate(roots):
            x = rank_input(op, dtype, n, group.rank(), salt=k)
            name, _ = select.select_reduce(group, x)
            y = x.clone()
            tandem.reduce(y, dst=root, op=redop, group=group)
            out.append((name, y, same_bits(y, x)))
        return out

    results = run_threads(p, body, settings=SMALL, hosts=hosts, timeout=250, op_timeout=200)
    for k, root in enumerate(roots):
        total = reduce_locally(op, [rank_input(op, dtype, n, r, salt=k) for r in range(p)])
        for rank in range(p):
            name, y, unchanged = results[rank][k]
            assert name == "two_level", f"rank {rank} chose {name}"
            if rank == root:
                assert_equal(y, total, f"root {root}: {op} {dtype}")
            else:
                assert unchanged, f"rank {rank} (root {root}): its input was written into"


def _counting(made: dict[int, int], lock: threading.Lock) -> list[tuple[Any, str, Any]]:
    """Wrappers of what allocates a tensor, adding its bytes to ``made`` by thread."""
    def note(t: torch.Tensor) -> torch.Tensor:
        with lock:
            ident = threading.get_ident()
            if ident in made:
                made[ident] += t.numel() * t.element_size()
        return t

    def wrap(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda *args, **kwargs: note(fn(*args, **kwargs))

    return [(torch, "empty", wrap(torch.empty)), (torch, "empty_like", wrap(torch.empty_like)),
            (torch.Tensor, "clone", wrap(torch.Tensor.clone))]


def test_a_rank_keeps_under_two_messages_and_makes_nothing_after_the_first_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At 2 hosts x 4, 16 MB per rank, default settings, twice: on the first call a rank
    makes at most twice the message (its copy of the input and the rings' scratch, kept),
    on the second almost nothing. The tree made two messages per call on its inner ranks."""
    hosts = list("aaaabbbb")
    p, nbytes = len(hosts), 16 << 20
    numel = nbytes // 4
    made: dict[int, int] = {}
    lock = threading.Lock()
    for owner, name, fn in _counting(made, lock):
        monkeypatch.setattr(owner, name, fn)

    def body(group: ProcessGroup) -> tuple[list[int], int, bool, str]:
        x = torch.full((numel,), float(group.rank() + 1))
        chose, _ = select.select_reduce(group, x)
        calls = []
        for _ in range(2):
            with lock:
                made[threading.get_ident()] = 0
            tandem.reduce(x, dst=1, group=group)  # a non-leader root
            with lock:
                calls.append(made.pop(threading.get_ident()))
        # the second call reduces the root's result of the first again
        want = 2 * sum(range(1, p + 1)) - 2 if group.rank() == 1 else group.rank() + 1
        return calls, group.scratch_kept(), bool(torch.all(x == want)), chose

    results = run_threads(p, body, hosts=hosts, timeout=250, op_timeout=200)
    for rank, (calls, kept, ok, _) in enumerate(results):
        assert ok, f"rank {rank}: the reduce itself went wrong"
        assert calls[0] <= 2 * nbytes, f"rank {rank} made {calls[0]} B for a {nbytes} B call"
        assert calls[1] <= nbytes // 16, f"rank {rank} made {calls[1]} B on its second call"
        assert kept <= 2 * nbytes, f"rank {rank} keeps {kept} B"
    assert all(chose == "two_level" for *_, chose in results), [r[3] for r in results]


def test_the_ring_reduces_from_its_source_without_reading_what_the_buffer_held() -> None:
    """``ring(..., src=x)``: ``x`` left as it was, the buffer's old bytes (NaN here) never
    read, each rank's segment the oracle's; the two-level reduce copies no input first."""
    from tandem.collectives.algorithms.ring import even_bounds, ring

    p, n = 3, 1001
    bounds = even_bounds(n, p)

    def body(group: ProcessGroup) -> tuple[torch.Tensor, bool]:
        x = rank_input("SUM", torch.float64, n, group.rank())
        kept = x.clone()
        buf = torch.full((n,), float("nan"), dtype=torch.float64)
        op = group.new_op("reduce_scatter", "ring from src", "test")
        group.run(op, lambda o: ring(o, buf, bounds, tandem.ReduceOp.SUM, True, False, src=x),
                  False)
        return buf, same_bits(x, kept)

    total = reduce_locally("SUM", [rank_input("SUM", torch.float64, n, r) for r in range(p)])
    for rank, (buf, unchanged) in enumerate(run_threads(p, body, settings=SMALL)):
        a, b = bounds[rank]
        assert unchanged, f"rank {rank}: its source was written into"
        assert_equal(buf[a:b], total[a:b], f"rank {rank}: its segment")
