"""A rank in another call than its host mates, where one of the two calls goes through the
host's arena (a barrier's check-in, a broadcast or a scatter across hosts; the default
group's is made at init) and the other moves messages within the host: every rank fails
with the mismatch, naming the odd rank and its call site, well before the deadline.

The scale benchmark's "skip" scenario found the first case: a rank that skipped an
all_reduce sat in its host's arena barrier while its leader waited for its all_reduce
message, and the run timed out naming another rank. Real processes; hosts told apart by
``TANDEM_HOST_ID``: two hosts of two ranks, or of three."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch

pytestmark = [pytest.mark.procs, pytest.mark.timeout(240)]

OP_TIMEOUT = 40.0  # what a wait that misses the mismatch takes


def _line_of(marker: str) -> int:
    """The line of this file whose comment is ``marker``: the call site an error names."""
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


def _message_call(op: str, rank: int, size: int, odd: int) -> None:
    """One collective whose part within a host moves messages (none of them through the
    host's arena), each from its own line; ``..._here``: rooted at the odd rank, which
    then only receives (sends nothing a rank of another call could find)."""
    t = torch.ones(256)
    root = odd if op.endswith("_here") else 0
    if op == "all_reduce":
        tandem.all_reduce(t)  # site-all_reduce
    elif op == "all_gather":
        tandem.all_gather([torch.empty(256) for _ in range(size)], t)  # site-all_gather
    elif op.startswith("gather"):
        out = [torch.empty(256) for _ in range(size)] if rank == root else None
        tandem.gather(t, out, dst=root)  # site-gather
    else:
        tandem.reduce(t, dst=root)  # site-reduce


def _arena_call(arena_op: str, rank: int, size: int) -> None:
    """One collective whose part within a host goes through the host's arena."""
    if arena_op == "barrier":
        tandem.barrier()  # site-barrier
    elif arena_op == "broadcast":
        tandem.broadcast(torch.ones(256), src=0)  # site-broadcast
    else:
        pieces = [torch.ones(256) for _ in range(size)] if rank == 0 else None
        tandem.scatter(torch.empty(256), pieces, src=0)  # site-scatter


def _odd_call(rank: int, size: int, store: str, hosts: str, odd: int, op: str,
              odd_in_barrier: bool, arena_op: str) -> str:
    os.environ["TANDEM_HOST_ID"] = f"host-{hosts[rank]}"
    tandem.init_process_group("auto", init_method=f"file://{store}/tandem", rank=rank,
                              world_size=size, timeout=OP_TIMEOUT)
    try:
        tandem.all_reduce(torch.ones(4))  # every rank past init before the odd call
        if (rank == odd) == odd_in_barrier:
            _arena_call(arena_op, rank, size)
        else:
            _message_call(op, rank, size, odd)
        tandem.barrier()  # a rank whose own call completed fails here
    except Exception as exc:  # noqa: BLE001 - each rank's account is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        tandem.destroy_process_group()
    return "passed"


CASES = [
    # (hosts, odd rank, its role, the others' message call, odd rank in the arena call)
    ("aabb", 3, "skips all_reduce, non-leader", "all_reduce", True),
    ("aabb", 2, "skips all_reduce, leader", "all_reduce", True),
    ("aaabbb", 4, "skips all_gather, non-leader", "all_gather", True),
    ("aaabbb", 1, "skips gather, root's host", "gather", True),
    ("aaabbb", 5, "skips reduce, non-leader", "reduce", True),
    ("aabb", 3, "all_reduce in the others' barrier, non-leader", "all_reduce", False),
    ("aaabbb", 3, "all_gather in the others' barrier, leader", "all_gather", False),
    ("aaabbb", 4, "gather in the others' barrier, non-leader", "gather", False),
    ("aaabbb", 4, "reduce to itself in the others' barrier, non-leader", "reduce_here", False),
    ("aabb", 3, "gather to itself in the others' barrier, non-leader", "gather_here", False),
]
CASES = [(*c, "barrier") for c in CASES] + [
    # the barrier's place taken by another collective through the host's arena
    ("aabb", 3, "skips all_reduce for a broadcast, non-leader", "all_reduce", True,
     "broadcast"),
    ("aaabbb", 5, "skips all_gather for a scatter, non-leader", "all_gather", True,
     "scatter"),
    ("aaabbb", 4, "all_reduce in the others' broadcast, non-leader", "all_reduce", False,
     "broadcast"),
]


@pytest.mark.parametrize("hosts,odd,role,op,odd_in_barrier,arena_op", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_a_rank_in_another_call_than_its_host_arena_mates_is_named_with_its_site(
        hosts: str, odd: int, role: str, op: str, odd_in_barrier: bool, arena_op: str,
        tmp_path: Any) -> None:
    start = time.monotonic()
    outcomes = launch(len(hosts), _odd_call,
                      (str(tmp_path), hosts, odd, op, odd_in_barrier, arena_op),
                      init=False, timeout=OP_TIMEOUT + 60)
    took = time.monotonic() - start
    here = Path(__file__).name
    call, arena_call = f"site-{op.removesuffix('_here')}", f"site-{arena_op}"
    odd_site = f"{here}:{_line_of(arena_call if odd_in_barrier else call)}"
    others_site = f"{here}:{_line_of(call if odd_in_barrier else arena_call)}"
    for o in outcomes:
        assert o.ok, (o.rank, o.error[-1500:])
        said = o.value
        # in the call, or (a rank whose own call completed) in the next, told the cause
        assert said.startswith(("CollectiveMismatchError", "StateError")), (role, o.rank, said)
        assert "collective mismatch" in said, (role, o.rank, said[:800])
        # the odd rank learns where the others were; everyone else where the odd one was
        assert f"rank {odd}" in said or o.rank == odd, (role, o.rank, said[:800])
        assert (others_site if o.rank == odd else odd_site) in said, (role, o.rank, said[:800])
    assert took < OP_TIMEOUT, f"{role}: found only by the deadline ({took:.1f} s)"
