"""The flight recorder keeps each group's last calls with what, where, how big and how far.

Ranks run as threads over the loopback transport (``run_threads``): milliseconds each.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import torch

import tandem
from tandem.collectives import api, barriers, p2p
from tandem.collectives.group import ProcessGroup
from tandem.collectives.recorder import COMPLETED, FAILED, STARTED, Call
from tandem.config import Settings
from tandem.errors import CollectiveMismatchError
from tandem.testing import run_threads


def _calls(g: ProcessGroup) -> list[Call]:
    return g.recorder.calls()


def test_every_collective_is_recorded_with_its_signature_site_size_and_times() -> None:
    def body(g: ProcessGroup) -> list[Call]:
        api.all_reduce(torch.ones(1024), group=g)  # 4 KB
        api.broadcast(torch.ones(8, dtype=torch.float64), src=0, group=g)
        barriers.barrier(group=g)
        return _calls(g)

    for calls in run_threads(2, body):
        assert [(c.seq, c.op, c.state) for c in calls] == [
            (0, "all_reduce", COMPLETED), (1, "broadcast", COMPLETED), (2, "barrier", COMPLETED)]
        reduce, bcast, barrier = calls
        assert reduce.sig.startswith(b"all_reduce float32[1024] op=SUM"), reduce.sig
        assert reduce.site.decode().startswith("test_coll_recorder.py:"), reduce.site
        assert (reduce.nbytes, bcast.nbytes, barrier.nbytes) == (4096, 64, 0)
        for c in calls:
            assert 0 < c.t_queued <= c.t_start <= c.t_end, c.what()
            assert c.error == "" and c.peer == -1


def test_the_ring_keeps_the_last_n_calls_of_a_group() -> None:
    def body(g: ProcessGroup) -> list[int]:
        for _ in range(7):
            api.all_reduce(torch.ones(2), group=g)
        return [c.seq for c in _calls(g)]

    assert run_threads(2, body, settings=Settings(flight_recorder=3)) == [[4, 5, 6]] * 2


def test_the_rings_grow_with_the_calls_recorded_up_to_their_length() -> None:
    # a group made and not yet used holds no slots (2,000 each of collectives and
    # point-to-point, made at creation, cost each rank page faults at start-up); the
    # rings fill as calls come, and a full ring keeps its length and its last calls
    def body(g: ProcessGroup) -> Any:
        recorder = g.recorder
        start = len(recorder.ring), len(recorder._p2p)
        for n in range(3):
            api.all_reduce(torch.ones(2), group=g)
            if g.rank() == 0:
                p2p.send(torch.ones(2), dst=1, group=g)
            else:
                p2p.recv(torch.empty(2), src=0, group=g)
        grown = len(recorder.ring), len(recorder._p2p)
        for n in range(10):
            api.all_reduce(torch.ones(2), group=g)
        seqs = [c.seq for c in _calls(g) if not c.is_p2p]
        return start, grown, len(recorder.ring), seqs[0], len(seqs), recorder.issued

    for start, grown, full, first, kept, issued in run_threads(
            2, body, settings=Settings(flight_recorder=8)):
        assert start == (0, 0), start
        assert grown == (3, 3) and full == 8, (grown, full)
        assert kept == 8 and first == issued - 8, (first, kept, issued)


def test_recording_off_keeps_nothing_and_counts_nothing() -> None:
    def body(g: ProcessGroup) -> Any:
        api.all_reduce(torch.ones(2), group=g)
        return _calls(g), g.recorder.totals(), g.recorder.issued

    assert run_threads(2, body, settings=Settings(flight_recorder=0)) == [([], {}, 0)] * 2


def test_an_async_call_is_queued_then_started_then_completed() -> None:
    def body(g: ProcessGroup) -> Call:
        work = api.all_reduce(torch.ones(4), group=g, async_op=True)
        assert work is not None
        work.wait()
        return _calls(g)[-1]

    for call in run_threads(2, body):
        assert call.state == COMPLETED and call.t_queued <= call.t_start <= call.t_end


def test_a_mismatched_call_is_recorded_as_failed_with_its_error() -> None:
    def body(g: ProcessGroup) -> Call:
        with pytest.raises(CollectiveMismatchError):
            if g.group_rank == 0:
                api.all_reduce(torch.ones(4), group=g)
            else:
                api.broadcast(torch.ones(4), src=0, group=g)
        return _calls(g)[-1]

    for rank, call in enumerate(run_threads(2, body)):
        assert call.state == FAILED, call.what()
        assert call.op == ("all_reduce" if rank == 0 else "broadcast")
        assert call.error.startswith("CollectiveMismatchError: "), call.error
        assert "collective mismatch" in call.error, call.error


def test_sends_and_receives_are_recorded_with_peer_and_tag() -> None:
    def body(g: ProcessGroup) -> list[tuple[str, int, int, int, int]]:
        t = torch.ones(16)
        if g.group_rank == 0:
            p2p.send(t, dst=1, group=g, tag=3)
        else:
            p2p.recv(t, src=None, group=g, tag=3)  # from any rank: the sender is filled in
        return [(c.op, c.peer, c.tag, c.nbytes, c.state) for c in _calls(g)]

    assert run_threads(2, body) == [[("send", 1, 3, 64, COMPLETED)],
                                    [("recv", 0, 3, 64, COMPLETED)]]


def test_totals_count_calls_bytes_seconds_and_failures_per_op() -> None:
    def body(g: ProcessGroup) -> dict[str, Any]:
        for _ in range(5):
            api.all_reduce(torch.ones(1024), group=g)
        api.all_gather([torch.empty(3) for _ in range(2)], torch.ones(3), group=g)
        return {op: dataclasses.astuple(s) for op, s in g.recorder.totals().items()}

    for totals in run_threads(2, body):
        count, nbytes, seconds, failed = totals["all_reduce"]
        assert (count, nbytes, failed) == (5, 5 * 4096, 0) and seconds > 0, totals
        assert totals["all_gather"][:2] == (1, 2 * 3 * 4), totals  # the whole output


def test_totals_are_exact_across_the_laps_they_are_added_up_in() -> None:
    # totals of collectives are added up once per lap of the ring; a reader counts the
    # current lap itself, so every count is exact whenever it is read, and sizes of every
    # kind (the signature's tensor, a non-contiguous one) are counted
    laps = 3

    def body(g: ProcessGroup) -> list[tuple[int, int]]:
        seen = []
        for n in range(1, laps * 4 + 3):
            api.all_reduce(torch.ones(4, 2).t(), group=g)  # 32 bytes, not contiguous
            totals = g.recorder.totals()["all_reduce"]
            seen.append((totals.count, totals.bytes))
        return seen

    expected = [(n, 32 * n) for n in range(1, laps * 4 + 3)]
    assert run_threads(2, body, settings=Settings(flight_recorder=4)) == [expected, expected]


def test_totals_are_exact_over_laps_of_one_op_and_laps_of_several() -> None:
    # a lap of one op's ended calls is added up in a few passes, others a call at a time:
    # laps 1-2 hold only all_reduce, laps 3-4 mix in broadcasts; counts, bytes and time
    # must add up the same either way
    def body(g: ProcessGroup) -> dict[str, tuple[int, int, int]]:
        start = time.monotonic()
        for n in range(17):
            if n >= 8 and n % 3 == 0:
                api.broadcast(torch.ones(3), src=0, group=g)
            else:
                api.all_reduce(torch.ones(n + 1), group=g)
        elapsed = time.monotonic() - start
        totals = g.recorder.totals()
        assert all(0 < t.seconds <= elapsed for t in totals.values()), (totals, elapsed)
        return {op: (t.count, t.bytes, t.failed) for op, t in totals.items()}

    casts = [n for n in range(17) if n >= 8 and n % 3 == 0]
    reduces = [n for n in range(17) if n not in casts]
    expected = {"all_reduce": (len(reduces), sum(4 * (n + 1) for n in reduces), 0),
                "broadcast": (len(casts), 12 * len(casts), 0)}
    assert run_threads(2, body, settings=Settings(flight_recorder=4)) == [expected] * 2


def test_totals_count_queued_calls_that_end_after_their_lap_was_added_up() -> None:
    # async calls still queued when the ring wraps are added up once they end, once
    def body(g: ProcessGroup) -> tuple[int, int, int]:
        works = [api.all_reduce(torch.ones(2), group=g, async_op=True) for _ in range(9)]
        for w in works:
            assert w is not None
            w.wait()
        api.all_reduce(torch.ones(2), group=g)  # a lap: adds up what the queue finished
        totals = g.recorder.totals()["all_reduce"]
        return totals.count, totals.bytes, totals.failed

    assert run_threads(2, body, settings=Settings(flight_recorder=2)) == [(10, 80, 0)] * 2


def test_an_op_is_freed_when_its_call_returns_and_its_record_stays() -> None:
    # the ring keeps a small list per call, not the op: 2,000 live ops made every call
    # free one that had left the cache (measured); nothing may need the cycle collector
    import gc
    import weakref

    def body(g: ProcessGroup) -> tuple[bool, list[tuple[int, str, int]]]:
        op = g.new_op("all_reduce", "all_reduce float32[2] op=SUM", "train.py:9")
        op_ref = weakref.ref(op)
        g.run(op, lambda o: None, False, nbytes=8)
        del op
        gc.disable()
        try:
            freed = op_ref() is None
        finally:
            gc.enable()
        return freed, [(c.seq, c.site.decode(), c.nbytes) for c in _calls(g)]

    assert run_threads(2, body) == [(True, [(0, "train.py:9", 8)])] * 2


_SHAPES = (1, 3, 8, 5)  # numel by call, cycling: every call's record differs from its neighbours'


def test_a_wrapping_ring_keeps_each_calls_own_fields_and_call_site() -> None:
    # 3 laps and a bit of a 4-slot ring, calls alternating op, size and call site: every
    # kept record must be the call issued at its sequence number, whole
    def body(g: ProcessGroup) -> list[tuple[int, str, bytes, str, int, int]]:
        for n in range(14):
            numel = _SHAPES[n % len(_SHAPES)]
            if n % 3 == 2:
                api.broadcast(torch.ones(numel), src=0, group=g)  # line A
            else:
                api.all_reduce(torch.ones(numel), group=g)  # line B
        return [(c.seq, c.op, c.sig.split(b" ")[1], c.site.decode(), c.nbytes, c.state)
                for c in _calls(g)]

    lines = {}
    with open(__file__, encoding="utf-8") as f:
        for number, text in enumerate(f, start=1):
            for mark in ("line A", "line B"):
                if text.rstrip().endswith(f"# {mark}"):
                    lines[mark] = f"test_coll_recorder.py:{number}"
    expected = []
    for n in range(10, 14):
        numel = _SHAPES[n % len(_SHAPES)]
        op, mark = ("broadcast", "line A") if n % 3 == 2 else ("all_reduce", "line B")
        expected.append((n, op, f"float32[{numel}]".encode(), lines[mark], 4 * numel, COMPLETED))
    assert run_threads(2, body, settings=Settings(flight_recorder=4)) == [expected] * 2


def test_a_running_call_is_seen_started_with_its_deadline_and_the_same_view() -> None:
    # the watchdog reads the ring while a call waits, and counts its warnings on the view
    # it got: one running call must stay one object, with the deadline its op has
    import threading
    import time

    seen: list[list[Call]] = []
    release = threading.Event()

    def watch(g: ProcessGroup) -> None:
        deadline = time.monotonic() + 10
        while not g.recorder.in_flight() and time.monotonic() < deadline:
            time.sleep(0.005)  # until rank 0's call runs
        seen.extend([g.recorder.in_flight(), g.recorder.in_flight()])
        release.set()

    def body(g: ProcessGroup) -> None:
        watcher = threading.Thread(target=watch, args=(g,))
        if g.group_rank == 0:
            watcher.start()
        else:
            release.wait(10)  # rank 0 waits in the call meanwhile
        api.all_reduce(torch.ones(4), group=g)
        if g.group_rank == 0:
            watcher.join(10)
            seen.append(g.recorder.in_flight())

    run_threads(2, body, op_timeout=7.0)
    first, second, after = seen
    assert len(first) == 1 and first[0] is second[0], (first, second)
    call = first[0]
    assert (call.op, call.seq, call.state) == ("all_reduce", 0, STARTED)
    assert call.deadline == pytest.approx(call.t_start + 7.0), (call.deadline, call.t_start)
    assert after == []  # it ended: nothing in flight


@pytest.mark.procs
def test_the_public_stats_are_per_group_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # tandem.stats() reads the groups of the initialised world
    from tandem.testing import spawn

    assert spawn(2, _stats_rank, timeout=60) == [True, True]


def _stats_rank(rank: int, world_size: int) -> bool:
    sub = tandem.new_group([0, 1], group_desc="pair")
    for _ in range(3):
        tandem.all_reduce(torch.ones(256))
    tandem.all_reduce(torch.ones(2), group=sub)
    stats = tandem.stats()
    assert set(stats) == {"default", "pair"}, stats
    assert stats["default"]["all_reduce"].count == 3, stats
    assert stats["default"]["all_reduce"].bytes == 3 * 1024, stats
    assert tandem.stats(sub) == {"pair": stats["pair"]}
    assert stats["pair"]["all_reduce"].count == 1, stats
    return True
