"""all_reduce through shared staging memory (algorithm "shm") on same-host groups.

Results are compared bit for bit with the reduction computed locally in member
order, for every dtype family and reduce op, sizes from one element to many rounds
(staging forced down to 4 KiB so rounds are many and the last one is partial), with
2 ranks (every member reduces whole rounds) and 3 ranks (each reduces a slice).
"""

from __future__ import annotations

from typing import Any

import pytest

from _shm_arena_ranks import (broadcast_and_gather, coalesced, every_dtype_and_op, late_peer,
                              reduce_scatters, reduces, subgroups_concurrently, without_arena)
from tandem.testing import launch
from tandem.transport._arena import default_chunk

pytestmark = pytest.mark.timeout(180)

SMALL_STAGING = {"TANDEM_SHM_CHUNK": "4096"}  # many rounds, the last one partial


def _values(outcomes: Any) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"--- rank {o.rank} ---\n{o.error}" for o in bad)
    return [o.value for o in outcomes]


@pytest.mark.procs
@pytest.mark.parametrize("p", [2, 3])
def test_every_dtype_and_op_matches_the_member_order_reduction(p: int) -> None:
    for rank, r in enumerate(_values(launch(p, every_dtype_and_op, backend="shm", timeout=150,
                                            env=SMALL_STAGING))):
        assert r["chunk"] == 4096, r
        assert not r["wrong"], f"rank {rank} of {p}: wrong results for {r['wrong']}"


@pytest.mark.procs
def test_subgroups_run_concurrently_each_through_its_own_arena() -> None:
    results = _values(launch(4, subgroups_concurrently, backend="shm", timeout=120))
    for rank, r in enumerate(results):
        assert not r["wrong"], f"rank {rank}: wrong results for {r['wrong']}"
    assert results[0]["shares"] == [True, True]


@pytest.mark.procs
@pytest.mark.parametrize("joined_before", [False, True], ids=["first-call", "later-call"])
def test_a_missing_peer_times_out_naming_it(joined_before: bool) -> None:
    r0 = _values(launch(2, late_peer, (joined_before,), backend="shm", timeout=60))[0]
    assert r0["error"] is not None, "rank 0 did not time out"
    assert r0["missing"] == [1], r0
    assert "shared memory" in r0["error"] and "rank(s) 1" in r0["error"], r0["error"]
    assert r0["elapsed"] < 3.0, r0


@pytest.mark.procs
@pytest.mark.parametrize("backend,p", [("shm", 2), ("shm", 3), ("tcp", 3)])
def test_all_reduce_coalesced_reduces_each_tensor_in_place(backend: str, p: int) -> None:
    outcomes = launch(p, coalesced, (backend == "shm",), backend=backend, timeout=120,
                      env=SMALL_STAGING)  # tensors straddle rounds
    for rank, r in enumerate(_values(outcomes)):
        assert not r["wrong"], f"{backend}, rank {rank} of {p}: wrong results for {r['wrong']}"


@pytest.mark.procs
def test_the_arena_can_be_switched_off_and_shm_is_then_refused_by_name() -> None:
    for r in _values(launch(2, without_arena, backend="shm", env={"TANDEM_SHM_ARENA": "0"})):
        assert (r["shares"], r["arena"], r["ok"]) == (False, False, True), r
        assert "'shm'" in r["refused"] and "TANDEM_SHM_ARENA" in r["refused"], r["refused"]


@pytest.mark.procs
@pytest.mark.parametrize("p", [2, 3])
def test_broadcast_and_all_gather_through_shared_memory(p: int) -> None:
    outcomes = launch(p, broadcast_and_gather, backend="shm", timeout=150, env=SMALL_STAGING)
    for rank, r in enumerate(_values(outcomes)):
        assert not r["wrong"], f"rank {rank} of {p}: wrong results for {r['wrong']}"


@pytest.mark.procs
@pytest.mark.parametrize("p", [2, 3])
def test_reduce_through_shared_memory_gives_the_root_the_member_order_reduction(p: int) -> None:
    outcomes = launch(p, reduces, backend="shm", timeout=150, env=SMALL_STAGING)
    for rank, r in enumerate(_values(outcomes)):
        assert r["arena"], f"rank {rank} of {p}: reduce did not go through the arena"
        assert not r["wrong"], f"rank {rank} of {p}: wrong results for {r['wrong']}"


@pytest.mark.procs
@pytest.mark.parametrize("p", [2, 3])
def test_reduce_scatter_through_shared_memory_matches_the_member_order_reduction(p: int) -> None:
    outcomes = launch(p, reduce_scatters, backend="shm", timeout=150, env=SMALL_STAGING)
    for rank, r in enumerate(_values(outcomes)):
        assert not r["wrong"], f"rank {rank} of {p}: wrong results for {r['wrong']}"


def test_staging_per_member_shrinks_when_many_ranks_share_a_host() -> None:
    # every member maps every member's segment: 64 local ranks must not map 64 x 4 MiB each
    for n in (2, 4, 16, 64, 256):
        chunk = default_chunk(n)
        assert chunk & (chunk - 1) == 0 and chunk >= 256 << 10, (n, chunk)
        assert chunk * n <= 32 << 20 or chunk == 256 << 10, (n, chunk)
    assert default_chunk(64) < default_chunk(4)
