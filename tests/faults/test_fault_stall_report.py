"""A call that waits longer than ``TANDEM_STALL_WARN`` is reported by every waiting rank,
naming the ranks that have not arrived and what each of them is doing, again at doubling
intervals, long before the call's deadline."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem as dist
from _fault_helpers import attempt, line_of, values, warm_up
from tandem.errors import TandemError
from tandem.testing import launch
from tandem.testing.logs import LogCapture, capture_stall_reports

pytestmark = [pytest.mark.procs, pytest.mark.timeout(120)]

STALL = 1.0  # TANDEM_STALL_WARN in these tests
# the first report may come STALL + the peers' answer time (~1.3 s here) + a tick late;
# the rest is headroom for a loaded 2-core machine
FIRST_REPORT_BY = STALL + 4.0
LATE_FOR = 30.0  # a late rank returns once the waiting rank reported, or after this
ENV = {"TANDEM_STALL_WARN": str(STALL)}


def _sync(name: str) -> str:
    return os.path.join(os.path.dirname(os.environ["TANDEM_TRACE_DIR"]), name)


def _stay_late(reports: int) -> None:
    """Keep the late rank away until the waiting rank has logged ``reports`` reports."""
    deadline = time.monotonic() + LATE_FOR
    while not os.path.exists(_sync(f"report{reports}")) and time.monotonic() < deadline:
        time.sleep(0.02)  # late-rank


def _capture() -> LogCapture:
    """Keeps the stall reports; tells the late rank how many there are (files in a directory)."""
    handler = capture_stall_reports()
    handler.then = lambda _: Path(_sync(f"report{len(handler.records)}")).touch()
    return handler


def _late_sleeper(rank: int, world_size: int) -> Any:
    handler = _capture()
    dist.all_reduce(torch.ones(4))  # everyone is connected
    if rank == 1:
        _stay_late(reports=3)
    start = time.monotonic()
    dist.all_reduce(torch.ones(4))  # late-call
    return handler.since(start)


@pytest.fixture(scope="module")
def late_sleeper() -> dict[int, Any]:
    warm_up()
    return values(launch(2, _late_sleeper, backend="auto", timeout=60, env=ENV), [0, 1])


def test_the_waiting_rank_names_the_late_rank_and_its_sleep_line(late_sleeper: Any) -> None:
    reports = late_sleeper[0]
    assert reports, "rank 0 waited 5 s without a stall report"
    took, first = reports[0]
    assert took < FIRST_REPORT_BY, f"first report after {took:.1f}s:\n{first}"
    line = line_of(__file__, "late-rank")
    expected = [
        "tandem: rank 0 has waited 1 s in all_reduce #1 on group 'default' "
        f"(test_fault_stall_report.py:{line_of(__file__, 'late-call')})",
        "  arrived: rank 0 (1 of 2)",
        f"  rank 1 has not arrived: not in a collective; main thread at "
        f"test_fault_stall_report.py:{line} in _stay_late"]
    assert first.splitlines()[:3] == expected, first
    assert re.search(r"next report at 2 s; the call times out in \d+ s$", first), first


def test_reports_repeat_at_doubling_intervals(late_sleeper: Any) -> None:
    waited = [int(re.search(r"has waited (\d+) s", m).group(1))  # type: ignore[union-attr]
              for _, m in late_sleeper[0]]
    assert len(waited) == 3, late_sleeper[0]  # the late rank came after the third
    for threshold, w in zip([1, 2, 4], waited):
        assert w >= threshold, waited
    assert waited == sorted(waited), waited


def test_a_rank_that_is_not_waiting_reports_nothing(late_sleeper: Any) -> None:
    assert late_sleeper[1] == [], late_sleeper[1]


def _crossed(rank: int, world_size: int) -> Any:
    handler = _capture()
    other = dist.new_group([0, 1], group_desc="other")
    dist.barrier()
    start = time.monotonic()
    # rank 0 waits on the default group, rank 1 on 'other': each is the other's missing rank
    try:
        dist.all_reduce(torch.ones(4), group=None if rank == 0 else other)  # crossed
        error = "none"
    except TandemError as exc:
        error = type(exc).__name__
    return {"reports": handler.since(start), "error": error}


def test_a_missing_rank_in_another_collective_is_named_with_that_call() -> None:
    warm_up()
    out = values(launch(2, _crossed, backend="tcp", timeout=60, op_timeout=6.0, env=ENV),
                 [0, 1])
    for rank, group, site_name in ((0, "other", "default"), (1, "default", "other")):
        reports = out[rank]["reports"]
        assert reports, f"rank {rank} reported nothing"
        _, text = reports[0]
        assert f"in all_reduce #" in text and f"on group '{site_name}'" in text, text
        peer = 1 - rank
        line = line_of(__file__, "crossed")
        assert re.search(rf"rank {peer} has not arrived: in all_reduce #\d+ on group "
                         rf"'{group}' \(test_fault_stall_report.py:{line}\) for \d+ s; main "
                         rf"thread at test_fault_stall_report.py:{line} in _crossed", text), text
        assert out[rank]["error"] == "CollectiveTimeoutError", out[rank]


def _p2p_sleeper(rank: int, world_size: int) -> Any:
    handler = _capture()
    dist.barrier()
    t = torch.zeros(4)
    if rank == 1:
        _stay_late(reports=1)
        dist.send(t, dst=0)
        return []
    start = time.monotonic()
    dist.recv(t, src=1)
    return handler.since(start)


def test_a_receive_that_waits_names_the_sender_and_what_it_does() -> None:
    warm_up()
    out = values(launch(2, _p2p_sleeper, backend="tcp", timeout=60, env=ENV), [0])
    assert out[0], "the receiving rank reported nothing"
    _, text = out[0][0]
    line = line_of(__file__, "late-rank")
    assert text.startswith("tandem: rank 0 has waited 1 s in recv from rank 1 (tag 0) on group "
                           "'default'"), text
    assert (f"  rank 1: not in a collective; main thread at test_fault_stall_report.py:{line} "
            f"in _stay_late") in text, text


def _stopped(rank: int, world_size: int) -> Any:
    handler = _capture()
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    attempt(dist.all_reduce, torch.ones(4))
    return handler.since(start)


def test_a_stopped_rank_is_named_as_not_answering() -> None:
    warm_up()
    outcomes = launch(2, _stopped, backend="tcp", timeout=20, op_timeout=5.0, env=ENV)
    reports = values(outcomes, [0])[0]
    assert reports, "rank 0 reported nothing"
    assert re.search(r"rank 1 has not arrived: no answer within \d+ s \(the process may be "
                     r"stopped", reports[0][1]), reports[0][1]
