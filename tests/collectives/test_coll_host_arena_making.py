"""Making a host's arena (the first collective that needs it) ends when the group fails.

A host's arena is made by its first rank and handed to the others; a rank waiting for
that hand-over must not wait out the deadline when the group was aborted meanwhile or
a rank died: it fails in the call, within seconds, naming the cause. Real processes,
hosts told apart by ``TANDEM_HOST_ID``: on host b, rank 3 (the arena's maker) stays
out of the call, so rank 4 waits for its hand-over, while rank 5 aborts the group or
dies.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]

HOSTS = "aaabbb"
OP_TIMEOUT = 60.0  # what a wait that misses the failure takes


def _mark(store: str, name: str) -> None:
    open(os.path.join(store, name), "w").close()


def _wait_for(store: str, name: str) -> None:
    wait_until(lambda: os.path.exists(os.path.join(store, name)), name, OP_TIMEOUT)


def _note_the_wait(store: str) -> None:
    """From now on, mark ``waiting-4`` in ``store`` once this rank's wait for a host
    arena's hand-over runs its check (the first time it found no hand-over)."""
    from tandem.collectives.world import default_group

    transport = default_group().transport
    plain = transport.arena

    def arena(key: int, members: Any, chunk: Any = None, timeout: Any = None,
              check: Any = None) -> Any:
        def noted() -> None:
            _mark(store, "waiting-4")
            if check is not None:
                check()
        return plain(key, members, chunk, timeout, noted)

    transport.arena = arena  # type: ignore[method-assign]


def _run(rank: int, p: int, store: str, case: str) -> None:
    os.environ["TANDEM_HOST_ID"] = f"host-{HOSTS[rank]}"
    tandem.init_process_group("auto", init_method=f"file://{store}/tandem", rank=rank,
                              world_size=p, timeout=OP_TIMEOUT)
    # the default group's host arenas are made at init: another group's come by hand-over
    group = tandem.new_group(list(range(p)))
    try:
        if rank == 3:  # the maker stays away until rank 4 has its outcome
            _wait_for(store, "out-4")
            raise RuntimeError("rank 3 stayed out")
        if rank == 5:
            _wait_for(store, "waiting-4")  # rank 4 is waiting for the hand-over
            if case == "death":
                os._exit(3)
            from tandem.collectives.group import ProcessGroup
            from tandem.errors import StateError

            assert isinstance(group, ProcessGroup)
            group.abort(StateError("rank 5 gave up"))
            raise RuntimeError("rank 5 aborted the group")
        if rank == 4:
            _note_the_wait(store)
        try:
            tandem.broadcast(torch.zeros(4), src=0, group=group)
        finally:
            if rank == 4:
                _mark(store, "out-4")
    finally:
        tandem.destroy_process_group()


@pytest.mark.parametrize("case", ["abort", "death"])
def test_a_rank_waiting_for_its_hosts_arena_fails_when_the_group_does(case: str,
                                                                        tmp_path: Any) -> None:
    outcomes = launch(len(HOSTS), _run, (str(tmp_path), case), init=False,
                      timeout=OP_TIMEOUT + 60)
    waiter = outcomes[4]
    assert not waiter.ok, waiter.value
    assert "CollectiveTimeoutError" not in waiter.error, waiter.error[-1500:]
    if case == "abort":
        assert "rank 5 gave up" in waiter.error, waiter.error[-1500:]
    else:
        assert "PeerLostError" in waiter.error and "rank 5" in waiter.error, \
            waiter.error[-1500:]
    assert "timed out" not in waiter.error, waiter.error[-1500:]
