"""all_to_all across hosts whose ranks share memory (``shm_alltoall.arena_all_to_all``):
real processes, hosts told apart by ``TANDEM_HOST_ID``, so each host's part (the split
table and the pieces) goes through its own arena and only the leaders send messages.

Each call must give every rank the pieces the naive oracle says and gloo's result on
the same inputs, with uneven splits, on even, uneven and interleaved hosts and hosts of
one rank (whose part goes by messages beside the others' arenas); with staging halves
small enough that the received blocks take several rounds and some rows do not fit
(those hosts then move their data by messages); and above ``LEADERS_BELOW_BYTES``,
where every rank sends straight to its peers. Splits that disagree fail on every rank
with the same error; a rank killed mid-loop (a leader or not) is named by every
survivor within seconds, not at the deadline.
"""

from __future__ import annotations

import os
import re
import tempfile
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch, stay_until_reported
from _coll_util import join_on_host, leave_hosts, watch_collective_sends

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

LAYOUTS = {"even": "aaaabbbb", "uneven": "aaabbbbc", "interleaved": "abababab",
           "three": "aabbbccc"}
OP_TIMEOUT = 60.0


def _piece(src: int, dst: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + src * 13 + dst * 3) % 251).to(dtype)


def _split(numel: int, src: int, dst: int) -> int:
    """Elements ``src`` sends ``dst``: uneven, some zero."""
    return (numel * (src + 2 * dst)) % (numel + 1)


def _oracle_run(rank: int, p: int, hosts: str, store: str, sizes: list[int],
                leaders_below: int | None) -> list[str]:
    """all_to_all and all_to_all_single through tandem and gloo; what differed."""
    import torch.distributed as dist

    from tandem.collectives.algorithms import select

    if leaders_below is not None:
        select.LEADERS_BELOW_BYTES = leaders_below
    join_on_host(rank, p, hosts, store, True, OP_TIMEOUT)
    try:
        wrong = []
        for numel in sizes:
            for dtype in (torch.float32, torch.int64, torch.bool):
                sent = [_split(numel, rank, d) for d in range(p)]
                back = [_split(numel, s, rank) for s in range(p)]
                ins = [_piece(rank, d, sent[d], dtype) for d in range(p)]
                want = [_piece(s, rank, back[s], dtype) for s in range(p)]
                ours = [torch.zeros(back[s], dtype=dtype) for s in range(p)]
                tandem.all_to_all(ours, [t.clone() for t in ins])
                what = f"numel {numel} {dtype}"
                wrong += [f"{what}: from rank {s} not the oracle's" for s in range(p)
                          if not torch.equal(ours[s], want[s])]
                # gloo's all_to_all takes pieces of one size only: its _single is the oracle
                out = torch.zeros(sum(back), dtype=dtype)
                theirs = torch.ones(sum(back), dtype=dtype)
                tandem.all_to_all_single(out, torch.cat(ins), back, sent)
                dist.all_to_all_single(theirs, torch.cat(ins), back, sent)
                if not torch.equal(out, torch.cat(want)):
                    wrong.append(f"{what}: all_to_all_single not the oracle's")
                if not torch.equal(out, theirs):
                    wrong.append(f"{what}: all_to_all_single not gloo's")
        return wrong
    finally:
        leave_hosts(True)


# with 16 KiB staging halves: at 200 int64 and 300 float32 the rows fit and some received
# block does not (it waits in scratch memory, and the blocks take two rounds); at 300
# int64 some hosts' rows do not fit (they go by messages) beside hosts whose rows do
# (three hosts); at 900 no host's rows fit
SIZES = [1, 37, 200, 300, 900]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_to_all_through_host_arenas_matches_the_oracle_and_gloo(layout: str,
                                                                    tmp_path: Any) -> None:
    hosts = LAYOUTS[layout]
    env = {"TANDEM_SHM_CHUNK": "16384"}
    outcomes = launch(len(hosts), _oracle_run, (hosts, str(tmp_path), SIZES, None),
                      init=False, timeout=250, env=env)
    bad = {o.rank: (o.value if o.ok else o.error[-2000:]) for o in outcomes
           if not o.ok or o.value}
    assert not bad, bad


def test_all_to_all_above_the_leaders_size_goes_straight_to_peers_after_the_arena_table(
        tmp_path: Any) -> None:
    hosts = LAYOUTS["uneven"]
    # 64 bytes: every call but the empty one sends other hosts more, so goes pairwise
    outcomes = launch(len(hosts), _oracle_run, (hosts, str(tmp_path), [37, 300], 64),
                      init=False, timeout=250)
    bad = {o.rank: (o.value if o.ok else o.error[-2000:]) for o in outcomes
           if not o.ok or o.value}
    assert not bad, bad


def _messages(rank: int, p: int, hosts: str, store: str, numels: list[int]) -> list[list[int]]:
    """The ranks this rank sent a collective message to, in each all_to_all."""
    from tandem.collectives.world import world

    join_on_host(rank, p, hosts, store, False, OP_TIMEOUT)
    try:
        sent: list[int] = []
        watch_collective_sends(world().default.transport, lambda peer, *_: sent.append(peer))
        out = []
        for numel in numels:
            tandem.all_to_all([torch.zeros(numel) for _ in range(p)],
                              [torch.full((numel,), float(d)) for d in range(p)])
            out.append(sorted(set(sent)))
            sent.clear()
        return out
    finally:
        leave_hosts(False)


def test_within_a_host_an_all_to_all_sends_no_message() -> None:
    hosts = "aaaabbbb"
    numels = [1, 1024, 32768]  # 4 B, 4 KiB and 128 KiB a piece
    with tempfile.TemporaryDirectory(prefix="tandem-test-") as tmp:
        outcomes = launch(8, _messages, (hosts, tmp, numels), init=False, timeout=120)
    assert all(o.ok for o in outcomes), [o.error[-2000:] for o in outcomes if not o.ok]
    for k, numel in enumerate(numels):
        pairs = {(r, q) for r, o in enumerate(outcomes) for q in o.value[k]}
        # the split table and the pieces go through each host's arena; only the two
        # leaders send, each to the other
        assert pairs == {(0, 4), (4, 0)}, (numel, sorted(pairs))


def _disagree(rank: int, p: int, hosts: str, store: str) -> str:
    from tandem.errors import CollectiveMismatchError

    join_on_host(rank, p, hosts, store, False, OP_TIMEOUT)
    try:
        # rank 5 expects 3 elements from rank 2, which sends it 2
        back = [3 if (rank, s) == (5, 2) else 2 for s in range(p)]
        try:
            tandem.all_to_all([torch.zeros(n) for n in back], [torch.ones(2) for _ in range(p)])
        except CollectiveMismatchError as exc:
            return str(exc)
        return "no error"
    finally:
        leave_hosts(False)


@pytest.mark.parametrize("layout", ["even", "uneven"])
def test_splits_that_disagree_raise_the_same_error_on_every_rank(layout: str,
                                                                 tmp_path: Any) -> None:
    hosts = LAYOUTS[layout]
    outcomes = launch(len(hosts), _disagree, (hosts, str(tmp_path)), init=False,
                      timeout=OP_TIMEOUT + 60)
    assert all(o.ok for o in outcomes), [o.error[-2000:] for o in outcomes if not o.ok]
    # a rank still waiting when another found the clash may learn it from that rank's
    # abort, which prefixes the same text with "[reported by rank N] "
    texts = {re.sub(r"^\[reported by rank \d+\] ", "", o.value) for o in outcomes}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert "rank 2 sends rank 5 2 elements" in text and "expects 3" in text, text


NOTICED_WITHIN = 5.0  # seconds from a kill to every survivor's error; far below OP_TIMEOUT


def _killed(rank: int, p: int, hosts: str, store: str, victim: int) -> dict[str, Any]:
    import signal
    import time

    join_on_host(rank, p, hosts, store, False, OP_TIMEOUT)
    ins = [torch.ones(1 << 12) for _ in range(p)]
    outs = [torch.empty(1 << 12) for _ in range(p)]
    tandem.all_to_all(outs, ins)  # the arenas exist before anyone dies
    tandem.barrier()
    if rank == victim:
        with open(f"{store}/killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100_000):
            tandem.all_to_all(outs, ins)
    except Exception as exc:  # what each survivor reports, and when
        failure = {"type": type(exc).__name__, "msg": str(exc), "at": time.time()}
    else:
        failure = {"type": None, "msg": "100000 calls with a dead peer", "at": time.time()}
    # stay up: the other survivors' errors are about the victim, not us
    stay_until_reported(store, rank, [r for r in range(p) if r != victim])
    return failure


@pytest.mark.parametrize("victim", [5, 4])  # a rank of host b, then its leader
def test_a_killed_rank_is_named_by_every_survivor_within_seconds(victim: int,
                                                                 tmp_path: Any) -> None:
    hosts = LAYOUTS["even"]
    outcomes = launch(len(hosts), _killed, (hosts, str(tmp_path), victim), init=False,
                      timeout=OP_TIMEOUT + 30)
    killed_at = float((tmp_path / "killed").read_text())
    survivors = {o.rank: o for o in outcomes if o.rank != victim}
    assert all(o.ok for o in survivors.values()), \
        {r: o.error[-1500:] for r, o in survivors.items() if not o.ok}
    for rank, o in survivors.items():
        failure = o.value
        assert failure["type"] is not None and f"rank {victim}" in failure["msg"], (rank, failure)
        assert failure["at"] - killed_at < NOTICED_WITHIN, (rank, failure)
