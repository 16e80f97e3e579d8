"""Large RPC tensors over shared memory travel in memory the sender lends
(``tandem.transport._lend``): the received tensor is a view of the sender's segment.
These tests check what that must never change: the bytes, recycling, the sender's
memory bound when the receiver keeps tensors, in-place writes, and tensors that outlive
their sender."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem.rpc as rpc
from tandem.rpc import _state
from tandem.transport._lend import lend_budget

from tests.rpc._rpc_workers import echo, run

pytestmark = [pytest.mark.procs, pytest.mark.timeout(180)]

MB = 1 << 20
KEPT: list[torch.Tensor] = []  # tensors a callee keeps alive (in the callee's process)


def _peer(rank: int) -> Any:
    """This worker's shared-memory connection to ``rank`` (the test asks for shm)."""
    transport: Any = _state.require("test").transport
    return transport._peers[rank]


def _segments(rank: int) -> tuple[int, int]:
    """(segments this worker lends ``rank``, of them lent now)."""
    return _peer(rank).lender.segments()


def _settled(rank: int, lent: int, seconds: float = 10.0) -> tuple[int, int]:
    """Wait until at most ``lent`` segments are lent to ``rank`` (returns come as frames
    read by another thread); the last count."""
    deadline = time.monotonic() + seconds
    while _segments(rank)[1] > lent and time.monotonic() < deadline:
        gc.collect()
        rpc.rpc_sync(f"worker{rank}", gc.collect)  # the peer frees its views, we read
        time.sleep(0.01)
    return _segments(rank)


def _pattern(n: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=dtype)
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


def _shm() -> dict[str, Any]:
    return {"_transports": ["shm"]}


# -- remote functions ----------------------------------------------------------------------
def keep(x: torch.Tensor, seed: int) -> bool:
    """Keep ``x`` alive here; whether it arrived with the expected bytes."""
    KEPT.append(x)
    return bool(torch.equal(x, _pattern(x.numel(), seed)))


def check_kept(seeds: list[int]) -> list[bool]:
    """Whether each kept tensor still holds its bytes (a reused segment would not)."""
    return [bool(torch.equal(t, _pattern(t.numel(), s))) for t, s in zip(KEPT, seeds)]


def drop_kept() -> int:
    n = len(KEPT)
    KEPT.clear()
    gc.collect()
    return n


def bump_and_keep(x: torch.Tensor) -> torch.Tensor:
    """Write into the received tensor, keep it, and send it back."""
    x.add_(1)
    KEPT.append(x)
    return x


def kept_sum() -> float:
    return float(sum(t.sum().item() for t in KEPT))


def big(n: int, seed: int) -> torch.Tensor:
    return _pattern(n, seed)


def pid() -> int:
    return os.getpid()


# -- bodies ---------------------------------------------------------------------------------
def _round_trips(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        x = _pattern(3 * MB // 8 + 5, 1)  # not a multiple of the segment size
        y = rpc.rpc_sync("worker1", echo, args=(x,))
        r["exact"] = bool(torch.equal(x, y)) and y.dtype == x.dtype and y.shape == x.shape
        y.mul_(2)  # an ordinary, writable tensor
        r["doubled"] = bool(torch.equal(y, x * 2))
        mixed = {"a": _pattern(2 * MB, 2, torch.int8), "b": torch.arange(7),
                 "c": _pattern(MB // 2, 3, torch.float32).view(512, -1).t(),  # non-contiguous
                 "d": _pattern(MB, 4, torch.bool)}
        back = rpc.rpc_sync("worker1", echo, args=(mixed,))
        r["mixed"] = {k: bool(torch.equal(back[k], v)) for k, v in mixed.items()}
        r["lent_before_row"] = _segments(1)[0]
        # many in a row, each with other bytes: the same few segments serve them all
        r["row"] = []
        for i in range(40):
            x = _pattern(4 * MB // 8, 100 + i)
            r["row"].append(bool(torch.equal(rpc.rpc_sync("worker1", echo, args=(x,)), x)))
        r["segments_after_row"] = _settled(1, 0)
    rpc.shutdown()
    return r


def test_large_tensors_round_trip_bit_exact_and_recycle_the_lent_memory(tmp_path: Path) -> None:
    r = run(2, _round_trips, tmp_path, **_shm())[0]
    assert r["exact"] and r["doubled"], r
    assert all(r["mixed"].values()), r["mixed"]
    assert r["lent_before_row"] >= 1, "nothing went through lent memory"
    assert all(r["row"]), f"echo {r['row'].index(False)} of 40 came back different"
    segments, lent = r["segments_after_row"]
    # 40 messages of 4 MB: a pool that did not recycle would have made 40 segments more
    # (or stopped lending at its budget); returns are read lazily, so a few are in use
    assert segments - r["lent_before_row"] <= 3 and lent == 0, r


def _receiver_keeps(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        size = 8 * MB
        seeds = list(range(50, 50 + 2 * lend_budget(1) // size))  # twice what may be lent
        r["arrived"] = [rpc.rpc_sync("worker1", keep, args=(_pattern(size // 8, s), s))
                        for s in seeds]
        r["segments_while_kept"] = _segments(1)
        r["still_intact"] = rpc.rpc_sync("worker1", check_kept, args=(seeds,))
        r["dropped"] = rpc.rpc_sync("worker1", drop_kept)
        r["segments_after_drop"] = _settled(1, 0)
        # lending resumes on the returned segments
        x = _pattern(size // 8, 7)
        r["after"] = bool(torch.equal(rpc.rpc_sync("worker1", echo, args=(x,)), x))
        r["segments_at_end"] = _settled(1, 0)
        r["budget"] = lend_budget(1) // size
    rpc.shutdown()
    return r


def _in_flight(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        # more in flight at once than the sender may lend: some go by reference, from
        # several threads of the callee's pool at once
        xs = [_pattern(8 * MB // 8, 300 + i) for i in range(24)]
        futures = [rpc.rpc_async("worker1", echo, args=(x,)) for x in xs]
        r["equal"] = [bool(torch.equal(f.wait(), x)) for f, x in zip(futures, xs)]
        del futures
        r["segments"] = _settled(1, 0)
        r["budget"] = lend_budget(1) // (8 * MB)
    rpc.shutdown()
    return r


def test_many_large_calls_in_flight_arrive_exact_within_the_budget(tmp_path: Path) -> None:
    r = run(2, _in_flight, tmp_path, num_worker_threads=4, **_shm())[0]
    assert all(r["equal"]), f"call {r['equal'].index(False)} of 24 came back different"
    assert 1 <= r["segments"][0] <= r["budget"] and r["segments"][1] == 0, r


def test_a_receiver_that_keeps_many_tensors_does_not_grow_the_senders_memory(
        tmp_path: Path) -> None:
    r = run(2, _receiver_keeps, tmp_path, **_shm())[0]
    assert all(r["arrived"]), f"kept tensor {r['arrived'].index(False)} arrived different"
    assert all(r["still_intact"]), (
        f"kept tensor {r['still_intact'].index(False)} changed: its segment was reused")
    segments, lent = r["segments_while_kept"]
    assert 1 <= segments <= r["budget"] and lent == segments, r["segments_while_kept"]
    assert r["dropped"] == len(r["arrived"])
    assert r["segments_after_drop"][1] == 0, r["segments_after_drop"]
    assert r["after"] and r["segments_at_end"][0] <= r["budget"], r


def _mutated(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        x = torch.zeros(2 * MB // 4)
        got = rpc.rpc_sync("worker1", bump_and_keep, args=(x,))
        r["reply"] = bool(torch.equal(got, torch.ones_like(x)))
        r["sender_untouched"] = bool(torch.equal(x, torch.zeros_like(x)))
        # more messages of that size while the callee holds (and wrote into) the first
        for _ in range(5):
            rpc.rpc_sync("worker1", echo, args=(torch.full_like(x, 5.0),))
        r["kept_sum"] = rpc.rpc_sync("worker1", kept_sum)
        r["expected"] = float(x.numel())
    rpc.shutdown()
    return r


def test_a_received_tensor_written_in_place_keeps_its_values(tmp_path: Path) -> None:
    r = run(2, _mutated, tmp_path, **_shm())[0]
    assert r["reply"] and r["sender_untouched"], r
    assert r["kept_sum"] == r["expected"], (
        f"the callee's tensor changed after it wrote into it: sum {r['kept_sum']}, "
        f"expected {r['expected']} (its segment was filled again)")


def _outlives(rank: int, world: int, n: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    if rank == 0:
        other = rpc.rpc_sync("worker1", pid)
        t = rpc.rpc_sync("worker1", big, args=(n, 9))
        r["lent"] = len(_peer(1).borrowed._maps)
        rpc.shutdown()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the sender's process is gone
            try:
                os.kill(other, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            r["gone"] = False
            return r
        r["gone"] = True
        r["intact"] = bool(torch.equal(t, _pattern(n, 9)))
        t.add_(1)
        r["writable"] = bool(torch.equal(t, _pattern(n, 9) + 1))
    else:
        rpc.shutdown()
    return r


def test_a_received_tensor_stays_valid_after_its_sender_exited(tmp_path: Path) -> None:
    r = run(2, _outlives, tmp_path, 4 * MB // 8 + 3, **_shm())[0]
    assert r["gone"], "the sender's process did not exit"
    assert r["lent"] >= 1, "the tensor did not come in lent memory"
    assert r["intact"] and r["writable"], r
