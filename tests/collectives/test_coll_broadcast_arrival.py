"""A small broadcast across hosts: another host's leader stages the data and confirms
the root on the thread that receives it (``shm_arrival``), not after waking its caller.

Hosts told apart by ``TANDEM_HOST_ID``. The readers of the second host (and its
leader) enter each call before the root broadcasts (marker files the root waits for),
so the leader's host is mostly all in when the data lands: its confirmation must then
leave from the receiving thread (in most calls: a rank may be held up between its
marker and its entry), and every rank must still get the root's bytes. Ranks that
disagree on the root fail in the call (test_coll_broadcast_arena.py, whose cases take
this path too).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch

from _coll_util import watch_collective_sends

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

HOSTS = "aaaabbbb"
CALLS = 20
ROOT_STEP = 2 ** 31 - 1


def _run(rank: int, p: int, store: str) -> tuple[list[bool], list[str]]:
    """(for each confirmation this rank sent: whether from its caller's thread, what
    differed from the root's bytes)."""
    from tandem.collectives.world import world

    os.environ["TANDEM_HOST_ID"] = f"host-{HOSTS[rank]}"
    tandem.init_process_group("auto", init_method=f"file://{store}/tandem", rank=rank,
                              world_size=p, timeout=60)
    try:
        caller = threading.current_thread()
        confirmed: list[bool] = []

        def note(peer: int, header: Any, payload: memoryview) -> None:
            if header.step == ROOT_STEP:
                confirmed.append(threading.current_thread() is caller)

        tandem.broadcast(torch.zeros(1024), src=0)  # the first call makes the host arenas
        watch_collective_sends(world().default.transport, note)
        wrong = []
        others = [r for r in range(p) if HOSTS[r] != HOSTS[0]]
        for call in range(CALLS):
            want = torch.arange(1024, dtype=torch.float32) + call
            t = want.clone() if rank == 0 else torch.zeros(1024)
            if rank in others:
                (Path(store) / f"in-{call}-{rank}").touch()
            elif rank == 0:
                deadline = time.monotonic() + 60
                while not all((Path(store) / f"in-{call}-{r}").exists() for r in others):
                    assert time.monotonic() < deadline, f"call {call}: the others never came"
                    time.sleep(0.001)
            tandem.broadcast(t, src=0)
            if not torch.equal(t, want):
                wrong.append(f"call {call}: not the root's bytes")
        return confirmed, wrong
    finally:
        tandem.destroy_process_group()


def test_another_hosts_leader_confirms_from_the_receiving_thread() -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-test-") as tmp:
        outcomes = launch(len(HOSTS), _run, (tmp,), init=False, timeout=240)
    assert all(o.ok for o in outcomes), [o.error[-2000:] for o in outcomes if not o.ok]
    assert not [w for o in outcomes for w in o.value[1]]
    leader = HOSTS.index("b")
    confirmed = outcomes[leader].value[0]
    assert len(confirmed) == CALLS, confirmed  # one confirmation per call, to the root
    # the host is all in when the data lands, unless a rank that left its marker was
    # held up before entering the call (load): the receiving thread confirms, mostly
    assert sum(confirmed) <= CALLS // 2, f"{sum(confirmed)} of {CALLS} confirmed by the caller"
    # nobody else confirms across hosts: the root's readers post in the arena
    assert all(not o.value[0] for r, o in enumerate(outcomes) if r != leader)
