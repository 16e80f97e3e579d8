"""Across hosts, only each host's leader (its lowest rank) sends or receives, whichever
rank a broadcast's root is, so lazily made connections stay O(hosts) per host; and a rooted
call's root hears from a few ranks, not from the whole group.

Nothing moves between processes: every rank of a layout runs the call on the dispatch
oracle's stand-in group, whose transport completes each message at once, here
recording its two ends. Barriers also run on threads, one rank late in turn.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import pytest
import torch

import tandem
from test_coll_dispatch import _Group as _InlineGroup
from test_coll_dispatch import _Transport as _Inline

from tandem.collectives import api, barriers
from tandem.collectives.algorithms import select
from tandem.collectives.group import ProcessGroup
from tandem.config import Settings
from tandem.testing import RankFailed, run_threads
from tandem.transport.message import Slot

pytestmark = pytest.mark.timeout(300)

LAYOUTS = {"2x8": "a" * 8 + "b" * 8, "4x4": "aaaabbbbccccdddd",
           "8x8": "".join(h * 8 for h in "abcdefgh"), "uneven": "aaabbbbbc", "3+1": "aaab"}


class _Recording(_Inline):
    """The dispatch oracle's stand-in transport, recording each message's two ends."""

    def __init__(self, rank: int, hosts: str, pairs: set[tuple[int, int]]) -> None:
        super().__init__(rank, hosts)
        self.pairs = pairs

    def isend(self, to: int, header: Any, view: memoryview) -> Slot:
        self.pairs.add((self.rank, to))
        return super().isend(to, header, view)

    def irecv(self, frm: int, *args: Any) -> Slot:
        self.pairs.add((frm, self.rank))
        return super().irecv(frm, *args)


def _pairs(hosts: str, call: Callable[[ProcessGroup], Any]) -> set[tuple[int, int]]:
    pairs: set[tuple[int, int]] = set()
    for rank in range(len(hosts)):
        g = _InlineGroup(rank, hosts, False, Settings())
        g.transport = _Recording(rank, hosts, pairs)  # type: ignore[assignment]
        call(g)
    return pairs


def _entries(hosts: str, root: int | None) -> set[int]:
    """Each host's entry: the root on its host, else the host's lowest rank."""
    out: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        out.setdefault(host, rank)
    if root is not None:
        out[hosts[root]] = root
    return set(out.values())


def _across(hosts: str, pairs: set[tuple[int, int]]) -> set[tuple[int, int]]:
    return {(a, b) for a, b in pairs if hosts[a] != hosts[b]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_barrier_crosses_hosts_between_leaders_only(layout: str) -> None:
    hosts = LAYOUTS[layout]
    across = _across(hosts, _pairs(hosts, lambda g: barriers.barrier(group=g)))
    entries = _entries(hosts, None)
    assert across and {r for pair in across for r in pair} <= entries, sorted(across)


@pytest.mark.parametrize("layout", ["2x8", "uneven", "3+1"])
def test_barrier_across_hosts_waits_for_every_rank(layout: str) -> None:
    """Each rank of each host, late in turn, holds every other rank in the barrier."""
    hosts = list(LAYOUTS[layout])
    p = len(hosts)
    entered = [0] * p  # rounds each rank has entered
    lock = threading.Lock()

    def body(group: ProcessGroup) -> list[int]:
        r = group.rank()
        seen = []
        for late in range(p):
            if r == late:
                time.sleep(0.05)  # the late rank: the others must still be waiting for it
            with lock:
                entered[r] += 1
            tandem.barrier(group=group)
            with lock:
                seen.append(min(entered))  # every rank entered this round's barrier
        return seen

    results = run_threads(p, body, hosts=hosts, timeout=250, op_timeout=120)
    assert all(seen[i] >= i + 1 for seen in results for i in range(p)), results


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 1024, 1 << 18])
def test_broadcast_crosses_hosts_between_leaders_only(layout: str, n: int) -> None:
    hosts = LAYOUTS[layout]
    leaders = _entries(hosts, None)
    for root in sorted({0, 1, len(hosts) - 1}):
        pairs = _pairs(hosts, lambda g: api.broadcast(torch.zeros(n), group_src=root, group=g))
        across = _across(hosts, pairs)
        assert {r for pair in across for r in pair} <= leaders, (root, sorted(across))
        # the root check goes through the leaders: the root hears from its host's leader
        # alone, or, being that leader, from its host's other ranks and the other leaders
        told = {a for a, b in pairs if b == root}
        bound = 1 if root not in leaders else hosts.count(hosts[root]) - 1 + len(leaders) - 1
        assert 0 < len(told) <= bound, (root, sorted(told))


UNROOTED = {
    "all_reduce": lambda g, n: api.all_reduce(torch.ones(n), group=g),
    "all_gather": lambda g, n: api.all_gather([torch.zeros(n) for _ in range(g.group_size)],
                                              torch.ones(n), group=g),
    "all_gather_into_tensor": lambda g, n: api.all_gather_into_tensor(
        torch.zeros(n * g.group_size), torch.ones(n), group=g),
    "reduce_scatter": lambda g, n: api.reduce_scatter(
        torch.zeros(n), [torch.ones(n) for _ in range(g.group_size)], group=g),
    "reduce_scatter_tensor": lambda g, n: api.reduce_scatter_tensor(
        torch.zeros(n), torch.ones(n * g.group_size), group=g),
}


@pytest.mark.parametrize("layout", ["2x8", "4x4", "uneven"])
@pytest.mark.parametrize("name", UNROOTED)
def test_unrooted_collectives_cross_hosts_between_leaders_only(layout: str, name: str) -> None:
    """What the scale benchmark runs, small (doubling/tree) and large (streamed through
    the leaders): with connections made on first use, O(hosts) of them per host."""
    hosts = LAYOUTS[layout]
    for n in [1, 1024, 1 << 18]:
        across = _across(hosts, _pairs(hosts, lambda g: UNROOTED[name](g, n)))
        assert across and {r for pair in across for r in pair} <= _entries(hosts, None), (
            n, sorted(across))


# all_to_all's split check reads the sizes other ranks sent, which this stand-in does not
# move: it is checked on simulated hosts (tests/scale/test_scale_leaders.py)
ROOTED = {
    "reduce": lambda g, n, root: api.reduce(torch.ones(n), group_dst=root, group=g),
    "gather": lambda g, n, root: api.gather(
        torch.ones(n), [torch.zeros(n) for _ in range(g.group_size)] if g.group_rank == root
        else None, group_dst=root, group=g),
    "scatter": lambda g, n, root: api.scatter(
        torch.zeros(n), [torch.ones(n) for _ in range(g.group_size)] if g.group_rank == root
        else None, group_src=root, group=g),
}


@pytest.mark.parametrize("layout", ["2x8", "4x4", "uneven", "3+1"])
@pytest.mark.parametrize("name", ROOTED)
def test_reduce_gather_scatter_cross_hosts_between_leaders_only(layout: str, name: str) -> None:
    """Whichever rank the root is, data and root checks alike: O(hosts) connections."""
    hosts = LAYOUTS[layout]
    leaders = _entries(hosts, None)
    for root in sorted({0, 1, len(hosts) - 1}):
        pairs = _pairs(hosts, lambda g: ROOTED[name](g, 1000, root))
        across = _across(hosts, pairs)
        assert across and {r for pair in across for r in pair} <= leaders, (root, sorted(across))


ROOTED_CALLS = {
    "reduce": lambda g, root: tandem.reduce(torch.ones(4), dst=root, group=g),
    "gather": lambda g, root: tandem.gather(
        torch.ones(4), [torch.empty(4) for _ in range(g.size())] if g.rank() == root else None,
        dst=root, group=g),
    "scatter": lambda g, root: tandem.scatter(
        torch.empty(4), [torch.ones(4)] * g.size() if g.rank() == root else None, src=root,
        group=g),
}
# the root each rank names, by rank: each itself; a leader against the rest naming a
# non-leader of another host
DISAGREEMENTS = {"each-its-own": [0, 1, 2, 3], "two-camps": [0, 3, 3, 3]}


@pytest.mark.parametrize("name", list(ROOTED_CALLS))
@pytest.mark.parametrize("roots", list(DISAGREEMENTS))
def test_roots_that_disagree_across_hosts_fail_on_every_rank_within_seconds(
        name: str, roots: str) -> None:
    """Through the leaders' root check: a mismatch, never the deadline (40 s)."""
    def body(g: ProcessGroup) -> None:
        ROOTED_CALLS[name](g, DISAGREEMENTS[roots][g.rank()])
        tandem.barrier(group=g)  # a rank whose own part completed learns here

    with pytest.raises(RankFailed) as failed:
        run_threads(4, body, timeout=20, op_timeout=40, hosts=list("aabb"))
    text = str(failed.value)
    for rank in range(4):
        assert f"--- rank {rank} ---" in text, (name, roots, rank, text[-2000:])
        part = text.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "CollectiveMismatchError" in part or "mismatch" in part, (name, roots, rank, part)


# uneven and interleaved hosts: a=[0, 1, 6], b=[2, 3, 4, 7], c=[5] (a host's block is then
# no run of consecutive ranks, and one host has a single rank)
ORACLE_HOSTS = list("aabbbcab")


def _piece(src: int, dst: int, numel: int) -> torch.Tensor:
    """What rank ``src`` sends rank ``dst``: distinct per pair, sizes differing, some empty."""
    k = (numel * (src + 2 * dst)) % (numel + 1)
    return torch.arange(k, dtype=torch.float64) + 1000 * src + 100_000 * dst


@pytest.mark.parametrize("numel", [1, 37, 5000])
def test_scatter_through_leaders_matches_the_oracle_from_every_root(numel: int) -> None:
    """Each host's pieces cross in one message and are handed down as views of it: every
    rank gets its own piece, whichever rank (leader, not, alone on its host) is the root."""
    p = len(ORACLE_HOSTS)

    def body(g: ProcessGroup) -> list[str]:
        assert select.select_scatter(g, torch.empty(numel))[0] == "leaders"
        wrong = []
        for root in range(p):
            parts = [torch.arange(numel, dtype=torch.float64) + 1000 * q + root for q in range(p)]
            out = torch.full((numel,), -1.0, dtype=torch.float64)
            tandem.scatter(out, parts if g.rank() == root else None, src=root, group=g)
            if not torch.equal(out, parts[g.rank()]):
                wrong.append(f"rank {g.rank()} from root {root}: {out[:4].tolist()}")
        return wrong

    got = run_threads(p, body, timeout=120, op_timeout=60, hosts=ORACLE_HOSTS)
    assert not [w for ws in got for w in ws], got


@pytest.mark.parametrize("numel", [1, 37, 5000])
def test_all_to_all_through_leaders_matches_the_oracle_with_uneven_splits(numel: int) -> None:
    p = len(ORACLE_HOSTS)

    def body(g: ProcessGroup) -> list[str]:
        assert select.select_all_to_all(g)[0] == "leaders"
        me = g.rank()
        ins = [_piece(me, d, numel) for d in range(p)]
        outs = [torch.full_like(_piece(s, me, numel), -1.0) for s in range(p)]
        tandem.all_to_all(outs, ins, group=g)
        wrong = [f"rank {me} from {s}" for s in range(p)
                 if not torch.equal(outs[s], _piece(s, me, numel))]
        back = [_piece(s, me, numel).numel() for s in range(p)]
        out = torch.full((sum(back),), -1.0, dtype=torch.float64)
        tandem.all_to_all_single(out, torch.cat(ins), back, [t.numel() for t in ins], group=g)
        if not torch.equal(out, torch.cat([_piece(s, me, numel) for s in range(p)])):
            wrong.append(f"rank {me} all_to_all_single")
        return wrong

    got = run_threads(p, body, timeout=120, op_timeout=60, hosts=ORACLE_HOSTS)
    assert not [w for ws in got for w in ws], got


def test_a_scatter_leader_hands_down_before_its_ranks_confirm_the_root() -> None:
    """Rank 3 (host b, not its leader) enters the scatter only once its leader, rank 2,
    sent it its piece: the leader passes data on first and checks its ranks after, so a
    rank that is late (descheduled on a busy host) does not hold up its host's data."""
    handed = threading.Event()

    def body(g: ProcessGroup) -> bool:
        me = g.rank()
        if me == 2:
            send = g.transport.isend

            def watched(to: int, header: Any, view: memoryview) -> Slot:
                if to == 3 and len(view):
                    handed.set()
                return send(to, header, view)
            g.transport.isend = watched  # type: ignore[method-assign]
        if me == 3 and not handed.wait(10.0):
            return False
        out = torch.empty(4)
        parts = [torch.full((4,), float(q)) for q in range(4)]
        tandem.scatter(out, parts if me == 0 else None, src=0, group=g)
        return torch.equal(out, parts[me])

    assert run_threads(4, body, timeout=60, op_timeout=30, hosts=list("aabb")) == [True] * 4
