"""Broadcast across hosts whose ranks share memory (``shm_spanning``): real processes,
hosts told apart by ``TANDEM_HOST_ID``, so each host's part goes through its own arena.

Each call must give every rank the root's bytes (the naive oracle) and gloo's result on
the same inputs, for roots that are and are not their host's leader, sizes of one
round and of several (small staging halves), and hosts of one rank, whose part goes by
messages beside the others' arenas. Ranks that disagree on the root must fail in the
call, well before the deadline, with a mismatch.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch, stay_until_reported

from _coll_util import join_on_host, leave_hosts, watch_collective_sends

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

LAYOUTS = {"2x8": "a" * 8 + "b" * 8, "4x4": "aaaabbbbccccdddd",
           "uneven": "aaabbbbbbc", "interleaved": "abababab"}
OP_TIMEOUT = 60.0  # a disagreement found only by the deadline takes this long


def _value(call: int, root: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + call * 100 + root) % 251).to(dtype)


def _oracle_run(rank: int, p: int, hosts: str, store: str,
                calls: list[tuple[int, int, str]]) -> list[str]:
    """Every call's broadcast through tandem and gloo; what differed, by call."""
    import torch.distributed as dist

    join_on_host(rank, p, hosts, store, True, OP_TIMEOUT)
    try:
        wrong = []
        for call, (n, root, dtype_name) in enumerate(calls):
            dtype = getattr(torch, dtype_name)
            mine = _value(call, root, n, dtype)
            ours = mine.clone() if rank == root else torch.zeros(n, dtype=dtype)
            theirs = mine.clone() if rank == root else torch.zeros(n, dtype=dtype)
            tandem.broadcast(ours, src=root)
            dist.broadcast(theirs, src=root)
            if not torch.equal(ours, mine):
                wrong.append(f"call {call} (n={n}, root={root}, {dtype_name}): not the root's")
            if not torch.equal(ours, theirs):
                wrong.append(f"call {call} (n={n}, root={root}, {dtype_name}): not gloo's")
        return wrong
    finally:
        leave_hosts(True)


def _calls(p: int) -> list[tuple[int, int, str]]:
    # roots: a leader, the last rank, ranks inside hosts; 300,001 floats take several
    # rounds of the small staging halves below and several link pieces across hosts
    return [(1, 0, "float32"), (1024, p - 1, "float32"), (1024, 1, "int64"),
            (70_001, 3, "float32"), (0, 2, "float32"), (5, p - 2, "bool"),
            (300_001, 5, "float32"), (300_001, 0, "float64"), (17, 1, "uint8")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_broadcast_through_host_arenas_matches_the_root_and_gloo(layout: str,
                                                                 tmp_path: Any) -> None:
    hosts = LAYOUTS[layout]
    p = len(hosts)
    env = {"TANDEM_SHM_CHUNK": "65536"}  # staging halves of 64 KiB: many rounds per call
    outcomes = launch(p, _oracle_run, (hosts, str(tmp_path), _calls(p)), init=False,
                      timeout=250, env=env)
    bad = {o.rank: (o.value if o.ok else o.error[-2000:]) for o in outcomes
           if not o.ok or o.value}
    assert not bad, bad


def _messages(rank: int, p: int, hosts: str, store: str, roots: list[int]) -> list[list[int]]:
    """The ranks this rank sent a collective message to, in each broadcast from ``roots``."""
    from tandem.collectives.world import world

    join_on_host(rank, p, hosts, store, False, OP_TIMEOUT)
    try:
        sent: list[int] = []
        watch_collective_sends(world().default.transport,
                               lambda peer, _h, _p: sent.append(peer))
        out = []
        for root in roots:
            tandem.broadcast(torch.ones(1 << 16), src=root)  # 256 KiB
            out.append(sorted(set(sent)))
            sent.clear()
        return out
    finally:
        leave_hosts(False)


def test_within_a_host_a_broadcast_sends_no_message_but_the_leaders_confirmation() -> None:
    hosts = "aaaabbbb"
    roots = [0, 2, 5, 4]  # leaders and not
    with tempfile.TemporaryDirectory(prefix="tandem-test-") as tmp:
        outcomes = launch(8, _messages, (hosts, tmp, roots), init=False, timeout=120)
    assert all(o.ok for o in outcomes), [o.error[-2000:] for o in outcomes if not o.ok]
    for k, root in enumerate(roots):
        top = hosts.index(hosts[root])
        within = {(r, q) for r, o in enumerate(outcomes) for q in o.value[k]
                  if hosts[q] == hosts[r]}
        # the root's host's leader confirms its subtree to a root that is not a leader;
        # the data and every other rank's confirmation go through the host's arena
        assert within == ({(top, root)} if root != top else set()), (root, sorted(within))
        across = {(r, q) for r, o in enumerate(outcomes) for q in o.value[k]
                  if hosts[q] != hosts[r]}
        assert across == {(0, 4), (4, 0)}, (root, sorted(across))


def _disagree(rank: int, p: int, hosts: str, store: str, case: str, warm: bool) -> None:
    join_on_host(rank, p, hosts, store, False, OP_TIMEOUT)
    try:
        src = {"each-its-own": rank,
               "two-camps": 0 if rank < 4 else 4,
               "one-host-disagrees": 6 if hosts[rank] == "c" else 0,
               "one-rank-disagrees": 2 if rank == 1 else 0,
               "a-reader-names-itself": rank if rank == 4 else 3}[case]
        if warm:  # the host arenas exist; else the disagreement meets their making
            tandem.broadcast(torch.zeros(4), src=0)
        try:
            tandem.broadcast(torch.full((4,), float(rank)), src=src)
            tandem.barrier()  # a rank whose own call completed fails here
        finally:
            # a rank whose own call completed learns of the abort in its barrier, not of
            # a peer's exit
            stay_until_reported(store, rank, range(p))
    finally:
        leave_hosts(False)


@pytest.mark.parametrize("warm", [True, False], ids=["later-call", "first-call"])
@pytest.mark.parametrize("case", ["each-its-own", "two-camps", "one-host-disagrees",
                                  "one-rank-disagrees", "a-reader-names-itself"])
def test_roots_that_disagree_fail_in_the_call_on_every_rank(case: str, warm: bool,
                                                            tmp_path: Any) -> None:
    hosts = "aaabbbcc"
    outcomes = launch(len(hosts), _disagree, (hosts, str(tmp_path), case, warm), init=False,
                      timeout=OP_TIMEOUT + 60)
    assert all(not o.ok for o in outcomes), [(o.rank, o.ok, o.value) for o in outcomes]
    # every rank names the cause: a peer that raised the mismatch and left is never blamed
    assert all("CollectiveMismatchError" in o.error or "aborted" in o.error
               for o in outcomes), [(o.rank, o.error[-800:]) for o in outcomes
                                    if "CollectiveMismatchError" not in o.error
                                    and "aborted" not in o.error]
    assert any("CollectiveMismatchError" in o.error for o in outcomes)
    # found in the call, not by the deadline
    assert not any("CollectiveTimeoutError" in o.error for o in outcomes), \
        [o.error[-800:] for o in outcomes if "CollectiveTimeoutError" in o.error]
