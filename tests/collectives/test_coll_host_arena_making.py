"""Making a host's arena (the first collective that needs it) ends when the group fails.

A host's arena is made by its first rank and handed to the others; a rank waiting for
that hand-over must not wait out the deadline when the group was aborted meanwhile or
a rank died: it fails in the call, within seconds, naming the cause. Real processes,
hosts told apart by ``TANDEM_HOST_ID``: on host b, rank 3 (the arena's maker) stays
out of the call, so rank 4 waits for its hand-over, while rank 5 aborts the group or
dies.

A rank that learnt of the group's abort when its host mates did not (a relay that
missed them) tells them itself as its call fails: waiting for its hand-over, or for its
post in their arena, they fail in the call with that news.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import tandem
from tandem.testing import launch, stay_until_reported, wait_until

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


NEWS = "the news that reached rank 0 but not its host mates"


def _told_alone(rank: int, p: int, store: str, collective: str, warm: bool) -> None:
    os.environ["TANDEM_HOST_ID"] = f"host-{HOSTS[rank]}"
    tandem.init_process_group("auto", init_method=f"file://{store}/tandem", rank=rank,
                              world_size=p, timeout=OP_TIMEOUT)
    try:
        from tandem.collectives.world import default_group
        from tandem.errors import CollectiveMismatchError

        def call() -> None:
            if collective == "broadcast":
                tandem.broadcast(torch.zeros(4), src=0)
            else:
                tandem.scatter(torch.zeros(4), [torch.zeros(4)] * p if rank == 0 else None,
                               src=0)

        if warm:  # the host arenas exist: rank 1 then waits in one, not for its hand-over
            call()
            tandem.barrier()
        g = default_group()
        if rank not in (1, 2):
            # the group's abort as it arrives: every rank but rank 0's host mates has it
            # (a relay that did not reach them), so only rank 0 can tell them
            g.transport.mailbox.abort_group(g.group_id, CollectiveMismatchError(NEWS))
        _mark(store, f"told-{rank}")
        for r in range(p):
            _wait_for(store, f"told-{r}")
        try:
            call()
        finally:
            # stay until every rank has its outcome: a rank leaving tells its failed
            # groups' news on the way out, which would hide a mate never told before
            stay_until_reported(store, rank, range(p))
    finally:
        tandem.destroy_process_group()


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "later-call"])
@pytest.mark.parametrize("collective", ["broadcast", "scatter"])
def test_a_rank_that_learnt_of_the_abort_tells_its_host_mates(collective: str, warm: bool,
                                                              tmp_path: Any) -> None:
    outcomes = launch(len(HOSTS), _told_alone, (str(tmp_path), collective, warm), init=False,
                      timeout=OP_TIMEOUT + 60)
    assert not any(o.ok for o in outcomes), [o.rank for o in outcomes if o.ok]
    # rank 0's mates wait for its hand-over (first call) or its post in their arena:
    # they learn of the abort from rank 0 in the call, not at the deadline
    for o in outcomes[1:3]:
        assert NEWS in o.error, (o.rank, o.error[-1500:])
        assert "CollectiveTimeoutError" not in o.error and "timed out" not in o.error, \
            (o.rank, o.error[-1500:])
